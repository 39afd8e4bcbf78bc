"""The EAGLE head's inputs for one step (spec_decode/eagle.py): which positions of the target's
batch it catches up on, with which tokens and hidden states.

A row's scheduled positions are [c, c + n); the last d of a sampled row are drafts, a of them
accepted. The head keeps every position whose next token is now known:

    sampled row:      c .. c + n - d + a - 1   (its last one is followed by the new token)
    prefill chunk:    c .. c + n - 1           (followed by prompt tokens)
    failed row:       none

    flat target rows of b:  [qsl[b], qsl[b] + kept[b])     token at p: token_ids_cpu[row, p + 1]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.spec_decode.eagle import EagleProposer
from pagedllm.worker.input_batch import PendingStep, RequestStates


def kept_positions(pending: PendingStep, output: ModelRunnerOutput) -> np.ndarray:
    """[num_reqs] int64 positions of each batch row the head catches up on (see above)."""
    batch = pending.inputs.batch
    kept = batch.num_scheduled_tokens.astype(np.int64).copy()
    spec = batch.spec_decode_metadata
    for i, b in enumerate(batch.sampled_batch_idx.tolist()):
        num_new = len(output.sampled_token_ids[b])
        if num_new == 0:
            kept[b] = 0
            continue
        num_drafts = int(spec.num_draft_tokens[i]) if spec is not None else 0
        kept[b] -= num_drafts - (num_new - 1)
    return kept


def propose_eagle(drafter: EagleProposer, states: RequestStates, pending: PendingStep,
                  output: ModelRunnerOutput,
                  max_drafts_of: Callable[[np.ndarray], np.ndarray]) -> dict[str, list[int]]:
    """Run the head's catch-up over the step's kept positions and draft for its sampled rows
    (`output` already holds the step's tokens, and `states` has recorded them).

    Returns:
        req_id -> drafts for the next step (requests with none are left out).
    """
    batch = pending.inputs.batch
    kept = kept_positions(pending, output)
    keep_rows = np.nonzero(kept > 0)[0]
    if not len(keep_rows):
        return {}
    kept = kept[keep_rows]
    rows = batch.idx_mapping[keep_rows]
    num_computed = (batch.seq_lens_np - batch.num_scheduled_tokens)[keep_rows].astype(np.int64)
    qsl = np.zeros(len(keep_rows) + 1, dtype=np.int32)
    np.cumsum(kept, out=qsl[1:])
    which = np.repeat(np.arange(len(keep_rows)), kept)
    offsets = np.arange(int(qsl[-1])) - qsl[which]
    positions = num_computed[which] + offsets
    flat = batch.query_start_loc_np[keep_rows][which] + offsets
    token_rows = rows[which]
    input_ids = states.token_ids_cpu[token_rows, positions + 1].astype(np.int64)
    table = states.block_table
    seq_lens = (num_computed + kept).astype(np.int32)
    max_blocks = int(table.num_blocks_per_row[rows].max())
    device = drafter.device
    common = CommonAttentionMetadata(
        query_start_loc=torch.from_numpy(qsl).to(device), query_start_loc_cpu=qsl,
        seq_lens=torch.from_numpy(seq_lens).to(device), seq_lens_cpu=seq_lens,
        block_table=torch.from_numpy(table.block_table_np[rows, :max_blocks]).to(device),
        slot_mapping=torch.from_numpy(table.compute_slot_mapping(token_rows, positions))
        .to(device), num_reqs=len(keep_rows), num_actual_tokens=int(qsl[-1]),
        max_query_len=int(kept.max()), max_seq_len=int(seq_lens.max()),
        block_size=drafter.block_size)
    hidden = pending.hidden_states[torch.from_numpy(flat).to(device)]
    # The sampled rows among the kept ones, and their last flat row in the catch-up batch.
    sampled = set(batch.sampled_batch_idx.tolist())
    pick = [j for j, b in enumerate(keep_rows.tolist()) if b in sampled]
    if not pick:
        drafter.propose(torch.from_numpy(input_ids).to(device),
                        torch.from_numpy(positions).to(device), hidden, common,
                        np.zeros(0, dtype=np.int64), np.zeros((0, 1), dtype=np.int32),
                        np.zeros(0, dtype=np.int64))
        return {}
    pick_arr = np.array(pick, dtype=np.int64)
    max_drafts = max_drafts_of(rows[pick_arr])
    proposals = drafter.propose(torch.from_numpy(input_ids).to(device),
                                torch.from_numpy(positions).to(device), hidden, common,
                                (qsl[1:] - 1)[pick_arr].astype(np.int64),
                                table.block_table_np[rows[pick_arr]], max_drafts)
    return {batch.req_ids[keep_rows[j]]: p for j, p in zip(pick, proposals) if p}
