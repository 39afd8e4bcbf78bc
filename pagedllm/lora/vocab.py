"""LoRA on the token embedding and the LM head (PEFT's `embed_tokens` and `lm_head` targets).

peft's `lora.Embedding` (huggingface/peft, tuners/lora/layer.py) adds to token t's row

    embed[t] + scaling * B @ A[:, t]          A [r, vocab_size], B [hidden_size, r]

and its `lora.Linear` on the LM head adds to a row's logits scaling * (h A^T) B^T (A [r,
hidden_size], B [vocab_size, r]). Neither touches the base weight, so a tied embedding / LM
head pair keeps its one weight and each adapter applies where peft applies it.

The model files stay unaware of adapters, as for the decoder layers (lora/layers.py):
- the embedding's delta is added by a forward hook on the model's `embed_tokens`, only while
  the runner's own forward of the target model runs (`LoRAStepState.embedding_armed`), so a
  drafter that looks tokens up in the target's embedding (EAGLE, MTP) sees the base rows;
- the LM head's delta is added by `LoRALogits.add_lora` on the logits rows the runner computes
  (sampled rows and prompt-logprob rows), each row with its request's slot.

Under tensor parallelism both deltas are added where the base layers' outputs are whole on
every rank (the embedding's rows after its all-reduce, the logits after their all-gather), so
every rank holds the adapters whole (replicated, not sharded by vocabulary as the base weights
are) and computes the same delta: no collective of its own, at the cost of the whole A and B
per rank.

Slots (allocated once per engine, zero where the resident adapter has no such target):

    embedding  lora_a_t [max_loras, vocab_size, R]  (A^T: a token's row is its column of A)
               lora_b   [max_loras, R, hidden_size]  (B^T, scaling folded)
    LM head    lora_a   [max_loras, R, hidden_size]  float32
               lora_b   [max_loras, R, vocab_size]   float32 (B^T, scaling folded)
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.lora.ops import lora_expand


class LoRAEmbedding:
    """The adapters' rows added to the token embedding of the model's first stage.

    Args:
        embedding: the model's `embed_tokens` (a VocabEmbedding; its output is whole on every
            tensor-parallel rank).
        state: the step state shared with the layer wrappers (lora/layers.py).
        max_loras, max_lora_rank: slot count and width.
        device, dtype: of the slots (the activations').
    """

    def __init__(self, embedding: nn.Module, state, max_loras: int, max_lora_rank: int,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.state = state
        vocab_size, hidden = embedding.num_embeddings, embedding.embedding_dim
        self.lora_a_t = torch.zeros(max_loras, vocab_size, max_lora_rank, device=device,
                                    dtype=dtype)
        self.lora_b = torch.zeros(max_loras, max_lora_rank, hidden, device=device, dtype=dtype)
        self.filled = [False] * max_loras   # slot holds an embedding adapter
        self.handle = embedding.register_forward_hook(self._hook)

    def reset_lora(self, slot: int) -> None:
        """Zero slot `slot`."""
        self.lora_a_t[slot].zero_()
        self.lora_b[slot].zero_()
        self.filled[slot] = False

    def set_lora(self, slot: int, slice_index: int, lora_a: torch.Tensor,
                 lora_b: torch.Tensor) -> None:
        """Write A [r, vocab_size] and scaled B [hidden_size, r] into slot `slot`."""
        rank = lora_a.shape[0]
        self.lora_a_t[slot, :, :rank].copy_(lora_a.t())
        self.lora_b[slot, :rank].copy_(lora_b.t())
        self.filled[slot] = True

    def active(self, segments) -> bool:
        """Whether any slot of `segments` ((slot, start, end), the step's) holds an embedding
        adapter."""
        return any(self.filled[slot] for slot, _, _ in segments)

    def _hook(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        mapping = self.state.mapping
        if not self.state.embedding_armed or mapping is None \
                or not self.active(mapping.segments):
            return out
        (input_ids,) = args
        if mapping.batch_slots is not None and input_ids.shape[0] != mapping.batch_slots.shape[0]:
            raise RuntimeError(f"LoRA embedding: {input_ids.shape[0]} token ids for a step of "
                               f"{mapping.batch_slots.shape[0]} tokens")
        ids = input_ids if mapping.token_indices is None \
            else input_ids.index_select(0, mapping.token_indices)
        # Shrink: a token's one-hot row times A^T is A^T's row for it (peft's F.embedding of
        # A^T); expand as the linear layers do.
        shrunk = [self.lora_a_t[slot].index_select(0, ids[start:end])
                  for slot, start, end in mapping.segments]
        out = out.clone()
        lora_expand(out, shrunk, self.lora_b, mapping)
        return out


class LoRALogits:
    """The adapters' LM head deltas added to logits rows (the model's last stage).

    Args:
        lm_head: the model's LM head (its vocabulary size and hidden size are read).
        max_loras, max_lora_rank: slot count and width.
        device: of the slots (float32, the logits' dtype).
    """

    def __init__(self, lm_head: nn.Module, max_loras: int, max_lora_rank: int,
                 device: torch.device) -> None:
        vocab_size, hidden = lm_head.num_embeddings, lm_head.embedding_dim
        self.lora_a = torch.zeros(max_loras, max_lora_rank, hidden, device=device)
        self.lora_b = torch.zeros(max_loras, max_lora_rank, vocab_size, device=device)
        self.filled = [False] * max_loras   # slot holds an LM head adapter

    def reset_lora(self, slot: int) -> None:
        """Zero slot `slot`."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.filled[slot] = False

    def set_lora(self, slot: int, slice_index: int, lora_a: torch.Tensor,
                 lora_b: torch.Tensor) -> None:
        """Write A [r, hidden_size] and scaled B [vocab_size, r] into slot `slot`."""
        rank = lora_a.shape[0]
        self.lora_a[slot, :rank].copy_(lora_a)
        self.lora_b[slot, :rank].copy_(lora_b.t())
        self.filled[slot] = True

    def active(self, segments) -> bool:
        """Whether any slot of `segments` holds an LM head adapter."""
        return any(self.filled[slot] for slot, _, _ in segments)

    def add_lora(self, hidden: torch.Tensor, row_slots: torch.Tensor,
                 logits: torch.Tensor) -> None:
        """logits[i] += (hidden[i] A_s^T) B_s^T for every row i whose slot s holds an LM head
        adapter (in place; math in float32).

        Args:
            hidden: [m, hidden_size] the rows' final hidden states (any float dtype).
            row_slots: [m] int64 on the device, each row's slot (-1: the base model).
            logits: [m, vocab_size] float32, the base head's logits of those rows.
        """
        for slot in torch.unique(row_slots).tolist():
            if slot < 0 or not self.filled[slot]:
                continue
            rows = torch.nonzero(row_slots == slot).squeeze(1)
            h = hidden.index_select(0, rows).to(torch.float32)
            logits.index_add_(0, rows, (h @ self.lora_a[slot].t()) @ self.lora_b[slot])
