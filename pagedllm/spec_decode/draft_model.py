"""Draft-model proposer: a small causal LM with the target's tokenizer proposes k tokens greedily.

The draft has its own KV tensors but shares the target's block ids (same block_size, same
num_blocks), so the target's block table and slot mapping address both caches. Each step:
1. `catch_up`: the draft runs over the same flat batch as the target (its KV for every scheduled
   position is written; positions later rejected are overwritten when recomputed).
2. `propose`: starting from each sampled request's last token at position p, k greedy decode
   steps write draft KV at p .. p+k-1 (the scheduler reserves those lookahead slots) and produce
   the drafts for positions p+1 .. p+k.
Greedy drafting makes the proposal distribution one-hot, which the rejection sampler handles
exactly (see sample/rejection_sampler.py).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.sample.ops.argmax import row_argmax
from pagedllm.attention.metadata import CommonAttentionMetadata

# (model, input_ids [n], positions [n], common metadata) -> hidden [n, hidden]
RunModel = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, CommonAttentionMetadata],
                    torch.Tensor]


class DraftModelProposer:
    """Args: the loaded draft model, k, the runner's forward function, block size, device."""

    def __init__(self, model: torch.nn.Module, num_speculative_tokens: int, run_model: RunModel,
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.run_model = run_model
        self.block_size = block_size
        self.device = device

    def catch_up(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 common: CommonAttentionMetadata) -> None:
        self.run_model(self.model, input_ids, positions, common)

    def propose(self, last_token_ids: np.ndarray, last_positions: np.ndarray,
                block_table: np.ndarray, max_drafts: np.ndarray) -> list[list[int]]:
        """Greedy drafts for B requests.

        Args:
            last_token_ids: [B] each request's last (just sampled) token.
            last_positions: [B] its position.
            block_table: [B, max_blocks] int32 block ids of each request.
            max_drafts: [B] most drafts allowed per request (k or fewer near max_model_len).
        """
        bs = self.block_size
        drafts: list[list[int]] = [[] for _ in range(len(last_token_ids))]
        tokens = last_token_ids.astype(np.int64)
        positions = last_positions.astype(np.int64)
        for i in range(self.k):
            active = np.nonzero(max_drafts > i)[0]
            if not len(active):
                break
            pos = positions[active]
            slots = (block_table[active, pos // bs].astype(np.int64) * bs + pos % bs)
            seq_lens = (pos + 1).astype(np.int32)
            qsl = np.arange(len(active) + 1, dtype=np.int32)
            max_blocks = int(pos.max()) // bs + 1
            common = CommonAttentionMetadata(
                query_start_loc=torch.from_numpy(qsl).to(self.device), query_start_loc_cpu=qsl,
                seq_lens=torch.from_numpy(seq_lens).to(self.device), seq_lens_cpu=seq_lens,
                block_table=torch.from_numpy(
                    np.ascontiguousarray(block_table[active, :max_blocks])).to(self.device),
                slot_mapping=torch.from_numpy(slots).to(self.device), num_reqs=len(active),
                num_actual_tokens=len(active), max_query_len=1, max_seq_len=int(seq_lens.max()),
                block_size=bs)
            hidden = self.run_model(self.model, torch.from_numpy(tokens[active]).to(self.device),
                                    torch.from_numpy(pos).to(self.device), common)
            next_tokens = row_argmax(self.model.compute_logits(hidden)).cpu().numpy()
            for j, b in enumerate(active):
                drafts[b].append(int(next_tokens[j]))
            tokens[active] = next_tokens
            positions[active] += 1
        return drafts
