"""The decoder layers of a DeepSeek-V2/V3 / GLM-4-MoE or Qwen3-Next stack in one native call
per step (`NativeHybridStack`), for decode and small steps on the CPU.

Each layer of these models has two native halves, each one call from Python: the attention /
token-mixer half (`native/mla_decoder.py` MLA, `native/gdn_decoder.py` Gated DeltaNet and
gated attention) and the MLP half (`native/moe_block.py`). Between them, per layer, Python
checks the step, allocates the outputs and converts the ctypes arguments; at batch 1 of a
small model that is a share of the step that llama.cpp does not pay. `hybrid_decoder_layers`
(`csrc/cpu_hybrid_stack.cpp`) calls the same two entry points for every layer from one loop
over the step's buffers, so tokens and logprobs are the per-half path's.

A dense MLP layer (DeepSeek's first `first_k_dense_replace` layers, Qwen3-Next's dense layers)
runs as a MoE block without routed experts whose shared expert is the MLP (`NativeDenseMlp`).
Qwen3-Next's final GemmaRMSNorm runs in the same call (`HybridStep.final_norm`): the native
decode loop (native/decode_loop.py) computes it with the same code, so a round's later steps
in the loop give the bits of single steps through the stack.

The stack is attached (`attach_native_hybrid_stacks`, from `native/attach.py`) to a model all
of whose layers have a native first half and a native (or dense) MLP half; per step it takes the
step only where every layer's two halves would take it (their own `prepare` / `address`
checks) and returns None otherwise: the layers then run one by one as before, each half
deciding for itself. So the stack declines exactly where some half declines.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.models.llama import LlamaMLP
from pagedllm.native.fused_decoder import _DTYPE_CODES
from pagedllm.native.gdn_decoder import NativeGatedAttention, NativeGDNMixer
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.native.mla_decoder import NativeMLABlock
from pagedllm.native.moe_block import MoeBlockWeights, NativeMoeBlock, _plain_linear_weight
from pagedllm.platforms import current_platform

HybridLayer = abi.struct("HybridLayer")
HybridStep = abi.struct("HybridStep")

# HybridLayer.kind (abi.py)
MLA, GATED_DELTANET, GATED_ATTENTION = 0, 1, 2


class NativeDenseMlp:
    """A dense SiLU `LlamaMLP` (float weights without bias) as a `MoeBlockWeights` with no
    routed experts and the MLP as its shared expert: `moe_block` then computes
    down(silu(x Wg^T) * (x Wu^T)) with the shared expert's roundings, which are the MLP's.
    Build with `for_mlp` (None where the MLP does not qualify)."""

    def __init__(self, mlp: LlamaMLP, hidden: int, inter: int, dtype: torch.dtype,
                 packed: bool) -> None:
        self.mlp = mlp
        self.linears = (mlp.gate_up_proj, mlp.down_proj)
        self.hidden_size, self.intermediate, self.dtype, self.packed = hidden, inter, dtype, packed
        self._weights: MoeBlockWeights | None = None
        self._address = 0

    @classmethod
    def for_mlp(cls, mlp: nn.Module) -> NativeDenseMlp | None:
        if type(mlp) is not LlamaMLP or not isinstance(mlp.act_fn, SiluAndMul):
            return None
        inter = mlp.down_proj.input_size_per_partition
        hidden = mlp.down_proj.output_size_per_partition
        gate_up = _plain_linear_weight(mlp.gate_up_proj, 2 * inter, hidden)
        down = _plain_linear_weight(mlp.down_proj, hidden, inter)
        if (gate_up is None or down is None or hidden % 8 or inter % 8
                or gate_up[1] != down[1] or gate_up[0].dtype != down[0].dtype):
            return None
        return cls(mlp, hidden, inter, gate_up[0].dtype, gate_up[1])

    def forget_structures(self) -> None:
        self._weights = None

    def address(self, num_tokens: int, dtype: torch.dtype) -> int:
        """The block's `MoeBlockWeights` address, or 0: a projection replaced (LoRA), the MoE
        block switched off (`PAGEDLLM_CPU_MOE_BLOCK=0` / `PAGEDLLM_CPU_FUSED_MOE=0`), or
        activations in another dtype than the weights."""
        modules = self.mlp._modules
        options = current_platform.options
        if (dtype != self.dtype or modules["gate_up_proj"] is not self.linears[0]
                or modules["down_proj"] is not self.linears[1]
                or not (getattr(options, "cpu_moe_block", False) and options.cpu_fused_moe)):
            return 0
        if self._weights is None:
            gate_up, down = self.linears
            code = _DTYPE_CODES[self.dtype]
            w = MoeBlockWeights()
            # No routed experts: the router and expert pointers are never read.
            w.router, w.router_dtype = gate_up.weight.data_ptr(), code
            w.w13, w.w2, w.expert_dtype = gate_up.weight.data_ptr(), down.weight.data_ptr(), code
            w.num_experts, w.top_k, w.intermediate = 0, 0, self.intermediate
            w.routed_scaling_factor = 1.0
            w.shared_gate_up, w.shared_down = gate_up.weight.data_ptr(), down.weight.data_ptr()
            w.shared_dtype, w.shared_packed = code, int(self.packed)
            w.shared_intermediate = self.intermediate
            self._weights, self._address = w, ctypes.addressof(w)
        return self._address


def _mlp_half(mlp: nn.Module):
    """The native MLP half of a layer's `mlp`: its `NativeMoeBlock`, a `NativeDenseMlp`, or
    None."""
    native = getattr(mlp, "native_block", None)
    if isinstance(native, NativeMoeBlock):
        return native
    return NativeDenseMlp.for_mlp(mlp)


class NativeHybridStack:
    """All decoder layers of one DeepSeek (`MoeModel`, kind MLA) or Qwen3-Next
    (`HybridForCausalLM`, kinds GATED_DELTANET / GATED_ATTENTION) stack in one native call.

    Called as the model's `layer_stack`: DeepSeek `stack(positions [n] int64, hidden [n, H],
    residual | None)` -> the final-normed hidden [n, H]; Qwen3-Next `stack(positions, hidden)`
    -> the final-normed hidden. None for a step it does not take (module docstring).
    """

    def __init__(self, layers: list[nn.Module], mixer_attr: str, mixers: list, mlps: list,
                 kinds: list[int], norm: nn.Module, dtype: torch.dtype,
                 hidden_size: int) -> None:
        self.layer_modules, self.mixer_attr = layers, mixer_attr
        self.mixers, self.mlps, self.kinds = mixers, mlps, kinds
        self.norm = norm
        self.dtype = dtype
        self.dtype_code = _DTYPE_CODES[dtype]
        self.hidden_size = hidden_size
        self.layers = (HybridLayer * len(mixers))()
        for s, kind in zip(self.layers, kinds):
            s.kind = kind
        self.step = HybridStep(hidden_size=hidden_size, dtype=self.dtype_code)
        self._buffers = torch.empty(0, dtype=dtype)
        self._lib = cpu_kernels()

    def forget_structures(self) -> None:
        for mlp in self.mlps:
            mlp.forget_structures()

    def _halves_attached(self) -> bool:
        """Whether every layer still has the halves this stack runs (a half detached or
        replaced since: that layer's modules run, so the stack does not)."""
        attr = self.mixer_attr
        for layer, mixer, mlp in zip(self.layer_modules, self.mixers, self.mlps):
            if (layer.__dict__.get(attr) is not mixer or type(mlp) is NativeMoeBlock
                    and layer._modules["mlp"].__dict__.get("native_block") is not mlp):
                return False
        return True

    def loop_ready(self, num_reqs: int, max_seq_len: int) -> bool:
        """For the native decode loop: whether decode steps of `num_reqs` rows up to
        sequences of `max_seq_len` tokens pass every half's checks that do not read a step's
        metadata (the mixers' `loop_address`, `NativeMoeBlock.address`); fills the layer
        structures if so."""
        if not self._halves_attached():
            return False
        for s, mixer, mlp in zip(self.layers, self.mixers, self.mlps):
            address = mixer.loop_address(num_reqs, max_seq_len)
            mlp_address = address and mlp.address(num_reqs, self.dtype)
            if not mlp_address:
                return False
            s.mixer, s.mlp = address, mlp_address
        return True

    def prepare(self, positions: torch.Tensor) -> bool:
        """Run every half's per-step checks for a step at `positions` ([n] int64) and fill the
        layer and step structures (all but the buffers); False where some half declines."""
        n, dtype = positions.shape[0], self.dtype
        layers, step = self.layers, self.step
        batch = None
        if not self._halves_attached():
            return False
        for s, kind, mixer, mlp in zip(layers, self.kinds, self.mixers, self.mlps):
            if kind == GATED_DELTANET:
                batch = mixer.prepare(n, dtype)
                address = 0 if batch is None else mixer.struct_address
            else:
                address = mixer.prepare(positions, dtype)
            mlp_address = address and mlp.address(n, dtype)
            if not mlp_address:
                return False
            s.mixer, s.mlp = address, mlp_address
        step.num_tokens = n
        kinds = self.kinds
        step.mla_step = (ctypes.addressof(self.mixers[0].state.step)
                         if MLA in kinds else None)
        if GATED_ATTENTION in kinds:
            ga = self.mixers[kinds.index(GATED_ATTENTION)]
            step.attention_step = ctypes.addressof(ga.state.step)
        if batch is not None:
            gdn = self.mixers[kinds.index(GATED_DELTANET)]
            step.state_batch = batch.ptr
            step.state_scratch = gdn.scratch.get(
                n * max(m.scratch_floats for m, k in zip(self.mixers, kinds)
                        if k == GATED_DELTANET)).data_ptr()
        return True

    def buffers(self, n: int) -> torch.Tensor:
        """[3, n, hidden] scratch rows in the model dtype (hidden, normed, mlp_out)."""
        needed = 3 * n * self.hidden_size
        if self._buffers.numel() < needed:
            self._buffers = torch.empty(needed, dtype=self.dtype)
        return self._buffers[:needed].view(3, n, self.hidden_size)

    def set_final_norm(self, step: HybridStep, out: torch.Tensor) -> None:
        """Qwen3-Next stacks: make `step` end with the final GemmaRMSNorm into `out` ([n, H]
        model dtype, contiguous)."""
        step.final_norm = self.norm.weight.data_ptr()
        step.final_norm_eps = self.norm.eps
        step.out = out.data_ptr()

    def run(self, stream: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The layers over `stream` ([n, H] model dtype, contiguous, updated in place; see
        `HybridStep.stream`) after a `prepare` that took; for MLA stacks `delta` ([n, H]) is
        the previous stage's output to add first (or None). Returns the last layer's output
        (MLA stacks: the MLP output not yet added to `stream`); Qwen3-Next stacks: the final
        norm of `stream`, in the same call (as the native decode loop computes it)."""
        n = stream.shape[0]
        buf = self.buffers(n)
        hidden = buf[0]
        if delta is not None:
            hidden.copy_(delta)
        step = self.step
        step.stream, step.hidden = stream.data_ptr(), hidden.data_ptr()
        step.normed, step.mlp_out = buf[1].data_ptr(), buf[2].data_ptr()
        step.add_first = int(delta is not None)
        out = hidden
        if MLA not in self.kinds:
            out = torch.empty_like(stream)
            self.set_final_norm(step, out)
        rc = self._lib.hybrid_decoder_layers(ctypes.addressof(self.layers), len(self.mixers),
                                             ctypes.addressof(step))
        if rc != 0:
            raise RuntimeError(f"hybrid_decoder_layers failed ({rc})")
        return out

    def __call__(self, positions: torch.Tensor, hidden: torch.Tensor,
                 residual: torch.Tensor | None = None, aux_layers: tuple[int, ...] = ()
                 ) -> torch.Tensor | None:
        if (aux_layers or positions.ndim != 1 or hidden.dtype != self.dtype
                or hidden.shape[0] != positions.shape[0] or not self.prepare(positions)):
            return None
        if MLA in self.kinds:
            if residual is None:
                stream, delta = hidden.clone(memory_format=torch.contiguous_format), None
            else:
                stream, delta = residual.contiguous(), hidden
            out = self.run(stream, delta)
            normed, _ = self.norm(out, stream)
            return normed
        stream = hidden.clone(memory_format=torch.contiguous_format)
        return self.run(stream, None)


def _deepseek_stack(module: nn.Module) -> NativeHybridStack | None:
    """The stack of a DeepSeek `MoeModel` (one pipeline stage, the last) whose every layer has
    a native MLA block and a native MLP half."""
    from pagedllm.models.moe import MoeModel
    if type(module) is not MoeModel or not (module.pp.is_first_rank and module.pp.is_last_rank):
        return None
    layers = list(module.layers[module.start_layer:module.end_layer])
    mixers = [getattr(layer, "native_attention", None) for layer in layers]
    if not layers or not all(isinstance(m, NativeMLABlock) for m in mixers):
        return None
    mlps = [_mlp_half(layer.mlp) for layer in layers]
    if any(m is None for m in mlps) or len({m.dtype for m in mixers + mlps}) != 1:
        return None
    return NativeHybridStack(layers, "native_attention", mixers, mlps, [MLA] * len(layers),
                             module.norm, mixers[0].dtype, module.hidden_size)


def _qwen3_next_stack(model: nn.Module) -> NativeHybridStack | None:
    """The stack of a Qwen3-Next `HybridForCausalLM` whose every layer has a native first half
    and a native MLP half (and no embedding multiplier), and whose final norm is a
    GemmaRMSNorm in the model dtype (computed in the stack's call: `run`)."""
    from pagedllm.layers.layernorm import GemmaRMSNorm
    from pagedllm.models.qwen3_next import Qwen3NextDecoderLayer
    stack_name, _, norm_name = model._module_names
    layers = list(model._layer_list())
    norm = getattr(getattr(model, stack_name), norm_name)
    if not layers or model.embedding_multiplier is not None or not all(
            type(layer) is Qwen3NextDecoderLayer for layer in layers) \
            or type(norm) is not GemmaRMSNorm or not norm.weight.is_contiguous():
        return None
    mixers = [layer.native_mixer for layer in layers]
    kinds = [GATED_DELTANET if isinstance(m, NativeGDNMixer) else GATED_ATTENTION
             if isinstance(m, NativeGatedAttention) else None for m in mixers]
    mlps = [_mlp_half(layer.mlp) for layer in layers]
    if (None in kinds or any(m is None for m in mlps)
            or len({m.dtype for m in mixers + mlps} | {norm.weight.dtype}) != 1):
        return None
    return NativeHybridStack(layers, "native_mixer", mixers, mlps, kinds, norm,
                             mixers[0].dtype, model.config.hidden_size)


def attach_native_hybrid_stacks(model: nn.Module) -> int:
    """Give every DeepSeek `MoeModel` and Qwen3-Next model inside `model` whose layers all have
    native halves a `NativeHybridStack` (their `layer_stack`); returns how many got one. Call
    after the halves were attached."""
    from pagedllm.models.hybrid import HybridForCausalLM
    if cpu_kernels() is None:
        return 0
    attached = 0
    for module in model.modules():
        stack = None
        if isinstance(module, HybridForCausalLM):
            stack = _qwen3_next_stack(module)
        elif hasattr(module, "layer_stack") and getattr(module, "layer_stack") is None:
            stack = _deepseek_stack(module)
        if stack is not None:
            module.layer_stack = stack
            attached += 1
    return attached
