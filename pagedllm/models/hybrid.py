"""The shell shared by the hybrid (state-cache) model families: Mamba-2, LFM2, Qwen3-Next /
Qwen3.5, Granite 4 hybrid and Falcon-H1.

    input_ids -> embedding (* embedding_multiplier) -> [ layer(positions, hidden) ] x L
              -> final norm -> LM head (tied to the embedding or its own)

Each family supplies its decoder layer (any mix of recurrent and attention sub-layers, built
per index and layer type), its final norm and the names of its checkpoint's modules
(`{stack}.{embedding}`, `{stack}.layers.N`, `{stack}.{norm}`, `lm_head`); this class builds the
stack, runs it, lists its attention and state-cache layers for the KV cache runner, and loads
HF-named tensors (experts per expert or fused, fused projections through the family's
`stacked_params_mapping`, a family's renames, rescaling or splits in `checkpoint_tensors`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import (get_pp_group,
                                                 get_tensor_model_parallel_world_size)
from pagedllm.layers.attention import Attention
from pagedllm.layers.state_cache import StateCache
from pagedllm.layers.vocab_embedding import LMHead, VocabEmbedding
from pagedllm.models.moe import _load_expert_tensor
from pagedllm.models.utils import StackedParamsMapping, load_named_weight


def check_hybrid_parallelism(arch: str) -> None:
    """Hybrid models run on one rank: their recurrent layers are not sharded.

    Raises:
        ValueError: naming the architecture, with tensor or pipeline parallelism.
    """
    if get_tensor_model_parallel_world_size() > 1 or get_pp_group().world_size > 1:
        raise ValueError(f"{arch}: tensor and pipeline parallelism are not implemented for its "
                         "recurrent (state-space / convolution) layers; run it on one rank")


class HybridForCausalLM(nn.Module):
    """forward(input_ids [n] int64, positions [n] int64) -> hidden [n, hidden_size];
    compute_logits(hidden [m, hidden_size]) -> [m, vocab_size] float32.

    Args:
        config: the HF config (`vocab_size`, `hidden_size`, `num_hidden_layers`,
            `tie_word_embeddings`).
        layer_types: each layer's type, checked against `supported_layer_types`; None for a
            stack of `num_hidden_layers` layers of one kind (`make_layer` gets None).
        supported_layer_types: the types `make_layer` builds.
        make_layer: (layer index, layer type) -> a module called as `layer(positions, hidden)`.
        final_norm: the norm after the last layer.
        stack, embedding, norm: the checkpoint's module names (`model.embed_tokens`, ...).
        tie_word_embeddings: the default when the config does not say.
        embedding_multiplier: a scalar the embeddings are multiplied by (None: not scaled).

    Raises:
        ValueError: at construction, with tensor / pipeline parallelism, or for a layer type
            not in `supported_layer_types` (naming it).
    """

    # (our fused parameter, checkpoint name, shard id), as utils.load_named_weight takes them.
    stacked_params_mapping: StackedParamsMapping = ()
    # Checkpoint tensors with these name prefixes are skipped (e.g. an MTP head not served).
    skipped_weight_prefixes: tuple[str, ...] = ()

    def __init__(self, config, layer_types: Sequence[str] | None,
                 supported_layer_types: Sequence[str],
                 make_layer: Callable[[int, str | None], nn.Module], final_norm: nn.Module, *,
                 stack: str = "model", embedding: str = "embed_tokens", norm: str = "norm",
                 tie_word_embeddings: bool = False,
                 embedding_multiplier: float | None = None) -> None:
        super().__init__()
        arch = type(self).__name__
        check_hybrid_parallelism(arch)
        if layer_types is None:
            layer_types = [None] * config.num_hidden_layers
        else:
            layer_types = list(layer_types)
            unknown = sorted(set(layer_types) - set(supported_layer_types))
            if unknown:
                raise ValueError(f"{arch}: layer type(s) {unknown} are not supported "
                                 f"(supported: {list(supported_layer_types)})")
        self.config = config
        self.embedding_multiplier = embedding_multiplier
        body = nn.Module()
        setattr(self, stack, body)
        embed = VocabEmbedding(config.vocab_size, config.hidden_size)
        setattr(body, embedding, embed)
        body.layers = nn.ModuleList(make_layer(i, t) for i, t in enumerate(layer_types))
        setattr(body, norm, final_norm)
        self._module_names = (stack, embedding, norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings",
                                                tie_word_embeddings))
        self.lm_head = LMHead(config.vocab_size, config.hidden_size,
                              tie_to=embed if self.tie_word_embeddings else None)
        # A faster replacement of the layers and final norm for the steps it takes, attached
        # after loading (native/hybrid_stack.py: Qwen3-Next); it returns None for the others.
        self.layer_stack: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None] | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        stack, embedding, norm = self._module_names
        body = getattr(self, stack)
        hidden = getattr(body, embedding)(input_ids)
        dtype = hidden.dtype    # (a layer may keep its residual in float32: Mamba-2's option)
        if self.embedding_multiplier is not None:
            hidden = hidden * self.embedding_multiplier
        if self.layer_stack is not None and self.embedding_multiplier is None:
            out = self.layer_stack(positions, hidden)
            if out is not None:
                return out
        for layer in body.layers:
            hidden = layer(positions, hidden)
        return getattr(body, norm)(hidden.to(dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[Attention]:
        """The paged-KV attention layers, in layer order."""
        return [m for m in self._layer_list().modules() if isinstance(m, Attention)]

    def state_layers(self) -> list[StateCache]:
        """The recurrent layers' state caches, in layer order."""
        return [m for m in self._layer_list().modules() if isinstance(m, StateCache)]

    def _layer_list(self) -> nn.ModuleList:
        return getattr(self, self._module_names[0]).layers

    def checkpoint_tensors(self, name: str, tensor) -> Iterable[tuple[str, Any]]:
        """The tensors one checkpoint tensor loads as: a family's rename, rescaling or split
        (the default: itself, unchanged)."""
        return ((name, tensor),)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors: experts per expert or transformers 5's fused tensors, fused
        projections through `stacked_params_mapping`; `rotary_emb.inv_freq` buffers, a tied
        `lm_head.weight` and `skipped_weight_prefixes` are skipped.

        Returns:
            The names of the parameters that were (partly) set.

        Raises:
            ValueError: for a tensor that matches no parameter, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or name.startswith(self.skipped_weight_prefixes):
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            for name, tensor in self.checkpoint_tensors(name, tensor):
                target = _load_expert_tensor(params, name, tensor, ())
                if target is None:
                    target = load_named_weight(params, name, tensor,
                                               self.stacked_params_mapping)
                loaded.add(target)
        return loaded
