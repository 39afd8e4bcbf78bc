"""What the mixture-of-experts decoders share: the sparse MLP block, the decoder stack, the
causal-LM wrapper and the checkpoint names of expert weights.

    embed -> [ RMSNorm -> attention -> +res -> RMSNorm -> sparse MoE block (or dense MLP) -> +res ]
          x L -> RMSNorm -> LM head

    sparse MoE block:  router `gate` (replicated linear) -> FusedMoE (layers/fused_moe.py)
                       [+ sigmoid(shared_expert_gate(x)) * shared_expert(x)]   (Qwen2-MoE)

A family (`mixtral.py`, `qwen_moe.py`, `olmoe.py`) says which attention and which MLP each layer
has; the stack and the weight loading are here. The CPU fused decoder (`fused_decoder.py`) is
for dense Llama layers and is never used by these models; on the CPU a `SparseMoeBlock` may run
as one native call (`native/moe_block.py`, attached after loading into `native_block`). Forward
takes the flat token batch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import default_weight_loader
from pagedllm.layers.pipeline import PPMissingLayer
from pagedllm.models.llama import LlamaDecoderLayer, LlamaMLP, LlamaModel
from pagedllm.models.utils import call_weight_loader, load_causal_lm_weights, make_lm_head
from pagedllm.platforms import current_platform

# Checkpoint name of one expert's tensor ("model.layers.3.mlp.experts.7.gate_proj.weight") and
# of transformers 5's fused tensors of all experts ("model.layers.3.mlp.experts.gate_up_proj").
_EXPERT_TENSOR = re.compile(r"(.+\.mlp\.experts)\.(\d+)\.(\w+)\.weight")
_ALL_EXPERTS_TENSOR = re.compile(r"(.+\.mlp\.experts)\.(gate_up_proj|down_proj)")
# Per-expert checkpoint tensor -> FusedMoE shard id (Mixtral's w1/w2/w3; Qwen/OLMoE's names).
CHECKPOINT_EXPERT_SHARD_IDS = {"w1": "w1", "w2": "w2", "w3": "w3",
                    "gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}


class ReplicatedLinear(nn.Module):
    """y = x W^T with the whole W on every tensor-parallel rank (routers, the shared-expert
    gate): [..., input_size] -> [..., output_size]."""

    def __init__(self, input_size: int, output_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        # (the linear layers' names for this rank's sizes: the whole layer)
        self.input_size_per_partition, self.output_size_per_partition = input_size, output_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return current_platform.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional shared expert with a sigmoid gate).

    Args:
        hidden_size: model hidden size.
        num_experts, top_k, moe_intermediate_size, renormalize: see `FusedMoE`.
        hidden_act: only "silu".
        shared_expert_intermediate_size: a Qwen2-MoE shared expert's size (None: none).

    forward(x [n, hidden_size]) -> [n, hidden_size].
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int,
                 moe_intermediate_size: int, renormalize: bool, hidden_act: str,
                 shared_expert_intermediate_size: int | None = None) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, moe_intermediate_size,
                                renormalize, hidden_act=hidden_act)
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(hidden_size, shared_expert_intermediate_size,
                                          hidden_act)
            self.shared_expert_gate = ReplicatedLinear(hidden_size, 1)
        # The native MoE block (native/moe_block.py) that runs this block for the steps it
        # takes, attached after loading; None: always the modules.
        self.native_block = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native_block is not None:
            out = self.native_block(x)
            if out is not None:
                return out
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class MoeDecoderLayer(LlamaDecoderLayer):
    """Pre-norm decoder layer over the family's attention and MLP modules; the residual stream
    (`forward`) is Llama's."""

    def __init__(self, config, layer_idx: int, family: type[MoeForCausalLM],
                 sliding_window: int | None) -> None:
        nn.Module.__init__(self)
        self.self_attn = family.make_attention(config, layer_idx, sliding_window)
        self.mlp = family.make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # A faster replacement of the layer's attention half (input norm .. post-attention
        # norm) for the steps it takes, attached after loading (native/mla_decoder.py: DeepSeek
        # MLA); it returns None for the others. None: the modules always run.
        self.native_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                                        tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        native = self.native_attention
        if native is not None:
            taken = native(positions, hidden, residual)
            if taken is not None:
                hidden, residual = taken
                return self.mlp(hidden), residual
        return super().forward(positions, hidden, residual)


class MoeModel(LlamaModel):
    """The decoder stack of one pipeline stage: `llama.LlamaModel` with the family's layers (the
    native decoder stack takes none: it has no expert kernel, every step runs the layers)."""

    def make_layer(self, config, layer_idx: int, family, sliding_window: int | None
                   ) -> nn.Module:
        return MoeDecoderLayer(config, layer_idx, family, sliding_window)


class MoeForCausalLM(nn.Module):
    """Causal LM over the flat token batch, the base of the MoE families.

    forward(input_ids [n] int64, positions [n] int64) -> hidden [n, hidden_size];
    compute_logits(hidden [m, hidden_size]) -> [m, vocab_size] float32.

    A family overrides `make_attention` and `make_mlp` and may set `sliding_window_rule`
    (see `llama.layer_sliding_windows`) and `checkpoint_renames`.
    """

    sliding_window_rule: str | None = None
    # (checkpoint substring, ours) applied to every name first (Mixtral's block_sparse_moe).
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # (our parameter, checkpoint name, shard id) of the dense fused layers.
    stacked_params_mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                              ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                              ("gate_up_proj", "up_proj", 1))

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = MoeModel(config, type(self))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = make_lm_head(config, self.model, self.tie_word_embeddings)

    @classmethod
    def make_attention(cls, config, layer_idx: int, sliding_window: int | None) -> nn.Module:
        """The attention module of layer `layer_idx`: forward(positions, hidden) -> hidden,
        with its `Attention` at `.attn`."""
        raise NotImplementedError

    @classmethod
    def make_mlp(cls, config, layer_idx: int) -> nn.Module:
        """The MLP of layer `layer_idx` (a `SparseMoeBlock` or a dense `LlamaMLP`)."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        # (a plain list: slicing the ModuleList would build a new module each call)
        layers = list(self.model.layers)[self.model.start_layer:self.model.end_layer]
        return [layer.self_attn.attn for layer in layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by HF name; returns the names of parameters that were set.

        Expert tensors go to their block's `FusedMoE` with shard and expert ids: per expert
        (`experts.{e}.w1/w2/w3.weight`, `experts.{e}.gate_proj/up_proj/down_proj.weight`,
        as `save_pretrained` writes them and released checkpoints hold them) or all experts
        at once (transformers 5's fused `experts.gate_up_proj` / `experts.down_proj`).

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        elsewhere = tuple(f"{n}." for n, m in self.named_modules()
                          if isinstance(m, PPMissingLayer))
        loaded: set[str] = set()
        seen: dict[str, set] = {}

        def dense(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in named:
                for old, new in self.checkpoint_renames:
                    name = name.replace(old, new)
                target = _load_expert_tensor(params, name, tensor, elsewhere, seen)
                if target is None:
                    yield name, tensor
                elif target:
                    loaded.add(target)

        loaded |= load_causal_lm_weights(self, dense(weights), self.stacked_params_mapping,
                                         self.tie_word_embeddings)
        check_experts_complete(self, seen)
        return loaded


def _load_expert_tensor(params: dict[str, nn.Parameter], name: str, tensor,
                        elsewhere: tuple[str, ...], seen: dict[str, set] | None = None
                        ) -> str | None:
    """Load `tensor` if `name` is an expert weight: returns the parameter's name ("" for a
    tensor of another pipeline stage, skipped), or None when `name` is no expert weight.
    `seen` (parameter name -> {(expert id, shard id)}, or the shard id of an all-experts
    tensor) records what was loaded, for `check_experts_complete`.

    Raises:
        ValueError: for an expert tensor without a matching parameter or shard id.
    """
    one = _EXPERT_TENSOR.fullmatch(name)
    every = None if one else _ALL_EXPERTS_TENSOR.fullmatch(name)
    if one is None and every is None:
        return None
    if name.startswith(elsewhere):
        return ""
    if one is not None:
        prefix, expert_id, shard_id = one[1], int(one[2]), CHECKPOINT_EXPERT_SHARD_IDS.get(one[3])
        if shard_id is None:
            raise ValueError(f"checkpoint tensor {name}: unknown expert projection {one[3]!r}")
    else:
        prefix, expert_id = every[1], None
        shard_id = "w13" if every[2] == "gate_up_proj" else "w2"
    target = f"{prefix}.{'w2' if shard_id == 'w2' else 'w13'}_weight"
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {name} has no matching parameter")
    call_weight_loader(name, param.weight_loader, param, tensor, shard_id, expert_id)
    if seen is not None:
        seen.setdefault(target, set()).add(shard_id if expert_id is None
                                           else (expert_id, shard_id))
    return target


_EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def check_experts_complete(model: nn.Module, seen: dict[str, set]) -> None:
    """Every expert of every `FusedMoE` parameter that `_load_expert_tensor` loaded got each
    of its projections (gate and up for w13, down for w2): a checkpoint that ships a layer's
    gate but not its up projections would otherwise leave half of w13 unset.

    Raises:
        ValueError: naming the first missing expert tensor (HF name) and the count missing.
    """
    modules = dict(model.named_modules())
    for target, got in seen.items():
        prefix, _, param = target.rpartition(".")
        fused, shards = ("w13", ("w1", "w3")) if param == "w13_weight" else ("w2", ("w2",))
        if fused in got:
            continue
        missing = [(e, s) for e in range(modules[prefix].num_experts) for s in shards
                   if (e, s) not in got]
        if missing:
            e, s = missing[0]
            raise ValueError(f"checkpoint lacks expert tensor {prefix}.{e}."
                             f"{_EXPERT_PROJECTIONS[s]}.weight ({len(missing)} expert "
                             f"projections of {prefix} missing)")
