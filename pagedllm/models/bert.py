"""BERT encoder (BertModel): bidirectional self-attention, post-LayerNorm, absolute positions.

    word + position + token_type(0) embeddings -> LayerNorm
      -> [ attention (no mask between a request's tokens) -> +res -> LayerNorm
           -> GELU MLP -> +res -> LayerNorm ] x L  -> hidden [n, hidden_size]

Forward takes the flat token batch of whole prompts (no padding); attention goes through the same
`Attention` layer and backend as the decoders, with `causal = False` telling the runner to build
non-causal metadata. Every token has token type 0 (single-segment inputs: embeddings, not
cross-encoder pairs). BERT's pooler (CLS -> dense -> tanh) and an MLM head are not built: pooling
lives in `pagedllm/pooling/` and their checkpoint tensors are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.attention import Attention
from pagedllm.layers.layernorm import LayerNorm
from pagedllm.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.vocab_embedding import VocabEmbedding
from pagedllm.models.utils import load_named_weight

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
                "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# Checkpoint tensors with no parameter here: BERT's pooler, MLM/NSP heads, HF's position buffer.
_SKIPPED_PREFIXES = ("pooler.", "cls.", "embeddings.position_ids")


class BertEmbeddings(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if getattr(config, "position_embedding_type", "absolute") != "absolute":
            raise ValueError("only absolute position embeddings are implemented, got "
                             f"{config.position_embedding_type!r}")
        self.word_embeddings = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = VocabEmbedding(config.max_position_embeddings,
                                                  config.hidden_size)
        self.token_type_embeddings = VocabEmbedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # Token type 0 for every token: row 0 of the table, broadcast.
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings.weight[0])
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        self.head_size = config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_size, num_heads,
                                          num_heads, bias=True)
        self.q_size = self.qkv_proj.num_heads * self.head_size
        self.attn = Attention(self.qkv_proj.num_heads, self.head_size, self.qkv_proj.num_kv_heads,
                              self.head_size ** -0.5, f"encoder.layer.{layer_idx}.attention")

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size] * 3, dim=-1)
        return self.attn(q, k, v)


class BertOutput(nn.Module):
    """dense -> +residual -> LayerNorm (BERT's post-norm block end)."""

    def __init__(self, in_size: int, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_size, hidden_size, bias=True)
        self.LayerNorm = LayerNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.self = BertSelfAttention(config, layer_idx)
        self.output = BertOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(hidden), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        if config.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; implemented: "
                             f"{sorted(_ACTIVATIONS)}")
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)
        self.act_fn = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.attention = BertAttention(config, layer_idx)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config.intermediate_size, config.hidden_size,
                                 config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, i) for i in range(config.num_hidden_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layer:
            hidden = layer(hidden)
        return hidden


class BertModel(nn.Module):
    """BERT encoder over the flat token batch.

    forward(input_ids [n] int64, positions [n] int64, 0-based within each prompt)
        -> hidden [n, hidden_size] (the last layer's output, model dtype).
    Needs a forward context whose attention metadata is non-causal (`causal` below).
    """

    causal = False
    # Checkpoint prefix dropped on load (BertForMaskedLM & co. nest the encoder under "bert.").
    checkpoint_prefix = "bert."
    # (our parameter, checkpoint name, shard id)
    stacked_params_mapping = (("qkv_proj", "query", "q"), ("qkv_proj", "key", "k"),
                              ("qkv_proj", "value", "v"))

    def __init__(self, config) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.encoder(self.embeddings(input_ids, positions))

    def attention_layers(self) -> list[Attention]:
        return [layer.attention.self.attn for layer in self.encoder.layer]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load checkpoint tensors by HF name; returns the names of parameters that were set.

        Raises:
            ValueError: for a tensor whose name matches no parameter, or a shape mismatch.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix(self.checkpoint_prefix)
            if name.startswith(_SKIPPED_PREFIXES):
                continue
            target = load_named_weight(params, name, tensor, self.stacked_params_mapping)
            loaded.add(target)
        return loaded


class BertForMaskedLM(BertModel):
    """The encoder of a BertForMaskedLM checkpoint ("bert."-prefixed tensors; the MLM head is
    skipped): embeddings only, there are no logits."""
