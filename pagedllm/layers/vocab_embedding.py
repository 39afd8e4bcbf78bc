"""Token embedding and LM head, vocab-parallel: each tensor-parallel rank holds a slice of rows.

    vocab rows:   [ rank 0: 0 .. P-1 | rank 1: P .. 2P-1 | ... ]   P = ceil(vocab_size / tp_size)
                  the last slice is zero-padded up to P rows (padded rows are never read back)

The embedding looks up the ids in its slice, zeroes the others and all-reduces (each id is found on
exactly one rank). The LM head computes the logits of its slice and all-gathers them, so every rank
holds the full [n, vocab_size] logits and samples identically (same seed, same logits): no token
broadcast is needed to keep the ranks' request states equal. Both collectives are visible in the
`forward`/`compute_logits` below.

With GGUF quantization (`set_embedding_method`, layers/quantization/gguf.py) the rows stay in
their GGML blocks: a lookup dequantizes only the selected rows and the LM head (tied or not)
runs the block GEMV; the method object holds the type, and a tied LM head shares it.

A float LM head, tied or not, is repacked after loading for the platform's packed GEMM where it
has one (`LMHead.process_weights_after_loading`); a tied embedding then looks its rows up in
the packed layout (`Platform.packed_embedding`). Whether a weight is packed is a flag on the
parameter itself (`packed`), which tied modules share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import (get_tensor_model_parallel_rank,
                                                 get_tensor_model_parallel_world_size,
                                                 tensor_model_parallel_all_gather,
                                                 tensor_model_parallel_all_reduce)
from pagedllm.layers.linear import default_weight_loader
from pagedllm.platforms import current_platform


class VocabEmbedding(nn.Module):
    """input_ids [num_tokens] int64 -> [num_tokens, embedding_dim], rows split across TP ranks.

    Attributes:
        num_embeddings: full vocabulary size.
        num_embeddings_per_partition: rows held here (P above, padding included).
        vocab_start_index, vocab_end_index: the slice [start, end) of real rows held here.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start_index = min(num_embeddings,
                                     self.tp_rank * self.num_embeddings_per_partition)
        self.vocab_end_index = min(num_embeddings,
                                   self.vocab_start_index + self.num_embeddings_per_partition)
        self.embedding_dim = embedding_dim
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        # None: a float weight; else a `GGUFEmbeddingMethod` (see `set_embedding_method`).
        self.quant_method = None

    def set_embedding_method(self, method) -> bool:
        """Store (and look up / project with) the weight by `method` (a `GGUFEmbeddingMethod`);
        the weight is re-created empty, to be loaded afterwards.

        Returns:
            False, changing nothing, with tensor parallelism: the zero-padded rows of the last
            slice have no checkpoint blocks, so the weight stays float.
        """
        if self.tp_size > 1:
            return False
        method.create_weights(self, self.embedding_dim, self.num_embeddings_per_partition,
                              self.weight_loader)
        self.quant_method = method
        return True

    @property
    def packed(self) -> bool:
        """Whether the weight's storage holds the platform's packed GEMM layout instead of
        rows (a flag on the parameter, shared with a tied LM head)."""
        return getattr(self.weight, "packed", False)

    @packed.setter
    def packed(self, value: bool) -> None:
        self.weight.packed = value

    def tie_embedding_method(self, method, weight: nn.Parameter) -> None:
        """Share another module's quantized weight and its method (a tied LM head)."""
        self.quant_method = method
        self.weight = weight

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of the full [vocab_size, dim] checkpoint tensor; zero the padding.

        Raises:
            ValueError: if the checkpoint tensor's row count is not `num_embeddings`.
        """
        if loaded.shape[0] != self.num_embeddings:
            raise ValueError(f"shape mismatch: vocabulary of {self.num_embeddings} rows vs "
                             f"checkpoint {tuple(loaded.shape)}")
        n = self.vocab_end_index - self.vocab_start_index
        if self.packed:   # a reload: back to rows first (an LM head repacks after loading)
            self.weight.data = current_platform.unpack_linear_weight(self.weight.data)
            self.packed = False
        if self.quant_method is not None:   # tp_size == 1: no padding
            self.quant_method.load_weight(self, loaded)
            return
        param.data[n:].zero_()
        default_weight_loader(param.data.narrow(0, 0, n),
                              loaded.narrow(0, self.vocab_start_index, n))

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return current_platform.packed_embedding(self.weight, ids)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.embedding(self, input_ids)
        if self.tp_size == 1:
            return self._rows(input_ids)
        outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index).masked_fill_(outside, 0)
        out = self._rows(local_ids).masked_fill_(outside[:, None], 0.0)
        return tensor_model_parallel_all_reduce(out)


class LMHead(VocabEmbedding):
    """hidden [n, hidden] -> logits [n, vocab_size] float32 on every TP rank.

    `tie_to` shares an embedding's (identically sharded) weight.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 tie_to: VocabEmbedding | None = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.tied = tie_to is not None
        if tie_to is not None:
            self.weight = tie_to.weight

    def process_weights_after_loading(self) -> None:
        """Repack a float head for the platform's packed GEMM, as linear layers are
        (`UnquantizedLinearMethod`; the CPU's panels stream a batch-1 GEMV markedly faster than
        plain rows). A tied head packs the weight it shares with the embedding, whose lookups
        then gather rows from the panels (on plain rows the dot-product kernel made the head a
        large part of a batched step). Figures: docs/benchmarks.md, "Measurements behind
        choices in the code". A quantized head stays as it is. Idempotent."""
        if self.packed or self.quant_method is not None:
            return
        packed = current_platform.pack_linear_weight(self.weight.data)
        if packed is not None:
            self.weight.data, self.packed = packed, True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.logits(self, hidden)
        if self.packed:   # float32 logits: x in float32 (exact from bf16), float32 out
            logits = current_platform.packed_linear(hidden.to(torch.float32), self.weight)
        else:
            logits = current_platform.linear(hidden, self.weight, out_dtype=torch.float32)
        if self.tp_size == 1:
            return logits
        return tensor_model_parallel_all_gather(logits, dim=-1)[:, :self.num_embeddings]
