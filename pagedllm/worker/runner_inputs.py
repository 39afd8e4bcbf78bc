"""The model runner's input side: a step's flat batch (token ids, positions, slot mappings,
block tables, logits indices, spec-decode metadata) gathered from the persistent request states
(`InputPrepMixin`).

A mixin of `ModelRunner` (worker/model_runner.py), as `KVCacheRunnerMixin` is: it reads the
runner's `states`, `config`, `device`, `block_size`, `kv_cache_windows` and `_last_sampled`, and
writes into its persistent `input_ids`, `positions` and `slot_mappings` buffers.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.spec_decode.metadata import build_spec_decode_metadata
from pagedllm.worker.input_batch import InputBatch


class InputPrepMixin:
    """`_prepare_inputs` and its parts (module docstring)."""

    def _prepare_inputs(self, so: SchedulerOutput) -> tuple[InputBatch, CommonAttentionMetadata]:
        """The step's inputs: its requests (cached ones first) gathered from the states, and
        the previous async step's tokens where they are still on the device."""
        st = self.states
        req_ids = so.scheduled_cached_reqs.req_ids + [r.req_id for r in so.scheduled_new_reqs]
        idx_mapping = np.array([st.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        num_scheduled = np.array([so.num_scheduled_tokens[r] for r in req_ids], dtype=np.int32)
        batch, common = self._gather_inputs(req_ids, idx_mapping, num_scheduled,
                                            so.scheduled_spec_decode_tokens)
        self._fill_placeholders(so, batch)
        return batch, common

    def _gather_inputs(self, req_ids: list[str], idx_mapping: np.ndarray,
                       num_scheduled: np.ndarray, spec_tokens: dict[str, list[int]]
                       ) -> tuple[InputBatch, CommonAttentionMetadata]:
        """The flat batch of `num_scheduled` [num_reqs] int32 tokens of each request (slots
        `idx_mapping`), after its `num_computed_tokens`, with `spec_tokens` drafts verified."""
        st = self.states
        n = int(num_scheduled.sum())
        query_start_loc = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.cumsum(num_scheduled, out=query_start_loc[1:])
        # Token t of the batch belongs to batch row req_indices[t].
        req_indices = np.repeat(np.arange(len(req_ids)), num_scheduled)
        rows = idx_mapping[req_indices]
        num_computed = st.num_computed_tokens[idx_mapping]
        positions = (num_computed[req_indices]
                     + np.arange(n) - query_start_loc[req_indices]).astype(np.int64)
        seq_lens = (num_computed + num_scheduled).astype(np.int32)

        self.input_ids[:n].copy_(torch.from_numpy(st.token_ids_cpu[rows, positions]),
                                 non_blocking=True)
        self.positions[:n].copy_(torch.from_numpy(positions), non_blocking=True)
        block_tables = self._compute_block_tables(idx_mapping, rows, positions, num_computed)

        sampled_batch_idx = np.nonzero(seq_lens >= st.num_tokens[idx_mapping])[0]
        last_token_index = (query_start_loc[1:] - 1)[sampled_batch_idx].astype(np.int64)
        spec = None
        if spec_tokens:
            spec = build_spec_decode_metadata(
                [spec_tokens.get(req_ids[b], []) for b in sampled_batch_idx], last_token_index)
            last_token_index = spec.logits_indices
        logits_indices = torch.from_numpy(last_token_index).to(self.device, non_blocking=True)
        common = CommonAttentionMetadata(
            query_start_loc=torch.from_numpy(query_start_loc).to(self.device, non_blocking=True),
            query_start_loc_cpu=query_start_loc,
            seq_lens=torch.from_numpy(seq_lens).to(self.device, non_blocking=True),
            seq_lens_cpu=seq_lens,
            block_table=block_tables[0], slot_mapping=self.slot_mappings[0, :n],
            num_reqs=len(req_ids), num_actual_tokens=n,
            max_query_len=int(num_scheduled.max()), max_seq_len=int(seq_lens.max()),
            block_size=self.block_size,
            batch_invariant=self.config.model_config.batch_invariant)
        group_commons = () if len(block_tables) == 1 else tuple(
            replace(common, block_table=table, slot_mapping=self.slot_mappings[g, :n])
            for g, table in enumerate(block_tables))
        batch = InputBatch(req_ids=req_ids, idx_mapping=idx_mapping,
                           num_scheduled_tokens=num_scheduled,
                           query_start_loc_np=query_start_loc, seq_lens_np=seq_lens,
                           input_ids=self.input_ids[:n], positions=self.positions[:n],
                           logits_indices=logits_indices, sampled_batch_idx=sampled_batch_idx,
                           spec_decode_metadata=spec, group_commons=group_commons)
        return batch, common

    def _fill_placeholders(self, so: SchedulerOutput, batch: InputBatch) -> None:
        """Async scheduling: put the previous step's sampled ids, still on the device, into
        this step's `input_ids` at the positions they take (a decode's only input token).

        Requests sent whole this step (new or resumed) carry real tokens and are skipped, as
        are positions outside this step's query.
        """
        prev = self._last_sampled
        if prev is None:
            return
        new_ids = {r.req_id for r in so.scheduled_new_reqs}
        num_scheduled = batch.num_scheduled_tokens
        num_computed = batch.seq_lens_np - num_scheduled
        dst, src = [], []
        for b, req_id in enumerate(batch.req_ids):
            j = prev.index_of.get(req_id)
            if j is None or req_id in new_ids or prev.slots[j] != batch.idx_mapping[b]:
                continue
            offset = int(prev.positions[j]) - int(num_computed[b])
            if 0 <= offset < num_scheduled[b]:
                dst.append(int(batch.query_start_loc_np[b]) + offset)
                src.append(j)
        if dst:
            # Non-blocking copies: a blocking one would wait for the previous step to finish.
            index = torch.tensor([dst, src], dtype=torch.int64).to(self.device, non_blocking=True)
            self.input_ids.index_copy_(0, index[0], prev.token_ids[index[1]])

    def _compute_block_tables(self, idx_mapping: np.ndarray, rows: np.ndarray,
                              positions: np.ndarray, num_computed: np.ndarray
                              ) -> list[torch.Tensor]:
        """Each group's slot mapping (into `slot_mappings`) and block table of this step's rows
        ([num_reqs, max_blocks] int32 on the device).

        A sliding group's entries before the window of the row's first query are set to the
        null block 0: the scheduler may have freed (and reused) those blocks without telling the
        worker, so no backend may read them; out-of-window keys are masked anyway.
        """
        n = len(positions)
        tables = []
        for g, (table, window) in enumerate(zip(self.states.block_tables,
                                                self.kv_cache_windows)):
            self.slot_mappings[g, :n].copy_(
                torch.from_numpy(table.compute_slot_mapping(rows, positions)), non_blocking=True)
            max_blocks = int(table.num_blocks_per_row[idx_mapping].max())
            block_table = table.block_table_np[idx_mapping, :max_blocks]   # a copy
            if isinstance(window, int):
                # Rows' num_skipped_blocks (core/kv_cache_groups.py), vectorised.
                skipped = np.maximum(0, (num_computed.astype(np.int64) - window + 1)
                                     // self.block_size)
                block_table[np.arange(max_blocks)[None, :] < skipped[:, None]] = 0
            tables.append(torch.from_numpy(block_table).to(self.device, non_blocking=True))
        return tables
