"""Token embedding and LM head (vocab rows; sharding across ranks arrives with issue #11)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.linear import default_weight_loader


class VocabEmbedding(nn.Module):
    """input_ids [num_tokens] int64 -> [num_tokens, embedding_dim]."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class LMHead(VocabEmbedding):
    """hidden [n, hidden] -> logits [n, vocab] in float32. `tie_to` shares an embedding's weight."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tie_to: VocabEmbedding | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        if tie_to is not None:
            self.weight = tie_to.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight).float()
