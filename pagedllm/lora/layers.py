"""LoRA by wrapping: `wrap_lora_layers` replaces a Llama-family model's projections with
`LoRALinear`s (the base layer inside, unchanged) and hands their slots to the model's native
decoder stack (the fused decoder applies them inside its layers), so model files carry no LoRA
branch. A MoE model's attention projections (Llama's, or DeepSeek MLA's q/q_a/q_b/kv_a/o),
dense layers and shared experts are wrapped the same way and its routed experts in a
`LoRAFusedMoE` (lora/moe.py).

Every wrapper reads the same `LoRAStepState`, which the runner sets once per step
(`LoRAModelManager.set_active_loras`) before the forward: the step's adapter tokens by slot.
NOTE(lora): this state object is handed to the wrappers when they are built instead of going
through the forward context, which carries the attention metadata for layers/attention.py
only.

Merged layers hold one slice per checkpoint projection:

    qkv_proj:     [ q_proj | k_proj | v_proj ]      gate_up_proj: [ gate_proj | up_proj ]

Tensor parallelism shards A and B like their base layer (vLLM's and Punica's layout): a
column-parallel base (qkv_proj, gate_up_proj) keeps A whole and holds this rank's output rows of
each projection's B (the k/v rows of the KV heads it holds, replicated heads included); a
row-parallel base (o_proj, down_proj) holds this rank's input columns of A and all of B, and its
partial sums x_shard A_shard^T B^T are added to the base layer's before the one all-reduce
(summed over ranks: x A^T B^T).

    column-parallel, rank t:   A [r, in]              B^T [r, this rank's rows of each slice]
    row-parallel, rank t:      A [r, in / tp] (t-th)   B^T [r, out]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedllm.layers.linear import RowParallelLinear
from pagedllm.lora.ops import LoRAMapping, add_lora
from pagedllm.lora.moe import EXPERT_SLICES, LoRAFusedMoE
from pagedllm.models.deepseek_v2 import DeepseekMLAAttention, DeepseekMoE
from pagedllm.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from pagedllm.models.moe import MoeDecoderLayer, SparseMoeBlock
from pagedllm.native.attach import NativeDecoderStack
from pagedllm.native.kernels.lora import NativeLoRAStep, lora_linear_weights


@dataclass
class LoRAStepState:
    """The step's adapter tokens by slot (`lora.ops.LoRAMapping`); None = no token of this
    step has an adapter (the wrappers then add nothing and the native stack may run)."""

    mapping: LoRAMapping | None = None
    # True only during the runner's forward of the target model: the embedding's adapters
    # (lora/vocab.py) apply to those lookups, not to a drafter's of the same embedding.
    embedding_armed: bool = False

    def native_step(self) -> NativeLoRAStep | None:
        """The step's adapter tokens for the native kernels (None: no adapter token)."""
        return None if self.mapping is None else self.mapping.native


@dataclass(frozen=True)
class LoRASlice:
    """One checkpoint projection inside a (possibly merged) layer's output rows.

    Attributes:
        module: the checkpoint projection (q_proj, ...).
        offset, size: its rows in this rank's output of the layer.
        shard: which `size` rows of the projection's B this rank holds: rows
            [shard * size, (shard + 1) * size) (0 for an unsharded output).
    """

    module: str
    offset: int
    size: int
    shard: int = 0


class LoRALinear(nn.Module):
    """A linear layer plus the step's adapters: y = base(x) + per token x A_s^T B_s^T, where s
    is the adapter slot of the token's request (none for base tokens). The slots (lora/ops.py
    layouts) are allocated once and written in place, so the native structure pointing at them
    (`native`, for the CPU kernels and the fused decoder) stays valid. Under tensor parallelism
    the slots hold this rank's shards (module docstring); for a row-parallel base the adapter's
    partial sums join the base layer's before its all-reduce.

    Args:
        base_layer: the model's linear layer (any quantization method; its output is float).
        slices: its output rows per checkpoint projection.
        max_loras, max_lora_rank: slot count and width.
        state: the step state shared by all wrappers.
        device, dtype: of the A/B buffers (the activations': a quantized base stays quantized).
    """

    def __init__(self, base_layer: nn.Module, slices: list[LoRASlice], max_loras: int,
                 max_lora_rank: int, state: LoRAStepState, device: torch.device,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.base_layer = base_layer
        self.slices = slices
        self.max_lora_rank = max_lora_rank
        self.state = state
        width = len(slices) * max_lora_rank
        self.register_buffer("lora_a", torch.zeros(
            max_loras, width, base_layer.input_size_per_partition, device=device, dtype=dtype),
            persistent=False)
        self.register_buffer("lora_b", torch.zeros(
            max_loras, width, base_layer.output_size_per_partition, device=device, dtype=dtype),
            persistent=False)
        self.slice_ends = tuple(p.offset + p.size for p in slices)
        # A row-parallel base: its rank's input columns of A, and the reduce after the adapter.
        self.row_parallel = isinstance(base_layer, RowParallelLinear)
        self.input_offset = (base_layer.tp_rank * base_layer.input_size_per_partition
                             if self.row_parallel else 0)
        self.native = lora_linear_weights(self.lora_a, self.lora_b, self.slice_ends,
                                          max_lora_rank)

    def reset_lora(self, slot: int) -> None:
        """Zero slot `slot` (an adapter that leaves this layer out then adds nothing)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()

    def set_lora(self, slot: int, slice_index: int, lora_a: torch.Tensor,
                 lora_b: torch.Tensor) -> None:
        """Write one projection's A [r, in_features] and scaled B [out_features, r] (whole,
        as in the checkpoint) into slot `slot`, keeping this rank's shard of each (r <=
        max_lora_rank; the rest of the slot's width stays zero)."""
        rank = lora_a.shape[0]
        start = slice_index * self.max_lora_rank
        piece = self.slices[slice_index]
        self.lora_a[slot, start:start + rank].copy_(
            lora_a.narrow(1, self.input_offset, self.lora_a.shape[2]))
        self.lora_b[slot, start:start + rank, piece.offset:piece.offset + piece.size].copy_(
            lora_b.narrow(0, piece.shard * piece.size, piece.size).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mapping = self.state.mapping
        if mapping is None:
            return self.base_layer(x)
        # Row-parallel: x is this rank's input shard, and its partial LoRA sum joins the base
        # layer's partial output before the all-reduce, so both are reduced once.
        row = self.row_parallel
        y = self.base_layer.forward_partial(x) if row else self.base_layer(x)
        add_lora(x, y, self.lora_a, self.lora_b, self.native, mapping, self.max_lora_rank,
                 self.slice_ends)
        return self.base_layer.reduce_partial(y) if row else y


class LoRAGatedLayerStack:
    """A model's native decoder stack (`LlamaModel.layer_stack`) that declines every step with
    adapter tokens: for a stack that cannot apply adapters (not a `NativeDecoderStack`, or
    slots the native kernels do not take), those steps run the Python layers."""

    def __init__(self, inner, state: LoRAStepState) -> None:
        self.inner = inner
        self.state = state

    def __call__(self, positions, hidden, residual):
        if self.state.mapping is not None:
            return None
        return self.inner(positions, hidden, residual)


def wrap_lora_layers(model: nn.Module, state: LoRAStepState, max_loras: int,
                     max_lora_rank: int, device: torch.device, dtype: torch.dtype
                     ) -> dict[tuple[int, str], tuple[nn.Module, int]]:
    """Wrap the projections of every decoder layer of `model` in `LoRALinear`s: a Llama-family
    layer's, or a MoE model's (Mixtral, OLMoE, Qwen2/3-MoE, DeepSeek-V2/V3, GLM-4 MoE)
    attention projections (Llama's or MLA's), its dense layers' MLPs, its sparse blocks'
    shared experts (and Qwen2-MoE's shared-expert gate) and its routed experts (in a
    `LoRAFusedMoE`, lora/moe.py).

    Returns:
        (layer index, checkpoint module name) -> (its wrapper, slice index), for loading
        adapters into slots (the experts' modules: lora.moe.EXPERT_SLICES).

    Raises:
        ValueError: when `model` has no decoder layer of these kinds, or a layer of another
            kind, or experts `LoRAFusedMoE` refuses.
    """
    targets: dict[tuple[int, str], tuple[nn.Module, int]] = {}

    def wrap(owner: nn.Module, attr: str, layer_idx: int, slices: list[LoRASlice]) -> None:
        wrapper = LoRALinear(getattr(owner, attr), slices, max_loras, max_lora_rank, state,
                             device, dtype)
        setattr(owner, attr, wrapper)
        for i, piece in enumerate(slices):
            targets[(layer_idx, piece.module)] = (wrapper, i)

    for stack in model.modules():
        if not isinstance(stack, LlamaModel):
            continue
        dense = True
        for idx in range(stack.start_layer, stack.end_layer):
            layer = stack.layers[idx]
            if type(layer) not in (LlamaDecoderLayer, MoeDecoderLayer):
                raise ValueError(f"LoRA: layer {idx} is a {type(layer).__name__}, not a Llama "
                                 f"or MoE decoder layer")
            if isinstance(layer.self_attn, DeepseekMLAAttention):
                _wrap_mla(layer.self_attn, idx, wrap)
                dense = False
            else:
                _wrap_attention(layer.self_attn, idx, wrap)
            mlp = layer.mlp
            if isinstance(mlp, (SparseMoeBlock, DeepseekMoE)):
                mlp.experts = LoRAFusedMoE(mlp.experts, max_loras, max_lora_rank, state,
                                           device, dtype)
                for i, module in enumerate(EXPERT_SLICES):
                    targets[(idx, module)] = (mlp.experts, i)
                # The shared expert is a plain MLP (Qwen2-MoE's `shared_expert` with its
                # sigmoid gate, DeepSeek's `shared_experts`): ordinary LoRA on its linears.
                for prefix in ("shared_expert", "shared_experts"):
                    if getattr(mlp, prefix, None) is not None:
                        _wrap_mlp(getattr(mlp, prefix), idx, wrap, f"{prefix}.")
                if getattr(mlp, "shared_expert_gate", None) is not None:
                    wrap(mlp, "shared_expert_gate", idx, [LoRASlice("shared_expert_gate", 0, 1)])
                dense = False
                continue
            if not isinstance(mlp, LlamaMLP):
                raise ValueError(f"LoRA: layer {idx}'s MLP is a {type(mlp).__name__}, which "
                                 f"LoRA does not cover")
            _wrap_mlp(mlp, idx, wrap, "")
        native = stack.layer_stack
        layer_wrappers = [[getattr(owner, attr) for owner, attr in (
            (stack.layers[i].self_attn, "qkv_proj"), (stack.layers[i].self_attn, "o_proj"),
            (stack.layers[i].mlp, "gate_up_proj"), (stack.layers[i].mlp, "down_proj"))]
            for i in range(stack.start_layer, stack.end_layer)] if dense else []
        if dense and isinstance(native, NativeDecoderStack) and all(
                w.native is not None for ws in layer_wrappers for w in ws):
            native.fused.attach_lora([[w.native for w in ws] for ws in layer_wrappers],
                                     state.native_step)
        elif native is not None:
            stack.layer_stack = LoRAGatedLayerStack(native, state)
    if not targets:
        raise ValueError(f"LoRA: {type(model).__name__} has no Llama-family or MoE decoder "
                         f"layers")
    return targets


def _wrap_mlp(mlp: LlamaMLP, idx: int, wrap, prefix: str) -> None:
    """Wrap a SwiGLU MLP's merged gate_up_proj and its down_proj (a dense layer's MLP, or a
    MoE block's shared expert: `prefix` "shared_expert." / "shared_experts.")."""
    gate, up = (s // mlp.gate_up_proj.tp_size for s in mlp.gate_up_proj.output_sizes)
    tp_rank = mlp.gate_up_proj.tp_rank
    wrap(mlp, "gate_up_proj", idx, [LoRASlice(f"{prefix}gate_proj", 0, gate, tp_rank),
                                    LoRASlice(f"{prefix}up_proj", gate, up, tp_rank)])
    wrap(mlp, "down_proj", idx,
         [LoRASlice(f"{prefix}down_proj", 0, mlp.down_proj.output_size_per_partition)])


def _wrap_mla(attn: DeepseekMLAAttention, idx: int, wrap) -> None:
    """Wrap DeepSeek MLA's projections that run as linear layers: q_proj (or q_a_proj and
    q_b_proj), kv_a_proj_with_mqa and o_proj. kv_b_proj is read per head, never as a linear
    layer, and stays without adapters (lora.peft.REFUSED_MODULES refuses adapters on it).
    q_proj / q_b_proj are column-parallel by heads (this rank's rows of B); q_a_proj and
    kv_a_proj_with_mqa are replicated (all of B on every rank)."""
    names = ["kv_a_proj_with_mqa", "o_proj"] + (
        ["q_proj"] if attn.q_lora_rank is None else ["q_a_proj", "q_b_proj"])
    for name in names:
        base = getattr(attn, name)
        wrap(attn, name, idx, [LoRASlice(name, 0, base.output_size_per_partition,
                                         getattr(base, "tp_rank", 0)
                                         if name in ("q_proj", "q_b_proj") else 0)])


def _wrap_attention(attn: nn.Module, idx: int, wrap) -> None:
    """Wrap a decoder layer's merged qkv_proj and its o_proj (Llama's attention, OLMoE's)."""
    q, kv = attn.q_size, attn.kv_size
    # This rank's q heads, and its KV heads (one KV head may serve several ranks).
    tp_rank, kv_shard = attn.qkv_proj.tp_rank, \
        attn.qkv_proj.tp_rank // attn.qkv_proj.num_kv_head_replicas
    wrap(attn, "qkv_proj", idx, [LoRASlice("q_proj", 0, q, tp_rank),
                                 LoRASlice("k_proj", q, kv, kv_shard),
                                 LoRASlice("v_proj", q + kv, kv, kv_shard)])
    wrap(attn, "o_proj", idx, [LoRASlice("o_proj", 0, attn.o_proj.output_size_per_partition)])
