"""Gemma decoders: Gemma 2 and Gemma 3 (text).

    embed * sqrt(hidden_size) -> [ norm -> attention -> norm -> +res
                                   -> norm -> GeGLU MLP -> norm -> +res ] x L -> norm -> LM head
                                                                       (-> final logit soft-cap)

Every norm is Gemma's RMSNorm (`* (1 + weight)` in float32). Each layer is a "sliding_attention"
(local) or a "full_attention" (global) layer, as the config's `layer_types` say: a local layer's
`Attention` carries the config's `sliding_window`, which the backends apply (its query sees its
last `sliding_window` positions). The attention scale is `query_pre_attn_scalar ** -0.5`.
Gemma 2 soft-caps the attention logits; Gemma 3 adds q/k norms and gives local layers their own
RoPE base (`rope_local_base_freq`; RoPE scaling applies to global layers only). Forward takes the
flat token batch (no padding). The CPU fused decoder (`fused_decoder.py`) is Llama-only and is
never used here.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.layers.activation import GeluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import GemmaRMSNorm
from pagedllm.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from pagedllm.layers.pipeline import (PPMissingLayer, get_pp_indices, recv_intermediate,
                                      send_intermediate)
from pagedllm.layers.rotary_embedding import RotaryEmbedding, rope_parameters_from_hf
from pagedllm.layers.vocab_embedding import VocabEmbedding
from pagedllm.models.llama import gguf_to_hf_name
from pagedllm.models.utils import load_causal_lm_weights, make_lm_head

SLIDING, FULL = "sliding_attention", "full_attention"
# llama.cpp's tensor names (GGUF) -> HF checkpoint names for Gemma 2/3; "{}" is the layer index.
# NOTE(gguf): unlike Llama files, `ffn_norm` is the *pre*-feed-forward norm here, and every
# `*norm.weight` is stored as `1 + weight` (the converter folds Gemma's `(1 + w)` in; transformers'
# Gemma2TensorProcessor subtracts 1 again). Q/K rows keep HF's order (no permutation).
GEMMA_GGUF_TENSOR_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "blk.{}.attn_norm": "model.layers.{}.input_layernorm",
    "blk.{}.attn_q": "model.layers.{}.self_attn.q_proj",
    "blk.{}.attn_k": "model.layers.{}.self_attn.k_proj",
    "blk.{}.attn_v": "model.layers.{}.self_attn.v_proj",
    "blk.{}.attn_output": "model.layers.{}.self_attn.o_proj",
    "blk.{}.attn_q_norm": "model.layers.{}.self_attn.q_norm",
    "blk.{}.attn_k_norm": "model.layers.{}.self_attn.k_norm",
    "blk.{}.post_attention_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_norm": "model.layers.{}.pre_feedforward_layernorm",
    "blk.{}.post_ffw_norm": "model.layers.{}.post_feedforward_layernorm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
}
# HF activation name -> torch's GELU `approximate`.
_GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}


def gemma_layer_types(config, default_pattern: int) -> list[str]:
    """The attention kind of every layer: "sliding_attention" or "full_attention".

    From `layer_types` when the config has it, else from `sliding_window_pattern` (default
    `default_pattern`: 2 for Gemma 2, 6 for Gemma 3): every pattern-th layer is global.

    Raises:
        ValueError: for a layer type other than these two, or a list of the wrong length.
    """
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if not types:
        pattern = int(getattr(config, "sliding_window_pattern", None) or default_pattern)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    types = list(types)
    if len(types) != n or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"unsupported layer_types {types} for {n} layers; each must be "
                         f"{SLIDING!r} or {FULL!r}")
    return types


def gemma_rope_parameters(config, layer_type: str, local_base: bool) -> dict[str, Any]:
    """RoPE settings of one layer type (see `rope_parameters_from_hf` for the result).

    transformers 5 spells Gemma 3's as `rope_parameters = {layer_type: {...}}`; transformers 4
    (and the hub's config.json files) as `rope_theta` + `rope_scaling` for global layers and
    `rope_local_base_freq` (default type, no scaling) for local ones. `local_base`: the family
    has a separate local base (Gemma 3); without it every layer uses the global settings.

    Raises:
        ValueError: for a rope type the engine does not implement.
    """
    hf = config.to_dict()
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and layer_type in params:
        return rope_parameters_from_hf({"rope_parameters": params[layer_type]})
    if local_base and layer_type == SLIDING:
        return rope_parameters_from_hf({"rope_theta": hf.get("rope_local_base_freq", 10000.0)})
    return rope_parameters_from_hf(hf)


class GemmaMLP(nn.Module):
    """down(gelu(gate(x)) * up(x)) with gate and up in one weight; x [n, hidden] -> [n, hidden].

    Raises:
        ValueError: for an activation other than gelu_pytorch_tanh / gelu.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_activation: str) -> None:
        super().__init__()
        if hidden_activation not in _GELU_APPROXIMATIONS:
            raise ValueError(f"unsupported hidden_activation {hidden_activation!r}; "
                             f"implemented: {sorted(_GELU_APPROXIMATIONS)}")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size)
        self.act_fn = GeluAndMul(_GELU_APPROXIMATIONS[hidden_activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    """Self-attention of one layer: q/k/v projections, [q/k norm], RoPE, paged attention, o.

    positions [n] int64, hidden [n, hidden_size] -> [n, hidden_size].
    """

    def __init__(self, config, layer_idx: int, layer_type: str, rotary_emb: RotaryEmbedding,
                 qk_norm: bool, logits_soft_cap: float | None) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // total_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, total_heads, total_kv_heads,
                                          bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hidden, bias)
        self.rotary_emb = rotary_emb  # shared by the layers of one type
        self.q_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        window = getattr(config, "sliding_window", None) if layer_type == SLIDING else None
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads,
                              float(config.query_pre_attn_scalar) ** -0.5,
                              f"model.layers.{layer_idx}.self_attn", sliding_window=window,
                              logits_soft_cap=logits_soft_cap)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_size)
        k = k.reshape(n, self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class GemmaDecoderLayer(nn.Module):
    """One layer with Gemma's four norms; the residual stream is carried separately (as in
    `llama.py`) so that pipeline stages hand over (hidden, residual):

        x = input_norm(h);  h = h + post_attn_norm(attn(x))
        x = pre_ff_norm(h); h = h + post_ff_norm(mlp(x))
    """

    def __init__(self, config, layer_idx: int, layer_type: str, rotary_emb: RotaryEmbedding,
                 family: type[Gemma2ForCausalLM]) -> None:
        super().__init__()
        soft_cap = (getattr(config, "attn_logit_softcapping", None)
                    if family.attn_logit_softcapping else None)
        self.self_attn = GemmaAttention(config, layer_idx, layer_type, rotary_emb,
                                        family.qk_norm, soft_cap)
        activation = (getattr(config, "hidden_activation", None)
                      or getattr(config, "hidden_act", None) or "gelu_pytorch_tanh")
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size, activation)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(positions, hidden))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


class GemmaModel(nn.Module):
    """The decoder stack of one pipeline stage (all of it without pipeline parallelism); the
    stage hand-over is `llama.LlamaModel`'s. One RotaryEmbedding per layer type, shared by its
    layers (their cos/sin tables are max_position_embeddings long)."""

    def __init__(self, config, family: type[Gemma2ForCausalLM]) -> None:
        super().__init__()
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention (EmbeddingGemma) is not implemented; "
                             "only causal Gemma decoders are")
        self.pp = get_pp_group()
        self.hidden_size = config.hidden_size
        self.start_layer, self.end_layer = get_pp_indices(
            config.num_hidden_layers, self.pp.rank_in_group, self.pp.world_size)
        self.layer_types = gemma_layer_types(config, family.default_sliding_window_pattern)
        head_size = (getattr(config, "head_dim", None)
                     or config.hidden_size // config.num_attention_heads)
        ropes = {t: RotaryEmbedding(head_size, config.max_position_embeddings,
                                    gemma_rope_parameters(config, t, family.local_rope_base))
                 for t in sorted(set(self.layer_types))}
        self.embed_tokens = (VocabEmbedding(config.vocab_size, config.hidden_size)
                             if self.pp.is_first_rank else PPMissingLayer())
        # HF multiplies by sqrt(hidden_size) rounded to the model dtype (55.4256 -> 55.5 in
        # bfloat16 for hidden 3072); the buffer is float32 and rounded in forward.
        self.register_buffer("embed_scale", torch.tensor(config.hidden_size ** 0.5,
                                                         dtype=torch.float32),
                             persistent=False)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, i, t, ropes[t], family)
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i, t in enumerate(self.layer_types))
        self.norm = (GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
                     if self.pp.is_last_rank else PPMissingLayer())

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Scaled token embeddings [n, hidden_size] (what the first layer takes)."""
        hidden = self.embed_tokens(input_ids)
        return hidden * self.embed_scale.to(hidden.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` [n, hidden]: already scaled input embeddings (a vision-language
        model's, image rows unscaled as HF's); first pipeline stage only."""
        if self.pp.is_first_rank:
            hidden = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            dtype = self.layers[self.start_layer].input_layernorm.weight.dtype
            hidden, residual = recv_intermediate(self.pp, input_ids.shape[0], self.hidden_size,
                                                 dtype, input_ids.device)
        for layer in self.layers[self.start_layer:self.end_layer]:
            hidden, residual = layer(positions, hidden, residual)
        if not self.pp.is_last_rank:
            send_intermediate(self.pp, hidden, residual)
            return hidden
        hidden, _ = self.norm(hidden, residual)
        return hidden


class Gemma2ForCausalLM(nn.Module):
    """Gemma 2 causal LM over the flat token batch.

    forward(input_ids [n] int64, positions [n] int64) -> hidden [n, hidden_size];
    compute_logits(hidden [m, hidden_size]) -> [m, vocab_size] float32, soft-capped by
    `final_logit_softcapping` when the config sets it.

    Raises (construction):
        ValueError: for an unsupported activation, rope type, layer type or bidirectional config.
    """

    # GGUF `general.architecture` this class loads (see GEMMA_GGUF_TENSOR_NAMES). transformers'
    # GGUF config mapping drops Gemma 2's soft-capping keys; model_loader/gguf.py restores them.
    gguf_architecture: str | None = "gemma2"
    qk_norm = False
    # Apply the config's attn_logit_softcapping.
    attn_logit_softcapping = True
    # Global layers every n-th layer when the config has no layer_types.
    default_sliding_window_pattern = 2
    # Local layers have their own RoPE base (rope_local_base_freq).
    local_rope_base = False
    # (our parameter, checkpoint name, shard id)
    stacked_params_mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                              ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                              ("gate_up_proj", "up_proj", 1))

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = GemmaModel(config, type(self))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.lm_head = make_lm_head(config, self.model, self.tie_word_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden)
        if self.final_logit_softcapping is not None and self.model.pp.is_last_rank:
            cap = float(self.final_logit_softcapping)
            logits = torch.tanh(logits / cap) * cap
        return logits

    def attention_layers(self) -> list[Attention]:
        # (a plain list: slicing the ModuleList would build a new module each call)
        layers = list(self.model.layers)[self.model.start_layer:self.model.end_layer]
        return [layer.self_attn.attn for layer in layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by HF name; returns the names of parameters that were set.

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        return load_causal_lm_weights(self, weights, self.stacked_params_mapping,
                                      self.tie_word_embeddings)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights: Iterable[tuple[str, Any]]
                                ) -> Iterator[tuple[str, Any]]:
        """Turn a GGUF file's tensors into HF-named checkpoint tensors for `load_weights`.

        Renames by GEMMA_GGUF_TENSOR_NAMES and subtracts the 1 llama.cpp adds to every norm
        weight (in float32, before the cast to the model dtype, as transformers does).

        Args:
            config: the HF config (unused; the family's mapping needs no config facts).
            weights: (llama.cpp name, lazy GGUF tensor with `map`), as
                `model_loader.gguf.iterate_gguf_tensors` yields them.

        Raises:
            ValueError: naming a tensor this family has no parameter for.
        """
        for name, tensor in weights:
            hf_name = gguf_to_hf_name(name, GEMMA_GGUF_TENSOR_NAMES)
            if hf_name is None:
                raise ValueError(f"GGUF tensor {name} has no counterpart in {cls.__name__}")
            if name.endswith("norm.weight"):
                tensor = tensor.map(_minus_one)
            yield hf_name, tensor


def _minus_one(weight: torch.Tensor) -> torch.Tensor:
    return weight - 1


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text causal LM (model_type "gemma3_text"); see `Gemma2ForCausalLM` for the API."""

    gguf_architecture = "gemma3"
    qk_norm = True
    # NOTE(gemma3): HF's Gemma3Attention never passes attn_logit_softcapping to its attention
    # (vLLM's Gemma 3 neither); the config field is ignored here too, to stay HF-equal.
    attn_logit_softcapping = False
    default_sliding_window_pattern = 6
    local_rope_base = True
