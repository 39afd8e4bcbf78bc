"""Llama-family decoder: Llama, Mistral, Qwen2 (qkv bias) and Qwen3 (q/k RMSNorm).

    embed -> [ RMSNorm -> attention (RoPE, GQA) -> +res -> RMSNorm -> SwiGLU MLP -> +res ] x L
          -> RMSNorm -> LM head

The families differ only in config facts read here: attention bias, q/k norm, head_dim,
tied embeddings, RoPE scaling, sliding windows (`layer_sliding_windows`: every Mistral layer,
the Qwen2/Qwen3 layers HF marks "sliding_attention"). Forward takes the flat token batch (no
padding). GGUF files (llama.cpp's names and Q/K row order) load through
`gguf_checkpoint_weights`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedllm.distributed.parallel_state import get_pp_group
from pagedllm.layers.activation import SiluAndMul
from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear,
                                    RowParallelLinear)
from pagedllm.layers.rotary_embedding import (RotaryEmbedding, check_rope_freq_factors,
                                              rope_parameters_from_hf)
from pagedllm.layers.pipeline import (PPMissingLayer, get_pp_indices, recv_intermediate,
                                      send_intermediate)
from pagedllm.layers.vocab_embedding import VocabEmbedding
from pagedllm.models.utils import load_causal_lm_weights, make_lm_head


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only 'silu' is implemented")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


def layer_sliding_windows(config, family: type[LlamaForCausalLM]) -> list[int | None]:
    """The sliding window of every layer (None: full causal context), as HF defines it.

    Mistral ("all"): `config.sliding_window` on every layer (None: none). Qwen2/Qwen3
    ("qwen"): none unless `use_sliding_window`; then `config.sliding_window` on the layers whose
    `layer_types` entry is "sliding_attention", `layer_types` defaulting to HF's rule: layer i
    slides when i >= `max_window_layers` (default 28). Llama (None): none.

    NOTE(llama): the window is given to the layer even when it is >= max_model_len (the model is
    built from the HF config alone and cannot know the engine's length). The native decoder
    stack takes windowed layers and checks per step that no sequence is longer than the
    smallest window (`FusedDecoder.applies`), so a window that can never matter costs no fused
    steps.
    """
    num_layers = config.num_hidden_layers
    window = getattr(config, "sliding_window", None)
    if family.sliding_window_rule is None or window is None:
        return [None] * num_layers
    if family.sliding_window_rule == "all":
        return [window] * num_layers
    if not getattr(config, "use_sliding_window", False):
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        first = getattr(config, "max_window_layers", None)
        first = 28 if first is None else first
        layer_types = ["sliding_attention" if i >= first else "full_attention"
                       for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return [window if kind == "sliding_attention" else None for kind in layer_types]


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_idx: int, qk_norm: bool, qkv_bias: bool,
                 o_bias: bool, sliding_window: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_size = getattr(config, "head_dim", None) or hidden // total_heads
        self.qkv_proj = QKVParallelLinear(hidden, self.head_size, total_heads, total_kv_heads,
                                          qkv_bias)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_size
        self.kv_size = self.num_kv_heads * self.head_size
        self.o_proj = RowParallelLinear(total_heads * self.head_size, hidden, o_bias)
        self.rotary_emb = RotaryEmbedding(self.head_size, config.max_position_embeddings,
                                          rope_parameters_from_hf(config.to_dict()))
        self.q_norm = RMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_size, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads,
                              self.head_size ** -0.5, f"model.layers.{layer_idx}.self_attn",
                              sliding_window=sliding_window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(n, self.num_heads, self.head_size)
        k = k.reshape(n, self.num_kv_heads, self.head_size)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q.reshape(n, -1), k.reshape(n, -1), v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx: int, family: type[LlamaForCausalLM],
                 sliding_window: int | None = None) -> None:
        super().__init__()
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = attention_bias if family.qkv_bias is None else family.qkv_bias
        self.self_attn = LlamaAttention(config, layer_idx, family.qk_norm, qkv_bias,
                                        attention_bias, sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage (all of it without pipeline parallelism).

    The first stage embeds the tokens, the others receive (hidden, residual) from the previous
    stage; every stage but the last sends its (hidden, residual) on; the last applies the final
    norm. Layers [start_layer, end_layer) are held here, the others are `PPMissingLayer`s.
    """

    def __init__(self, config, family: type[LlamaForCausalLM]) -> None:
        super().__init__()
        self.pp = get_pp_group()
        self.hidden_size = config.hidden_size
        self.start_layer, self.end_layer = get_pp_indices(
            config.num_hidden_layers, self.pp.rank_in_group, self.pp.world_size)
        self.embed_tokens = (VocabEmbedding(config.vocab_size, config.hidden_size)
                             if self.pp.is_first_rank else PPMissingLayer())
        windows = layer_sliding_windows(config, family)
        self.layers = nn.ModuleList(
            self.make_layer(config, i, family, windows[i])
            if self.start_layer <= i < self.end_layer
            else PPMissingLayer() for i in range(config.num_hidden_layers))
        self.norm = (RMSNorm(config.hidden_size, config.rms_norm_eps)
                     if self.pp.is_last_rank else PPMissingLayer())
        # A faster replacement of this stage's layers and final norm for the steps it takes,
        # attached after loading (pagedllm/native/attach.py); it returns None for the others.
        # None: the layers always run.
        self.layer_stack: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None],
                                   torch.Tensor | None] | None = None
        # Layers whose inputs (the residual stream) forward also returns, concatenated, for a
        # drafter that reads them (EAGLE-3, spec_decode/eagle.py); () = none.
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    def make_layer(self, config, layer_idx: int, family, sliding_window: int | None
                   ) -> nn.Module:
        """Decoder layer `layer_idx` (a family's model class may build another kind)."""
        return LlamaDecoderLayer(config, layer_idx, family, sliding_window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """`inputs_embeds` [n, hidden] replaces the token embeddings (a vision-language model's
        text with image embeddings scattered in; first pipeline stage only)."""
        if self.pp.is_first_rank:
            hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            dtype = self.layers[self.start_layer].input_layernorm.weight.dtype
            hidden, residual = recv_intermediate(self.pp, input_ids.shape[0], self.hidden_size,
                                                 dtype, input_ids.device)
        aux_layers = self.aux_hidden_state_layers
        # (M-RoPE's three position rows, [3, n], take the layers: models/qwen2_5_vl.py)
        if self.layer_stack is not None and positions.ndim == 1:
            # (auxiliary layers: indices within this stage, passed only when there are some)
            out = (self.layer_stack(positions, hidden, residual,
                                    aux_layers=tuple(i - self.start_layer for i in aux_layers))
                   if aux_layers else self.layer_stack(positions, hidden, residual))
            if out is not None:
                return out
        layer_inputs = {}
        for i in range(self.start_layer, self.end_layer):
            if i in aux_layers:
                layer_inputs[i] = hidden if residual is None else hidden + residual
            hidden, residual = self.layers[i](positions, hidden, residual)
        if not self.pp.is_last_rank:
            send_intermediate(self.pp, hidden, residual)
            return hidden
        hidden, _ = self.norm(hidden, residual)
        if not aux_layers:
            return hidden
        return hidden, torch.cat([layer_inputs[i] for i in aux_layers], dim=-1)



# llama.cpp's tensor names (GGUF) -> HF checkpoint names; "{}" is the layer index.
GGUF_TENSOR_NAMES = {
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
    "blk.{}.ffn_norm": "model.layers.{}.post_attention_layernorm",
    "blk.{}.ffn_gate": "model.layers.{}.mlp.gate_proj",
    "blk.{}.ffn_up": "model.layers.{}.mlp.up_proj",
    "blk.{}.ffn_down": "model.layers.{}.mlp.down_proj",
}
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(.+)")


def gguf_to_hf_name(name: str, table: dict[str, str] = GGUF_TENSOR_NAMES) -> str | None:
    """HF checkpoint name of a llama.cpp tensor name ("blk.3.attn_q.weight" ->
    "model.layers.3.self_attn.q_proj.weight"); None for a name outside `table` (a family's
    GGUF name map, GGUF_TENSOR_NAMES by default)."""
    stem, dot, suffix = name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        return None
    layer = _GGUF_LAYER.fullmatch(stem)
    key = f"blk.{{}}.{layer.group(2)}" if layer else stem
    target = table.get(key)
    if target is None:
        return None
    return f"{target.format(layer.group(1)) if layer else target}.{suffix}"


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row order (its converter's `permute`) for the "llama" architecture.

    The converter reorders each head's rows from HF's rotate-half layout to interleaved pairs,
    the layout of Meta's original checkpoints (d = head_size):

        HF (ours):  [ x_0 x_1 ... x_{d/2-1} | y_0 y_1 ... y_{d/2-1} ]   (rows of one head)
        GGUF:       [ x_0 y_0 x_1 y_1 ... x_{d/2-1} y_{d/2-1} ]

    Args:
        weight: float [num_heads * head_size, ...] (a Q/K weight or bias, heads of this tensor).
        num_heads: heads in `weight` (KV heads for K).

    Returns:
        The same shape in HF row order. Rows never leave their head, so TP narrowing by heads
        may come before or after.
    """
    head_size = weight.shape[0] // num_heads
    return (weight.reshape(num_heads, head_size // 2, 2, *weight.shape[1:]).transpose(1, 2)
            .reshape(weight.shape))


class LlamaForCausalLM(nn.Module):
    """Causal LM over the flat token batch.

    forward(input_ids [n] int64, positions [n] int64) -> hidden [n, hidden_size];
    compute_logits(hidden [m, hidden_size]) -> [m, vocab_size] float32.
    """

    # GGUF `general.architecture` this class loads (llama.cpp writes Mistral and SmolLM2 as
    # "llama"), and whether llama.cpp's converter interleaved its Q/K rows (see
    # `unpermute_rope_rows`; it does so for "llama" only).
    gguf_architecture: str | None = "llama"
    gguf_interleaved_qk = True
    qk_norm = False
    # None: follow the config's `attention_bias`; Qwen2 always has q/k/v bias (and no o bias).
    qkv_bias: bool | None = None
    # Which layers slide (see `layer_sliding_windows`): None, "all" (Mistral) or "qwen".
    sliding_window_rule: str | None = None
    # (our parameter, checkpoint name, shard id)
    stacked_params_mapping = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"),
                              ("qkv_proj", "v_proj", "v"), ("gate_up_proj", "gate_proj", 0),
                              ("gate_up_proj", "up_proj", 1))

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, type(self))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = make_lm_head(config, self.model, self.tie_word_embeddings)

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

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        return load_causal_lm_weights(self, weights, self.stacked_params_mapping,
                                      self.tie_word_embeddings)

    @classmethod
    def gguf_checkpoint_weights(cls, config, weights: Iterable[tuple[str, Any]]
                                ) -> Iterator[tuple[str, Any]]:
        """Turn a GGUF file's tensors into HF-named checkpoint tensors for `load_weights`.

        Args:
            config: the HF config (head counts).
            weights: (llama.cpp name, lazy GGUF tensor with `map`), as
                `model_loader.gguf.iterate_gguf_tensors` yields them.

        `rope_freqs.weight` (llama.cpp's Llama 3.1+ RoPE factors) is checked against the RoPE
        scaling of `config` and skipped: the config's scaling is what runs.

        Raises:
            ValueError: naming a tensor this family has no parameter for, or when
                `rope_freqs.weight` differs from the factors the config's RoPE scaling gives.
        """
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        for name, tensor in weights:
            if name == "rope_freqs.weight":
                rope = rope_parameters_from_hf(config.to_dict())
                head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
                check_rope_freq_factors(tensor.materialize(),
                                        int(head_size * rope["partial_rotary_factor"]), rope)
                continue
            hf_name = gguf_to_hf_name(name)
            if hf_name is None:
                raise ValueError(f"GGUF tensor {name} has no counterpart in {cls.__name__}")
            if cls.gguf_interleaved_qk and ".self_attn.q_proj." in hf_name:
                tensor = tensor.map(lambda w: unpermute_rope_rows(w, heads))
            elif cls.gguf_interleaved_qk and ".self_attn.k_proj." in hf_name:
                tensor = tensor.map(lambda w: unpermute_rope_rows(w, kv_heads))
            yield hf_name, tensor


class MistralForCausalLM(LlamaForCausalLM):
    gguf_architecture = None
    sliding_window_rule = "all"


class Qwen2ForCausalLM(LlamaForCausalLM):
    gguf_architecture = "qwen2"
    gguf_interleaved_qk = False
    qkv_bias = True
    sliding_window_rule = "qwen"


class Qwen3ForCausalLM(LlamaForCausalLM):
    gguf_architecture = "qwen3"
    gguf_interleaved_qk = False
    qk_norm = True
    sliding_window_rule = "qwen"
