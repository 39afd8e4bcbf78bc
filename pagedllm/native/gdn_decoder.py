"""The native Gated DeltaNet and gated-attention layer halves of Qwen3-Next, for decode and
prefill steps.

A Qwen3-Next linear-attention layer run module by module spends, at batch 1, most of its
mixer's time in Python and torch dispatch: ~25 small operations (the input GemmaRMSNorm, four
input projections, the conv and delta-rule kernels with their wrappers, the gates, the gated
RMSNorm, out_proj, the residual add and the post-attention norm) for a few hundred kilobytes
of weights (docs/benchmarks.md, "Batch-1 decode of the 200M presets"). `gdn_decoder_mixer` in
`csrc/cpu_gdn_decoder.cpp` runs all of it from C++ in one call (its header gives the math: the
module path's, with the module path's own conv and delta-rule kernels on the same state
slots). The MoE / MLP half stays a module.

Prefill steps take the same call (up to MAX_TOKENS tokens, which bounds the float32 scratch:
~21 KB per token for the 200M preset's Gated DeltaNet layer): the module path there ran the
gates, norms and casts as ~20 torch passes over [n, 512-1024] tensors and the projections as
four GEMMs, two of 8 rows (docs/benchmarks.md, "Qwen3-Next batch 32: the Gated DeltaNet
prefill in one native call").

`NativeGDNMixer(layer, scratch)` is attached to a linear-attention `Qwen3NextDecoderLayer`
(`native_mixer`) by `attach_native_mixers` after loading, when the layer qualifies (`supports`:
CPU kernels, the model dtype float32 or bfloat16, float weights in it, no LoRA-wrapped
projection); per step it declines (returns None) more than MAX_TOKENS tokens, a forced
state-op backend (`state_kernels.DEFAULT_BACKEND`), a wrapped projection. Those steps, and
every step with `PAGEDLLM_CPU_NATIVE_ATTENTION=0`, run the module path (the reference).
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.attention.backends.cpu_paged import CpuPagedMetadata
from pagedllm.attention.forward_context import get_forward_context
from pagedllm.attention.metadata import KVCacheGroupsMetadata
from pagedllm.layers import state_kernels
from pagedllm.layers.state_cache import StateCache
from pagedllm.native.fused_decoder import _DTYPE_CODES, _is_packed, _is_quantized
from pagedllm.native.kernels import abi, cpu_kernels, ops
from pagedllm.native.mla_decoder import NativeAttentionHalf, native_attention_enabled

GDNLayerWeights = abi.struct("GDNLayerWeights")
GatedAttentionWeights = abi.struct("GatedAttentionWeights")
NativeAttentionStep = abi.struct("NativeAttentionStep")


def _ga_linears(attn) -> tuple:
    return attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj


def _gdn_linears(mixer) -> tuple:
    return (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a,
            mixer.out_proj)


class GDNScratch:
    """Float32 scratch shared by a model's native mixers (one layer at a time)."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.float32)

    def get(self, floats: int) -> torch.Tensor:
        if self.buffer.numel() < floats:
            self.buffer = torch.empty(floats, dtype=torch.float32)
        return self.buffer


class NativeGDNMixer:
    """A Gated DeltaNet layer's first half in one native call:
    `mixer(positions [n], hidden [n, hidden_size])` -> (hidden + mixer(input_norm(hidden)),
    post_attention_layernorm of that), both [n, hidden_size] in the model dtype, or None for a
    step it does not take (module docstring). The structure is built on the first call and
    rebuilt when the layer's state tensors were replaced (`forget_structures` after weight
    changes: the conv weight, A and dt_bias are copied at build; the input projections are
    stacked, `_stacked_in_proj`)."""

    MAX_TOKENS = 8192

    def __init__(self, layer, scratch: GDNScratch) -> None:
        self.layer = layer
        self.mixer = layer.linear_attn
        self.linears = _gdn_linears(self.mixer)
        self.dtype = layer.input_layernorm.weight.dtype
        self.dtype_code = _DTYPE_CODES[self.dtype]
        self.scratch = scratch
        self._struct = None
        self._states: tuple = ()
        self._keep: list[torch.Tensor] = []
        self.scratch_floats = 0
        self._lib = cpu_kernels()

    @staticmethod
    def supports(layer) -> bool:
        """Whether `layer` (a `Qwen3NextDecoderLayer`) can ever take the native mixer."""
        from pagedllm.layers.layernorm import GemmaRMSNorm
        from pagedllm.models.qwen3_next import GatedDeltaNet
        mixer = getattr(layer, "linear_attn", None)
        if (type(mixer) is not GatedDeltaNet or cpu_kernels() is None
                or not native_attention_enabled()):
            return False
        dtype = layer.input_layernorm.weight.dtype
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        return (dtype in _DTYPE_CODES and layer.input_layernorm.weight.device.type == "cpu"
                and all(type(m) is GemmaRMSNorm and m.weight.dtype == dtype for m in norms)
                and mixer.norm.weight.dtype == dtype
                and all(not _is_quantized(m) and m.weight.dtype == dtype
                        and getattr(m, "bias", None) is None
                        and getattr(m, "tp_size", 1) == 1 for m in _gdn_linears(mixer))
                and all(m.input_size_per_partition % 8 == 0 for m in _gdn_linears(mixer)))

    def forget_structures(self) -> None:
        """Rebuild the native structure at the next call."""
        self._struct = None
        self._states = ()

    def _build(self, states: tuple) -> None:
        mixer, layer = self.mixer, self.layer
        conv_state, recurrent = states
        for t in [m.weight for m in self.linears] + [conv_state, recurrent]:
            if not t.is_contiguous():
                raise ValueError("native Gated DeltaNet mixer: weights and states must be "
                                 "contiguous")
        if recurrent.dtype != torch.float32 or conv_state.dtype not in _DTYPE_CODES:
            raise ValueError(f"native Gated DeltaNet mixer: state dtypes {conv_state.dtype}, "
                             f"{recurrent.dtype} (need float32/bfloat16 and float32)")
        conv_w = mixer.conv1d.weight[:, 0].detach().float().contiguous()
        neg_a = (-mixer.A_log.detach().float().exp()).contiguous()
        dt_bias = mixer.dt_bias.detach().float().contiguous()
        in_proj, in_packed = self._stacked_in_proj()
        w = GDNLayerWeights()
        w.input_norm = layer.input_layernorm.weight.data_ptr()
        w.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        w.in_proj, w.out_proj = in_proj.data_ptr(), mixer.out_proj.weight.data_ptr()
        w.conv_weight, w.neg_a, w.dt_bias = conv_w.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr()
        w.norm_weight = mixer.norm.weight.data_ptr()
        w.conv_states, w.recurrent_states = conv_state.data_ptr(), recurrent.data_ptr()
        w.hidden_size = layer.input_layernorm.weight.shape[0]
        w.num_k_heads, w.num_v_heads = mixer.num_k_heads, mixer.num_v_heads
        w.head_k_dim, w.head_v_dim = mixer.head_k_dim, mixer.head_v_dim
        w.conv_kernel = mixer.conv1d.weight.shape[-1]
        w.conv_state_dtype = _DTYPE_CODES[conv_state.dtype]
        w.packed[0], w.packed[1] = int(in_packed), int(_is_packed(mixer.out_proj))
        w.eps, w.norm_eps = layer.input_layernorm.eps, mixer.norm_eps
        self._keep = [conv_w, neg_a, dt_bias, in_proj]
        self._struct, self._states = w, states
        self.scratch_floats = self._lib.gdn_scratch_floats(ctypes.addressof(w))

    def _current_struct(self, n: int, dtype: torch.dtype) -> bool:
        """The checks of a step of `n` tokens in `dtype` that do not read its metadata; builds
        the structure over the layer's current state tensors if needed. False: declined."""
        if (n > self.MAX_TOKENS or dtype != self.dtype
                or state_kernels.DEFAULT_BACKEND is not None
                or _gdn_linears(self.mixer) != self.linears):
            return False
        states = self.mixer.state.states
        if self._struct is None or len(states) != 2 or any(
                a is not b for a, b in zip(states, self._states)):
            self._build(tuple(states))
        return True

    def loop_address(self, num_reqs: int, max_seq_len: int) -> int:
        """For the native decode loop (native/decode_loop.py), which builds its own state
        batch: the checks of `prepare` that do not read a step's metadata, for decode steps of
        `num_reqs` rows (any length: the state has none). The address of the layer's
        `GDNLayerWeights`, or 0."""
        return self.struct_address if self._current_struct(num_reqs, self.dtype) else 0

    @property
    def num_slots(self) -> int:
        """The state tensors' slot count (after a `prepare` or `loop_address` that took)."""
        return self._states[0].shape[0]

    def _stacked_in_proj(self) -> tuple[torch.Tensor, bool]:
        """The four input projections' weights stacked as one [conv_dim + value_dim + 2 H_v,
        hidden] weight (rows in_proj_qkv | in_proj_z | in_proj_b | in_proj_a), so that a step
        runs one GEMM (the packed GEMM's 8-row tail panels of in_proj_b / in_proj_a alone ran
        at ~3 GFLOP/s, docs/benchmarks.md). Packed when all four are: the packed layout of the
        stack, whose row panels are each part's own panels wherever a part starts on a
        16-row panel boundary. Each projection whose weight equals its rows of the stack is
        re-pointed at them (same shape, dtype and layout), so the stack costs no memory
        beyond the parts that do not line up (in_proj_b / in_proj_a when packed). Returns
        (stack, packed)."""
        parts = self.linears[:4]
        packed = all(_is_packed(m) for m in parts)
        # NOTE(q3n-b32): built outside inference mode (the first build runs inside a forward):
        # the projections' weights become views of the stack, and an inference tensor there
        # would refuse a later in-place weight load.
        with torch.inference_mode(False):
            rows = [m.weight.data if not packed else m.quant_method.unpacked_weight(m)
                    for m in parts]
            stack = torch.cat(rows).contiguous()
            if packed:
                stack = ops.pack_linear_weight(stack, self._lib)
            start = 0
            for m in parts:
                n = m.weight.shape[0]
                view = stack[start:start + n]
                if torch.equal(view, m.weight.data):
                    m.weight.data = view
                start += n
        return stack, packed

    def prepare(self, n: int, dtype: torch.dtype):
        """The per-step checks of `__call__` for a step of `n` tokens with activations in
        `dtype`; builds the structure if needed. Returns the step's state batch
        (`StateBatchArgs`; the layer's structure is then `struct_address`), or None for a step
        it does not take."""
        if not self._current_struct(n, dtype):
            return None
        states = self._states
        meta = StateCache.metadata()
        batch = state_kernels._native_batch(meta, states[0].shape[0])
        return batch if batch.num_tokens == n else None

    @property
    def struct_address(self) -> int:
        """The address of the layer's `GDNLayerWeights` (after a `prepare` that took)."""
        return ctypes.addressof(self._struct)

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        n = hidden.shape[0]
        if hidden.ndim != 2:
            return None
        batch = self.prepare(n, hidden.dtype)
        if batch is None:
            return None
        hidden = hidden.contiguous()
        hidden_out, post_normed = torch.empty_like(hidden), torch.empty_like(hidden)
        scratch = self.scratch.get(n * self.scratch_floats)
        rc = self._lib.gdn_decoder_mixer(ctypes.addressof(self._struct), batch.ptr, n,
                                         hidden.data_ptr(), hidden_out.data_ptr(),
                                         post_normed.data_ptr(), scratch.data_ptr(),
                                         self.dtype_code)
        if rc != 0:
            raise ValueError("gdn_decoder_mixer: a request's state slot (or a slot it emits a "
                             "checkpoint to) is out of range of the state tensor")
        return hidden_out, post_normed


class NativeGatedAttention(NativeAttentionHalf):
    """A Qwen3-Next gated-attention layer's first half in one native call, with the interface of
    `NativeGDNMixer`: (hidden + o_proj(attention * sigmoid(gate)), its post-attention norm), or
    None for a step it does not take: not the `cpu_paged` backend's metadata, a KV connector,
    `attend_until`, the batch-invariant mode, a KV cache in another dtype, more than MAX_TOKENS
    tokens, a wrapped projection. Every request of a taken step (fresh prefills too) attends in
    the paged kernel, as the fused decoder's layers do (native/fused_decoder.py)."""

    MAX_TOKENS = NativeGDNMixer.MAX_TOKENS   # prefill steps too (the module docstring)

    def __init__(self, layer, state: AttentionStepState) -> None:
        super().__init__(layer, state, _ga_linears(layer.self_attn))

    @staticmethod
    def supports(layer) -> bool:
        """Whether `layer` (a `Qwen3NextDecoderLayer`) can ever take the native block."""
        from pagedllm.layers.layernorm import GemmaRMSNorm
        from pagedllm.models.qwen3_next import GatedAttention
        attn = getattr(layer, "self_attn", None)
        if (type(attn) is not GatedAttention or cpu_kernels() is None
                or not native_attention_enabled()):
            return False
        dtype = layer.input_layernorm.weight.dtype
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.q_norm, attn.k_norm]
        rope = attn.rotary_emb
        return (dtype in _DTYPE_CODES and layer.input_layernorm.weight.device.type == "cpu"
                and all(type(m) is GemmaRMSNorm and m.weight.dtype == dtype for m in norms)
                and all(not _is_quantized(m) and m.weight.dtype == dtype
                        and getattr(m, "bias", None) is None
                        and getattr(m, "tp_size", 1) == 1 for m in _ga_linears(attn))
                and all(m.input_size_per_partition % 8 == 0 for m in _ga_linears(attn))
                and rope.long_position_offset is None and rope.rotary_dim % 2 == 0
                and attn.attn.sliding_window is None and attn.attn.logits_soft_cap is None)

    def _build(self, kv_cache: torch.Tensor) -> None:
        attn, layer = self.attn, self.layer
        rope = attn.rotary_emb
        cos, sin = self._rope_tables([m.weight for m in self.linears] + [kv_cache],
                                     "native gated attention: weights and KV cache")
        w = GatedAttentionWeights()
        w.input_norm = layer.input_layernorm.weight.data_ptr()
        w.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        w.q_proj, w.k_proj, w.v_proj, w.o_proj = (m.weight.data_ptr() for m in self.linears)
        w.q_norm, w.k_norm = attn.q_norm.weight.data_ptr(), attn.k_norm.weight.data_ptr()
        w.key_cache, w.value_cache = kv_cache[0].data_ptr(), kv_cache[1].data_ptr()
        w.cos_cache, w.sin_cache = cos.data_ptr(), sin.data_ptr()
        w.hidden_size = layer.input_layernorm.weight.shape[0]
        w.num_heads, w.num_kv_heads = attn.num_heads, attn.num_kv_heads
        w.head_size, w.rotary_dim = attn.head_size, rope.rotary_dim
        for i, m in enumerate(self.linears):
            w.packed[i] = int(_is_packed(m))
        w.eps, w.scale = layer.input_layernorm.eps, attn.attn.scale
        self._struct, self._cache = w, kv_cache
        self.scratch_floats = self._lib.gated_attention_scratch_floats(ctypes.addressof(w))

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> int:
        """The per-step checks of `__call__` for a step at `positions` ([n]) with activations
        in `dtype`; builds the structure and the step's state if needed. Returns the address
        of the layer's `GatedAttentionWeights` (the step's is `state.step`), or 0 for a step
        it does not take."""
        context = get_forward_context()
        metadata = context.attn_metadata
        n = positions.shape[0]
        if isinstance(metadata, KVCacheGroupsMetadata):
            metadata = metadata.for_layer(None)
        if (context.kv_hooks is not None or type(metadata) is not CpuPagedMetadata
                or n > self.MAX_TOKENS or dtype != self.dtype or positions.ndim != 1
                or metadata.common.num_actual_tokens != n
                or metadata.common.attend_until is not None
                or metadata.common.batch_invariant
                or _ga_linears(self.attn) != self.linears):
            return 0
        address = self._structure_address()
        if not address or not self.state.prepare(metadata, positions, self.max_position,
                                                  n * self.scratch_floats):
            return 0
        return address

    def loop_address(self, num_reqs: int, max_seq_len: int) -> int:
        """For the native decode loop (native/decode_loop.py), which builds its own step: the
        checks of `prepare` that do not read a step's metadata, for decode steps of `num_reqs`
        rows of sequences up to `max_seq_len` tokens (the KV hooks, the backend and the
        batch-invariant mode are the loop's own checks). The address of the layer's
        `GatedAttentionWeights`, or 0."""
        if (num_reqs > self.MAX_TOKENS or max_seq_len > self.max_position
                or _ga_linears(self.attn) != self.linears):
            return 0
        return self._structure_address()

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if hidden.shape[0] != positions.shape[0] or not self.prepare(positions, hidden.dtype):
            return None
        hidden = hidden.contiguous()
        hidden_out, post_normed = torch.empty_like(hidden), torch.empty_like(hidden)
        rc = self._lib.gated_attention_mixer(ctypes.addressof(self._struct),
                                             ctypes.addressof(self.state.step),
                                             hidden.data_ptr(), hidden_out.data_ptr(),
                                             post_normed.data_ptr(), self.dtype_code)
        if rc != 0:
            raise RuntimeError(f"gated_attention_mixer failed ({rc})")
        return hidden_out, post_normed


class AttentionStepState:
    """The step's `NativeAttentionStep` over a `CpuPagedMetadata` (every request in the
    kernel) and the float32 scratch, shared by a model's gated-attention layers."""

    def __init__(self) -> None:
        self.metadata = None
        self.positions = None
        self.taken = False
        self.step = NativeAttentionStep()
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.keep: tuple = ()

    def prepare(self, metadata: CpuPagedMetadata, positions: torch.Tensor, max_position: int,
                scratch_floats: int) -> bool:
        """Build the step's structure (once per step); False when a position is past the RoPE
        tables or the block table is not int32 with unit column stride."""
        if self.scratch.numel() < scratch_floats:
            self.scratch = torch.empty(scratch_floats, dtype=torch.float32)
            self.step.scratch = self.scratch.data_ptr()
        if metadata is self.metadata and positions is self.positions:
            return self.taken
        self.metadata, self.positions, self.taken = metadata, positions, False
        common = metadata.common
        n = positions.shape[0]
        if (common.block_table.dtype != torch.int32 or common.block_table.stride(1) != 1
                or int(metadata.seq_lens.max(initial=0)) > max_position):
            return False
        pos = positions if positions.dtype == torch.int64 else positions.long()
        slots = common.slot_mapping[:n]
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        rows = metadata.all_rows
        s = self.step
        s.num_tokens, s.positions, s.slot_mapping = n, pos.data_ptr(), slots.data_ptr()
        s.block_table = common.block_table.data_ptr()
        s.block_table_stride = common.block_table.stride(0)
        s.query_start_loc = metadata.query_start_loc.ctypes.data
        s.seq_lens = metadata.seq_lens.ctypes.data
        s.rows, s.num_rows = rows.ctypes.data, len(rows)
        s.block_size, s.causal, s.query_tile = common.block_size, int(common.causal), 0
        s.scratch = self.scratch.data_ptr()
        self.keep = (pos, slots, rows)
        self.taken = True
        return True


def attach_native_mixers(model: torch.nn.Module) -> int:
    """Give every Qwen3-Next layer inside `model` that `NativeGDNMixer.supports` (Gated
    DeltaNet) or `NativeGatedAttention.supports` (gated attention) its native block (the
    layer's `native_mixer`); returns how many layers got one."""
    scratch, state = GDNScratch(), AttentionStepState()
    attached = 0
    for module in model.modules():
        if not hasattr(module, "native_mixer"):
            continue
        if NativeGDNMixer.supports(module):
            module.native_mixer = NativeGDNMixer(module, scratch)
        elif NativeGatedAttention.supports(module):
            module.native_mixer = NativeGatedAttention(module, state)
        else:
            continue
        attached += 1
    return attached


def refresh_native_mixers(model: torch.nn.Module) -> None:
    """After `model`'s weights changed, make every native mixer rebuild its structure."""
    for module in model.modules():
        mixer = getattr(module, "native_mixer", None)
        if isinstance(mixer, (NativeGDNMixer, NativeGatedAttention)):
            mixer.forget_structures()
