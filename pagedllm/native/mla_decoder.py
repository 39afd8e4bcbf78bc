"""The native MLA attention block of DeepSeek-V2 / V3 layers for steps of few tokens (decode).

A DeepSeek decoder layer run module by module spends, at batch 1, most of its attention half in
Python and torch dispatch: ~60 small operations (two RMSNorms, three or four projections, the
splits, the interleaved RoPE, the latent write, two per-head bmm, the attention kernel and its
wrapper) for a few hundred kilobytes of weights (docs/benchmarks.md, "Batch-1 decode of the 200M
presets"). `mla_decoder_attention` in `csrc/cpu_mla_decoder.cpp` runs the layer's whole attention
half, from the input RMSNorm to the post-attention RMSNorm, as one OpenMP parallel region (its
header gives the math: the module path's absorbed MLA). The MLP / MoE half stays a module.

`NativeMLABlock(layer, state)` is attached to a layer (`MoeDecoderLayer.native_attention`) by
`attach_native_attention` after loading, when the layer qualifies (`supports`: CPU, the model
dtype float32 or bfloat16, float weights in it, one tensor-parallel rank, no attention bias);
per step it declines (returns None) whatever it does not take (`NativeMLABlock.__call__`): not
the `mla_cpu_paged` backend, a row that the backend would run in the expanded form (fresh
prefills), the batch-invariant mode, a quantized latent cache, more than MAX_TOKENS tokens, LoRA
adapters on the layer's projections, a KV connector. Those steps, and every step with
`PAGEDLLM_CPU_NATIVE_ATTENTION=0`, run the module path, which remains the reference.
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.attention.backends.mla_cpu import MLACpuMetadata
from pagedllm.attention.forward_context import get_forward_context
from pagedllm.distributed.parallel_state import get_tensor_model_parallel_world_size
from pagedllm.native.fused_decoder import _DTYPE_CODES, _is_packed, _is_quantized
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.platforms import current_platform

MLALayerWeights = abi.struct("MLALayerWeights")
NativeAttentionStep = abi.struct("NativeAttentionStep")

def native_attention_enabled() -> bool:
    """False when `PAGEDLLM_CPU_NATIVE_ATTENTION` is 0/false/off/no (the module path runs)."""
    return current_platform.options.cpu_native_attention


def _mla_linears(attn) -> tuple:
    """(q_proj or q_a_proj, q_b_proj or None, kv_a_proj_with_mqa, o_proj) of an MLA module."""
    if attn.q_lora_rank is None:
        return attn.q_proj, None, attn.kv_a_proj_with_mqa, attn.o_proj
    return attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.o_proj


class MLAStepState:
    """The step's `NativeAttentionStep` and float32 scratch, shared by a model's native MLA
    blocks (one step at a time): built by the first layer of a step, reused by the others."""

    def __init__(self) -> None:
        self.metadata = None        # the step's MLACpuMetadata the structure was built for
        self.positions = None       # and its positions tensor
        self.num_tokens = 0
        self.taken = False          # whether the step passed the per-step checks
        self.step = NativeAttentionStep()
        self.scratch = torch.empty(0, dtype=torch.float32)
        self.keep: tuple = ()       # the step's tensors the structure points into

    def prepare(self, metadata: MLACpuMetadata, positions: torch.Tensor, block: NativeMLABlock
                ) -> bool:
        """Build the step's structure for `metadata` (once per step); False when the step is
        not taken (a row in the expanded form, a position past the RoPE tables)."""
        if metadata is self.metadata and positions is self.positions:
            return self.taken
        self.metadata, self.positions = metadata, positions
        self.num_tokens, self.taken = positions.shape[0], False
        n = self.num_tokens
        common = metadata.common
        split = metadata.split(block.dims)
        if (len(split.kernel_tokens) != n or common.attend_until is not None
                or common.block_table.dtype != torch.int32 or common.block_table.stride(1) != 1
                or int(metadata.seq_lens.max(initial=0)) > block.max_position):
            return False
        positions = positions if positions.dtype == torch.int64 else positions.long()
        slots = common.slot_mapping[:n]
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            slots = slots.to(torch.int64).contiguous()
        needed = n * block.scratch_floats
        if self.scratch.numel() < needed:
            self.scratch = torch.empty(needed, dtype=torch.float32)
        rows = split.kernel_rows
        s = self.step
        s.num_tokens, s.positions, s.slot_mapping = n, positions.data_ptr(), slots.data_ptr()
        s.block_table = common.block_table.data_ptr()
        s.block_table_stride = common.block_table.stride(0)
        s.query_start_loc = metadata.query_start_loc.ctypes.data
        s.seq_lens = metadata.seq_lens.ctypes.data
        s.rows, s.num_rows = rows.ctypes.data, len(rows)
        s.block_size, s.causal = common.block_size, int(common.causal)
        s.query_tile, s.scratch = split.query_tile, self.scratch.data_ptr()
        self.keep = (positions, slots, rows, self.scratch)
        self.taken = True
        return True


class NativeAttentionHalf:
    """What the native attention halves share (`NativeMLABlock`, and Qwen3-Next's
    `NativeGatedAttention` in native/gdn_decoder.py): the layer, its linears and dtype, the
    step state shared by the model's layers, and the per-layer native structure, built by the
    subclass's `_build(kv_cache)` on the first call and again when the KV cache tensor was
    replaced or `forget_structures` was called (weights changed)."""

    MAX_TOKENS = 256   # larger steps run the module path (prefill chunks)

    def __init__(self, layer, state, linears: tuple) -> None:
        self.layer = layer
        self.attn = layer.self_attn
        self.linears = linears
        self.state = state
        self.dtype = layer.input_layernorm.weight.dtype
        self.dtype_code = _DTYPE_CODES[self.dtype]
        self.max_position = self.attn.rotary_emb.cos_cache.shape[0]
        self._struct = None
        self._cache = None
        self._keep: list[torch.Tensor] = []
        self.scratch_floats = 0
        self._lib = cpu_kernels()

    def forget_structures(self) -> None:
        """Rebuild the native structure at the next call (weights' storage or values changed;
        the RoPE tables are copied at build)."""
        self._struct = None
        self._cache = None

    def _build(self, kv_cache: torch.Tensor) -> None:
        raise NotImplementedError

    def _rope_tables(self, tensors: list[torch.Tensor], what: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Float32 copies of the layer's RoPE cos / sin tables (kept alive by the structure),
        after checking that `tensors` (the weights and cache the structure points into) are
        contiguous.

        Raises:
            ValueError: one of them is not (`what` names them).
        """
        if not all(t.is_contiguous() for t in tensors):
            raise ValueError(f"{what} must be contiguous")
        rope = self.attn.rotary_emb
        cos = rope.cos_cache.detach().to(torch.float32).contiguous()
        sin = rope.sin_cache.detach().to(torch.float32).contiguous()
        self._keep = [cos, sin]
        return cos, sin

    def _structure_address(self) -> int:
        """The address of the layer's native structure over its current KV cache (rebuilt if
        needed), or 0 where the cache is not the paged layout in the model dtype."""
        kv_cache = self.attn.attn.kv_cache
        if kv_cache.dtype != self.dtype or kv_cache.dim() != 5:
            return 0
        if kv_cache is not self._cache or self._struct is None:
            self._build(kv_cache)
        return ctypes.addressof(self._struct)


class NativeMLABlock(NativeAttentionHalf):
    """A DeepSeek decoder layer's attention half (input norm .. post-attention norm) in one
    native call: `block(positions [n] int64, hidden [n, hidden_size], residual | None)`
    -> (normed [n, hidden_size] for the MLP, residual [n, hidden_size]) in the model dtype, as
    `LlamaDecoderLayer.forward`'s first three steps return them (the residual updated in place,
    a fresh copy when None came in), or None for a step it does not take (module docstring).
    The per-layer structure is built on the first call and rebuilt when the latent cache tensor
    was replaced (`forget_structures` after weight changes).
    """

    def __init__(self, layer, state: MLAStepState) -> None:
        attn = layer.self_attn
        super().__init__(layer, state, _mla_linears(attn))
        self.dims = (attn.qk_nope_head_dim, attn.qk_rope_head_dim, attn.v_head_dim,
                     attn.kv_lora_rank)

    @staticmethod
    def supports(layer) -> bool:
        """Whether `layer` (a DeepSeek `MoeDecoderLayer`) can ever take the native block."""
        from pagedllm.models.deepseek_v2 import DeepseekMLAAttention
        attn = getattr(layer, "self_attn", None)
        # (exactly the V2 / V3 module: V3.2's subclass attends sparsely, DSA)
        if (type(attn) is not DeepseekMLAAttention or cpu_kernels() is None
                or not native_attention_enabled()
                or get_tensor_model_parallel_world_size() != 1):
            return False
        dtype = layer.input_layernorm.weight.dtype
        linears = [m for m in _mla_linears(attn) if m is not None]
        norms = [layer.input_layernorm, layer.post_attention_layernorm, attn.kv_a_layernorm]
        if attn.q_lora_rank is not None:
            norms.append(attn.q_a_layernorm)
        from pagedllm.layers.layernorm import RMSNorm
        return (dtype in _DTYPE_CODES and layer.input_layernorm.weight.device.type == "cpu"
                and all(type(m) is RMSNorm and m.weight.dtype == dtype for m in norms)
                and all(not _is_quantized(m) and m.weight.dtype == dtype
                        and getattr(m, "bias", None) is None for m in linears)
                and attn.kv_b_proj.weight.dtype == dtype
                and attn.qk_rope_head_dim % 2 == 0 and attn.qk_rope_head_dim <= 256
                and attn.kv_lora_rank % 8 == 0 and layer.input_layernorm.weight.shape[0] % 8 == 0
                and all(m.input_size_per_partition % 8 == 0 for m in linears))

    def _build(self, kv_cache: torch.Tensor) -> None:
        attn, layer = self.attn, self.layer
        q, q_b, kv_a, o = self.linears
        rope = attn.rotary_emb
        cos, sin = self._rope_tables(
            [m.weight for m in self.linears if m is not None] + [attn.kv_b_proj.weight, kv_cache],
            "native MLA block: weights and latent cache")
        w = MLALayerWeights()
        w.input_norm = layer.input_layernorm.weight.data_ptr()
        w.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        w.q_proj = q.weight.data_ptr()
        if q_b is not None:
            w.q_a_norm = attn.q_a_layernorm.weight.data_ptr()
            w.q_b_proj = q_b.weight.data_ptr()
        w.kv_a_proj = kv_a.weight.data_ptr()
        w.kv_a_norm = attn.kv_a_layernorm.weight.data_ptr()
        w.kv_b = attn.kv_b_proj.weight.data_ptr()
        w.o_proj = o.weight.data_ptr()
        w.latent_cache = kv_cache.data_ptr()
        w.cos_cache, w.sin_cache = cos.data_ptr(), sin.data_ptr()
        w.hidden_size = layer.input_layernorm.weight.shape[0]
        w.num_heads = attn.num_heads
        w.q_lora_rank = attn.q_lora_rank or 0
        w.kv_lora_rank, w.qk_nope_head_dim = attn.kv_lora_rank, attn.qk_nope_head_dim
        w.qk_rope_head_dim, w.v_head_dim = attn.qk_rope_head_dim, attn.v_head_dim
        w.rope_interleaved = int(rope.interleaved)
        for i, m in enumerate(self.linears):
            w.packed[i] = int(m is not None and _is_packed(m))
        w.eps = layer.input_layernorm.eps
        w.latent_eps = attn.kv_a_layernorm.eps
        w.scale = attn.attn.scale
        self._struct, self._cache = w, kv_cache
        self.scratch_floats = self._lib.mla_step_scratch_floats(ctypes.addressof(w))

    def prepare(self, positions: torch.Tensor, dtype: torch.dtype) -> int:
        """The per-step checks of `__call__` for a step at `positions` ([n]) with activations
        in `dtype`; builds the structure and the step's state if needed. Returns the address
        of the layer's `MLALayerWeights` (the step's is `state.step`), or 0 for a step it does
        not take."""
        context = get_forward_context()
        metadata = context.attn_metadata
        n = positions.shape[0]
        if (context.kv_hooks is not None or type(metadata) is not MLACpuMetadata
                or metadata.torch_metadata is not None or n > self.MAX_TOKENS
                or metadata.common.num_actual_tokens != n or dtype != self.dtype
                or positions.ndim != 1):
            return 0
        if _mla_linears(self.attn) != self.linears:   # a wrapper (LoRA) replaced a projection
            return 0
        address = self._structure_address()
        if not address or not self.state.prepare(metadata, positions, self):
            return 0
        return address

    def loop_address(self, num_reqs: int, max_seq_len: int) -> int:
        """For the native decode loop (native/decode_loop.py), which builds its own step: the
        checks of `prepare` that do not read a step's metadata, for decode steps of `num_reqs`
        rows of sequences up to `max_seq_len` tokens. The address of the layer's
        `MLALayerWeights`, or 0."""
        if (num_reqs > self.MAX_TOKENS or max_seq_len > self.max_position
                or _mla_linears(self.attn) != self.linears):
            return 0
        return self._structure_address()

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not self.prepare(positions, hidden.dtype):
            return None
        if residual is None:
            residual, delta = hidden.clone(memory_format=torch.contiguous_format), None
        else:
            residual = residual.contiguous()
            delta = hidden.contiguous()
        out = torch.empty_like(residual)
        rc = self._lib.mla_decoder_attention(
            ctypes.addressof(self._struct), ctypes.addressof(self.state.step),
            residual.data_ptr(), None if delta is None else delta.data_ptr(), out.data_ptr(),
            self.dtype_code)
        if rc != 0:
            raise RuntimeError(f"mla_decoder_attention failed ({rc})")
        return out, residual


def attach_native_attention(model: torch.nn.Module) -> int:
    """Give every DeepSeek MLA decoder layer inside `model` that `NativeMLABlock.supports` a
    `NativeMLABlock` (its `native_attention`, one `MLAStepState` per model); returns how many
    layers got one."""
    state = MLAStepState()
    attached = 0
    for module in model.modules():
        if hasattr(module, "native_attention") and NativeMLABlock.supports(module):
            module.native_attention = NativeMLABlock(module, state)
            attached += 1
    return attached


def refresh_native_attention(model: torch.nn.Module) -> None:
    """After `model`'s weights changed, make every native MLA block rebuild its structure."""
    for module in model.modules():
        block = getattr(module, "native_attention", None)
        if isinstance(block, NativeMLABlock):
            block.forget_structures()
