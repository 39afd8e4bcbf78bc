"""The CPU native MoE block: a whole sparse MLP block of a step in one native call.

At batch 1 a mixture-of-experts block run module by module is ~30-60 torch operations (router
linear, softmax / sigmoid, top-k, the fused experts, the shared expert's two linears and
activation, its sigmoid gate, adds), each paying Python dispatch; for a 200M MoE model they
cost about as much as streaming the chosen experts' weights. `moe_block` in
`pagedllm/native/kernels/csrc/cpu_moe_block.cpp` runs router, routing, routed experts, shared
expert and the sum as one OpenMP region instead (the math is the module path's; see its header).
The router runs on a packed copy of its weight (the packed GEMM's panels, made with the kernel's
view of the weights and rebuilt by `forget_structures`).

Blocks it takes (`NativeMoeBlock.for_block`):
- `SparseMoeBlock` (models/moe.py: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Qwen3-Next): softmax
  top-k, `renormalize` (norm_topk_prob), an optional shared expert with its sigmoid
  `shared_expert_gate`;
- `DeepseekMoE` (models/deepseek_v2.py: DeepSeek-V2/V3, GLM-4 MoE): `DeepseekRouting`'s softmax
  greedy / group-limited greedy and sigmoid noaux_tc with `e_score_correction_bias`, groups,
  norm_topk_prob, routed_scaling_factor, and the always-on shared experts.

The module path stays the reference and runs everything else, decided per call
(`NativeMoeBlock.__call__` returns None): steps with more rows per expert than the platform's
limit for native linears of packed weights (none where the kernels built: prefill-sized
steps run the kernel's panel form in float32 and bfloat16), tensor / expert parallelism,
redundant experts or a rebalanced placement, EPLB load counting, routed-experts capture, LoRA
(its wrappers replace the experts or the shared linears), quantized experts or shared linears,
biases, and `PAGEDLLM_CPU_MOE_BLOCK=0` or `PAGEDLLM_CPU_FUSED_MOE=0`.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.models.deepseek_v2 import DeepseekMoE
from pagedllm.models.moe import SparseMoeBlock
from pagedllm.native.fused_decoder import _DTYPE_CODES
from pagedllm.native.kernels import abi, cpu_kernels
from pagedllm.platforms import current_platform

MoeBlockWeights = abi.struct("MoeBlockWeights")

_SCORING_CODES = {"softmax": 0, "sigmoid": 1}
_TOPK_METHOD_CODES = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}
_MAX_GROUPS = 256   # the kernel's bound on n_group


def _plain_linear_weight(linear: nn.Module | None, rows: int, cols: int
                         ) -> tuple[torch.Tensor, bool] | None:
    """(weight, packed) of a float linear without bias, [rows, cols] on this rank, whose
    weight the kernel reads; None otherwise."""
    if linear is None or getattr(linear, "bias", None) is not None:
        return None
    method = getattr(linear, "quant_method", None)
    if method is not None and getattr(method, "quantized", False):
        return None
    weight = getattr(linear, "weight", None)
    if (not isinstance(weight, torch.Tensor) or weight.dtype not in _DTYPE_CODES
            or tuple(weight.shape) != (rows, cols) or not weight.is_contiguous()
            or weight.device.type != "cpu"):
        return None
    return weight, bool(getattr(method, "packed", False))


class NativeMoeBlock:
    """Runs one `SparseMoeBlock` or `DeepseekMoE` (`block`) through `moe_block` for the steps
    it takes. Built by `for_block` after loading; holds the block's submodules as they were
    then, and declines a call once any was replaced (a LoRA wrapper) or changed its state.

    Called as `native(x [n, hidden] model dtype)` -> [n, hidden], or None for a step it does
    not take (the block then runs its modules).
    """

    def __init__(self, block: nn.Module, experts: FusedMoE, router: nn.Module,
                 scoring: str, topk_method: str, n_group: int, topk_group: int,
                 renormalize: bool, routed_scaling_factor: float,
                 score_bias: torch.Tensor | None, shared_mlp: nn.Module | None,
                 shared_gate: nn.Module | None, shared_attr: str) -> None:
        self.block = block
        self.experts = experts
        self.router = router
        self.score_bias = score_bias
        self.shared_mlp = shared_mlp
        self.shared_linears = ((shared_mlp.gate_up_proj, shared_mlp.down_proj)
                               if shared_mlp is not None else None)
        self.shared_gate = shared_gate
        self.shared_attr = shared_attr
        self.hidden_size = experts.hidden_size
        self.dtype = experts.w13_weight.dtype
        self.top_k = experts.top_k
        self.num_experts = experts.num_experts
        self.routing = (_SCORING_CODES[scoring], _TOPK_METHOD_CODES[topk_method], n_group,
                        topk_group, int(renormalize), float(routed_scaling_factor))
        self._weights: MoeBlockWeights | None = None
        # The router weight in the packed GEMM's panels, made by `_struct` (None: the kernel
        # reads the module's weight rows); the module path keeps reading `router.weight`.
        self._router_packed: torch.Tensor | None = None
        self._address = 0
        self._lib = cpu_kernels()
        # Most (token, expert) pairs of a step it takes: every size wherever the platform's
        # native linears take every size of packed weights (`fused_decoder_max_tokens`). Its
        # prefill-sized row blocks run in the kernel's panel form (fused_moe_kernel.h), float32
        # and bfloat16 alike (bf16 weights widened per tile, then float32 FMAs): on AVX-512 it
        # ran DeepSeek-V2-Lite 200M's 2048-token block in ~0.9x of the module path's time in
        # float32 (oneDNN GEMMs per expert) and in a fraction of it in bfloat16, where the
        # module path's bf16 GEMMs are slow on CPUs without AMX (docs/benchmarks.md, "MoE
        # prefill in the panel form").
        self._max_pairs = self.num_experts * current_platform.fused_decoder_max_tokens(
            self.dtype, packed_weights=True)

    @classmethod
    def for_block(cls, block: nn.Module) -> NativeMoeBlock | None:
        """A `NativeMoeBlock` for `block` when the kernel supports its structure (SiLU experts
        in float32 / bfloat16 on one rank, hidden and intermediate sizes multiples of 8, float
        router and shared linears without biases); None otherwise. Per-call conditions
        (`__call__`) are checked then."""
        if isinstance(block, DeepseekMoE):
            routing = block.routing
            args = dict(scoring=routing.scoring_func, topk_method=routing.topk_method,
                        n_group=routing.n_group or 0, topk_group=routing.topk_group or 0,
                        renormalize=routing.scoring_func == "sigmoid" and routing.norm_topk_prob,
                        routed_scaling_factor=routing.routed_scaling_factor,
                        score_bias=block.gate.e_score_correction_bias,
                        shared_mlp=block.shared_experts, shared_gate=None,
                        shared_attr="shared_experts")
        elif isinstance(block, SparseMoeBlock):
            args = dict(scoring="softmax", topk_method="greedy", n_group=0, topk_group=0,
                        renormalize=block.experts.renormalize if isinstance(
                            block.experts, FusedMoE) else False,
                        routed_scaling_factor=1.0, score_bias=None,
                        shared_mlp=block.shared_expert, shared_gate=block.shared_expert_gate,
                        shared_attr="shared_expert")
        else:
            return None
        experts = block.experts
        if type(experts) is not FusedMoE or experts.quant_method is not None:
            return None
        if experts.tp_size != 1 or experts.ep_size != 1 or experts.num_redundant_experts:
            return None
        if not isinstance(experts.act_fn, SiluAndMul):
            return None
        hidden, inter = experts.hidden_size, experts.intermediate_size_per_partition
        w13, w2 = experts.w13_weight, experts.w2_weight
        if (w13.dtype not in _DTYPE_CODES or w2.dtype != w13.dtype or hidden % 8 or inter % 8
                or w13.device.type != "cpu" or not w13.is_contiguous()
                or not w2.is_contiguous() or args["n_group"] > _MAX_GROUPS):
            return None
        router = block.gate
        if (router.weight.dtype not in _DTYPE_CODES or not router.weight.is_contiguous()
                or tuple(router.weight.shape) != (experts.num_experts, hidden)):
            return None
        shared = args["shared_mlp"]
        if shared is not None:
            inter_s = shared.down_proj.input_size_per_partition
            gate_up = _plain_linear_weight(shared.gate_up_proj, 2 * inter_s, hidden)
            down = _plain_linear_weight(shared.down_proj, hidden, inter_s)
            if (inter_s % 8 or gate_up is None or down is None
                    or not isinstance(shared.act_fn, SiluAndMul)
                    or gate_up[1] != down[1] or gate_up[0].dtype != down[0].dtype):
                return None
            if args["shared_gate"] is not None and _plain_linear_weight(
                    args["shared_gate"], 1, hidden) is None:
                return None
        return cls(block, experts, router, **args)

    def _applies(self, x: torch.Tensor) -> bool:
        return self._applies_modules() and self._applies_input(x)

    def _applies_modules(self) -> bool:
        # NOTE(dispatch): called once per MoE layer and step, so kept to attribute reads
        # (~100 us of checks and struct building per call measured on a loaded host before).
        # (the modules' own dicts: nn.Module attribute lookups cost microseconds each)
        experts, modules = self.experts, self.block._modules
        if (modules["experts"] is not experts or modules["gate"] is not self.router
                or experts.routed_experts_capture is not None
                or experts.expert_load is not None or not experts.identity_maps):
            return False
        if self.shared_mlp is not None:
            mlp = modules[self.shared_attr]
            linears = mlp._modules
            if (mlp is not self.shared_mlp
                    or linears["gate_up_proj"] is not self.shared_linears[0]
                    or linears["down_proj"] is not self.shared_linears[1]
                    or (self.shared_gate is not None
                        and modules["shared_expert_gate"] is not self.shared_gate)):
                return False
        options = current_platform.options
        return bool(getattr(options, "cpu_moe_block", False) and options.cpu_fused_moe)

    def _applies_input(self, x: torch.Tensor) -> bool:
        if x.dim() != 2 or not x.is_cpu:
            return False
        return self._takes(x.shape[0], x.shape[1], x.dtype)

    def _takes(self, num_tokens: int, hidden: int, dtype: torch.dtype) -> bool:
        return (dtype == self.dtype and hidden == self.hidden_size
                and num_tokens * self.top_k <= self._max_pairs)

    def address(self, num_tokens: int, dtype: torch.dtype) -> int:
        """The address of the block's `MoeBlockWeights` for a step of `num_tokens` rows of
        CPU activations [num_tokens, hidden_size] in `dtype`, or 0 where `__call__` would
        decline that step (the same checks)."""
        if not (self._applies_modules() and self._takes(num_tokens, self.hidden_size, dtype)):
            return 0
        if self._weights is None and not self._struct():
            return 0
        return self._address

    def forget_structures(self) -> None:
        """Rebuild the kernel's view of the weights at the next call (after their storage was
        replaced: sleep mode, weight updates, a reload that unpacked a packed linear)."""
        self._weights = None

    def _struct(self) -> bool:
        """Build the kernel's view of the weights (pointers into them), at the first call after
        construction or `forget_structures`; False when the shared expert's two linears no
        longer agree in packing or dtype (the step then runs the module path)."""
        experts = self.experts
        packed = None
        if self.shared_mlp is not None:
            gate_up, down = self.shared_linears
            packed = (getattr(gate_up.quant_method, "packed", False),
                      getattr(down.quant_method, "packed", False))
        scoring, method, n_group, topk_group, renormalize, scale = self.routing
        w = MoeBlockWeights()
        # NOTE(moe): a packed copy of the router ([E, hidden]: 128 KiB for DeepSeek-V2-Lite
        # 200M in float32) runs the router 2-3.5x faster than its rows at 32 and 2048 rows
        # (docs/benchmarks.md, "The MoE kernel in float32").
        router = self.router.weight.data
        self._router_packed = current_platform.pack_linear_weight(router)
        w.router = (router if self._router_packed is None else self._router_packed).data_ptr()
        w.router_dtype = _DTYPE_CODES[router.dtype]
        w.router_packed = int(self._router_packed is not None)
        w.scoring, w.topk_method, w.n_group, w.topk_group = scoring, method, n_group, topk_group
        w.renormalize, w.routed_scaling_factor = renormalize, scale
        w.score_bias = None if self.score_bias is None else self.score_bias.data_ptr()
        w.w13, w.w2 = experts.w13_weight.data_ptr(), experts.w2_weight.data_ptr()
        w.expert_dtype = _DTYPE_CODES[experts.w13_weight.dtype]
        w.num_experts, w.top_k = experts.num_experts, experts.top_k
        w.intermediate = experts.intermediate_size_per_partition
        if self.shared_mlp is not None:
            gate_up, down = self.shared_linears
            if packed[0] != packed[1] or gate_up.weight.dtype != down.weight.dtype:
                return False
            w.shared_gate_up, w.shared_down = gate_up.weight.data_ptr(), down.weight.data_ptr()
            w.shared_dtype, w.shared_packed = _DTYPE_CODES[gate_up.weight.dtype], int(packed[0])
            w.shared_intermediate = down.input_size_per_partition
            if self.shared_gate is not None:
                w.shared_gate = self.shared_gate.weight.data_ptr()
                w.shared_gate_dtype = _DTYPE_CODES[self.shared_gate.weight.dtype]
        self._weights, self._address = w, ctypes.addressof(w)
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self._applies(x):
            return None
        if self._weights is None and not self._struct():
            return None
        x = x.contiguous()
        out = torch.empty_like(x)
        if x.shape[0] == 0:
            return out
        rc = self._lib.moe_block(self._address, x.data_ptr(), _DTYPE_CODES[x.dtype],
                                 x.shape[0], x.shape[1], out.data_ptr())
        if rc != 0:
            raise RuntimeError(f"moe_block failed with code {rc}")
        return out


def attach_native_moe(model: nn.Module) -> int:
    """Give every MoE block inside `model` that the kernel supports its `NativeMoeBlock`
    (the block's `native_block` slot); returns how many got one (none when the kernels did
    not build)."""
    attached = 0
    if cpu_kernels() is None:
        return 0
    for module in model.modules():
        if isinstance(module, (SparseMoeBlock, DeepseekMoE)):
            native = NativeMoeBlock.for_block(module)
            module.native_block = native
            attached += native is not None
    return attached
