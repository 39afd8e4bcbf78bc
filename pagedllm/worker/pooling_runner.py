"""PoolingRunner: one forward over whole prompts, pooled to one vector per request (no sampling).

    execute(batch):  flat input_ids/positions over whole prompts -> attention metadata
                     (non-causal for encoders, causal for decoders) over a scratch KV cache
                     -> model forward -> pool per request -> [num_reqs, H] float32 on the CPU

Nothing survives a step: the scratch cache is allocated once (sized for the token budget) and
overwritten every step; requests never span steps (no chunking, no prefix cache). The attention
layers and backend are the decoder path's; only the metadata differs.

NOTE(pooling_runner): like `ModelRunner._run_model`, this runner sets the forward context for the
duration of its forward (the package layout allows one such context per forward); it is the second runner
that does, and the only other one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.forward_context import set_forward_context
from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.model_loader.loader import load_model
from pagedllm.pooling.pooler import pool
from pagedllm.worker.kv_cache import allocate_kv_caches


@dataclass(frozen=True)
class PoolingRequestData:
    """One prompt to embed: token ids ([1, max_model_len] of them), how to pool it."""

    req_id: str
    prompt_token_ids: list[int]
    pooling_type: str
    normalize: bool


class PoolingRunner:
    """Owns the model and a scratch KV cache; embeds batches of whole prompts.

    Args:
        model_path: checkpoint folder.
        hf_config: the checkpoint's transformers config.
        device, dtype: where and in what precision the model runs.
        max_num_batched_tokens: most tokens of one `execute` call.
        max_num_seqs: most requests of one `execute` call.
        block_size: scratch cache block size.
    """

    def __init__(self, model_path: str, hf_config, device: torch.device, dtype: torch.dtype,
                 max_num_batched_tokens: int, max_num_seqs: int, block_size: int = 16) -> None:
        self.device = device
        self.block_size = block_size
        self.max_num_tokens = max_num_batched_tokens
        self.max_num_reqs = max_num_seqs
        self.model = load_model(model_path, hf_config, dtype, device)
        # Encoder-only models declare `causal = False`; decoders attend causally.
        self.causal = bool(getattr(self.model, "causal", True))
        # Every request starts on a fresh block: at most one partly used block per request.
        num_blocks = 1 + max_num_batched_tokens // block_size + max_num_seqs
        allocate_kv_caches(self.model.attention_layers(), num_blocks, block_size, dtype, device)

    def _metadata(self, lens: np.ndarray) -> tuple[CommonAttentionMetadata, np.ndarray]:
        """Metadata for whole prompts of `lens` tokens ([num_reqs] int32), block 0 left null,
        and the positions ([num_tokens] int64, 0-based within each prompt).

            request r's blocks: 1 + sum(ceil(lens[:r] / bs)) ... (contiguous, in order)
        """
        bs = self.block_size
        num_reqs, n = len(lens), int(lens.sum())
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int32)
        np.cumsum(lens, out=query_start_loc[1:])
        blocks_per_req = -(-lens // bs)
        first_block = 1 + np.concatenate([[0], np.cumsum(blocks_per_req)[:-1]])
        max_blocks = int(blocks_per_req.max())
        block_table = (first_block[:, None] + np.arange(max_blocks)[None, :]).astype(np.int32)
        req_indices = np.repeat(np.arange(num_reqs), lens)
        positions = (np.arange(n) - query_start_loc[req_indices]).astype(np.int64)
        slot_mapping = first_block[req_indices] * bs + positions
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(self.device),
            query_start_loc_cpu=query_start_loc,
            seq_lens=torch.from_numpy(lens).to(self.device), seq_lens_cpu=lens,
            block_table=torch.from_numpy(block_table).to(self.device),
            slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)).to(self.device),
            num_reqs=num_reqs, num_actual_tokens=n, max_query_len=int(lens.max()),
            max_seq_len=int(lens.max()), block_size=bs, causal=self.causal)
        return common, positions

    @torch.inference_mode()
    def execute(self, batch: list[PoolingRequestData]) -> np.ndarray:
        """Embed every request of `batch` in one forward.

        Returns:
            [len(batch), hidden_size] float32 numpy array, in batch order.

        Raises:
            ValueError: for an empty batch or prompt, or a batch over the token/request budget.
        """
        lens = np.array([len(r.prompt_token_ids) for r in batch], dtype=np.int32)
        if not len(batch) or lens.min() < 1:
            raise ValueError("a pooling batch needs at least one request, each with >= 1 token")
        if lens.sum() > self.max_num_tokens or len(batch) > self.max_num_reqs:
            raise ValueError(f"batch of {len(batch)} requests / {int(lens.sum())} tokens exceeds "
                             f"the budget ({self.max_num_reqs} / {self.max_num_tokens})")
        common, positions_np = self._metadata(lens)
        input_ids = torch.from_numpy(np.concatenate(
            [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in batch])).to(self.device)
        positions = torch.from_numpy(positions_np).to(self.device)
        attn_metadata = self.model.attention_layers()[0].backend.build_metadata(common)
        if hasattr(self.model, "rope_positions"):   # a model whose RoPE rows depend on the step
            positions = self.model.rope_positions(positions, common.token_seq_lens())
        with set_forward_context(attn_metadata):
            hidden = self.model(input_ids, positions)
        pooled = pool(hidden, common.query_start_loc, [r.pooling_type for r in batch],
                      [r.normalize for r in batch])
        return pooled.cpu().numpy()
