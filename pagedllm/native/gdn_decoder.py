"""The native Gated DeltaNet layer half of Qwen3-Next for steps of few tokens (decode).

A Qwen3-Next linear-attention layer run module by module spends, at batch 1, most of its
mixer's time in Python and torch dispatch: ~25 small operations (the input GemmaRMSNorm, four
input projections, the conv and delta-rule kernels with their wrappers, the gates, the gated
RMSNorm, out_proj, the residual add and the post-attention norm) for a few hundred kilobytes
of weights (docs/benchmarks.md, "Batch-1 decode of the 200M presets"). `gdn_decoder_mixer` in
`csrc/cpu_gdn_decoder.cpp` runs all of it from C++ in one call (its header gives the math: the
module path's, with the module path's own conv and delta-rule kernels on the same state
slots). The MoE / MLP half stays a module.

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

from pagedllm.layers import state_kernels
from pagedllm.layers.state_cache import StateCache
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.native.mla_decoder import _is_packed, _is_quantized, native_attention_enabled

GDNLayerWeights = abi.struct("GDNLayerWeights")

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


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
    `mixer(hidden [n, hidden_size])` -> (hidden + mixer(input_norm(hidden)),
    post_attention_layernorm of that), both [n, hidden_size] in the model dtype, or None for a
    step it does not take (module docstring). The structure is built on the first call and
    rebuilt when the layer's state tensors were replaced (`forget_structures` after weight
    changes: the conv weight, A and dt_bias are copied at build)."""

    MAX_TOKENS = 256

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
        w = GDNLayerWeights()
        w.input_norm = layer.input_layernorm.weight.data_ptr()
        w.post_norm = layer.post_attention_layernorm.weight.data_ptr()
        (w.in_proj_qkv, w.in_proj_z, w.in_proj_b, w.in_proj_a,
         w.out_proj) = (m.weight.data_ptr() for m in self.linears)
        w.conv_weight, w.neg_a, w.dt_bias = conv_w.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr()
        w.norm_weight = mixer.norm.weight.data_ptr()
        w.conv_states, w.recurrent_states = conv_state.data_ptr(), recurrent.data_ptr()
        w.hidden_size = layer.input_layernorm.weight.shape[0]
        w.num_k_heads, w.num_v_heads = mixer.num_k_heads, mixer.num_v_heads
        w.head_k_dim, w.head_v_dim = mixer.head_k_dim, mixer.head_v_dim
        w.conv_kernel = mixer.conv1d.weight.shape[-1]
        w.conv_state_dtype = _DTYPE_CODES[conv_state.dtype]
        for i, m in enumerate(self.linears):
            w.packed[i] = int(_is_packed(m))
        w.eps, w.norm_eps = layer.input_layernorm.eps, mixer.norm_eps
        self._keep = [conv_w, neg_a, dt_bias]
        self._struct, self._states = w, states
        self.scratch_floats = self._lib.gdn_scratch_floats(ctypes.addressof(w))

    def __call__(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        n = hidden.shape[0]
        if (n > self.MAX_TOKENS or hidden.dtype != self.dtype or hidden.ndim != 2
                or state_kernels.DEFAULT_BACKEND is not None
                or _gdn_linears(self.mixer) != self.linears):
            return None
        states = self.mixer.state.states
        if self._struct is None or len(states) != 2 or any(
                a is not b for a, b in zip(states, self._states)):
            self._build(tuple(states))
        meta = StateCache.metadata()
        batch = state_kernels._native_batch(meta, states[0].shape[0])
        if batch.num_tokens != n:
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


def attach_native_mixers(model: torch.nn.Module) -> int:
    """Give every Gated DeltaNet layer inside `model` that `NativeGDNMixer.supports` a
    `NativeGDNMixer` (its `native_mixer`); returns how many layers got one."""
    scratch = GDNScratch()
    attached = 0
    for module in model.modules():
        if hasattr(module, "native_mixer") and NativeGDNMixer.supports(module):
            module.native_mixer = NativeGDNMixer(module, scratch)
            attached += 1
    return attached


def refresh_native_mixers(model: torch.nn.Module) -> None:
    """After `model`'s weights changed, make every native mixer rebuild its structure."""
    for module in model.modules():
        mixer = getattr(module, "native_mixer", None)
        if isinstance(mixer, NativeGDNMixer):
            mixer.forget_structures()
