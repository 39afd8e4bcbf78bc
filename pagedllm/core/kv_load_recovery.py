"""The scheduler's recovery from failed KV loads (vLLM's `kv_load_failure_policy="recompute"`):
a KV connector's worker side reports the device blocks it could not load (a disk-tier file
deleted or rewritten after the scheduler matched it) in `ModelRunnerOutput.invalid_block_ids`;
the requests holding them are recomputed, their tokens computed over those blocks discarded,
and the other requests go on. A mixin of `Scheduler` (core/scheduler.py), whose state it uses.
"""

from __future__ import annotations

import logging

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)


class KVLoadRecovery:
    """`Scheduler`'s part that handles `invalid_block_ids` (see the module docstring). Its
    state, set by `Scheduler.__init__`: `_load_failed_req_ids` (requests the worker must drop
    at the next step) and `_discard_tokens` (req_id -> tokens of its steps still in flight
    to discard)."""

    def _recompute_failed_loads(self, scheduler_output: SchedulerOutput,
                                model_runner_output: ModelRunnerOutput) -> set[str]:
        """vLLM's KV load failure recovery (`kv_load_failure_policy="recompute"`): the blocks
        in `model_runner_output.invalid_block_ids` hold zeros, not their stored KV, so every
        running request holding one is preempted and recomputed (its tokens of this step, and
        of its steps still in flight, computed over those blocks, are discarded, never
        emitted). Its blocks from the first failed one on (later ones this step may have
        computed over the zeros) leave the prefix cache and the connector's tiers, so no
        request hits them again; its blocks before it stay cached and are hit again when it
        is readmitted. Other requests go on.

        Returns:
            The ids of the requests whose tokens of this step are discarded.
        """
        invalid = model_runner_output.invalid_block_ids
        affected = [r for r in self.running if not invalid.isdisjoint(
            self.kv_cache_manager.get_block_ids(r.request_id)[0])]
        bad_blocks, hashes = set(invalid), []
        for request in affected:
            req_id = request.request_id
            block_ids = self.kv_cache_manager.get_block_ids(req_id)[0]
            first = next(i for i, b in enumerate(block_ids) if b in invalid)
            bad_blocks.update(block_ids[first:])
            hashes += request.block_hashes[first:len(block_ids)]
            index = model_runner_output.req_id_to_index.get(req_id)
            sampled = index is not None and bool(model_runner_output.sampled_token_ids[index])
            # (Async scheduling: tokens of its later steps, already launched, follow.)
            in_flight = self.num_output_placeholders.get(req_id, 0) - (
                1 + len(scheduler_output.scheduled_spec_decode_tokens.get(req_id, ()))
                if sampled else 0)
            if not request.num_output_tokens:
                request.num_cached_tokens = -1   # (none reported yet: counted at readmission)
            preempted = SchedulerOutput.make_empty()
            self._preempt(request, preempted)
            self._load_failed_req_ids |= preempted.preempted_req_ids
            if in_flight > 0:
                self._discard_tokens[req_id] = in_flight
        # (After the frees: a freed block keeps its hash until evicted.)
        self.kv_cache_manager.block_pool.evict_blocks(bad_blocks)
        if self.kv_connector is not None and hashes:
            self.kv_connector.discard_blocks(hashes)
        logger.warning("KV connector: %d blocks failed to load; recomputing requests %s",
                       len(invalid), [r.request_id for r in affected])
        return {r.request_id for r in affected}

    def _discards(self, req_id: str, index: int, recomputed: set[str],
                  scheduler_output: SchedulerOutput,
                  model_runner_output: ModelRunnerOutput) -> bool:
        """Whether `req_id`'s tokens of this step are dropped: its step loaded a block that
        failed (`recomputed`), or was launched before such a failure was known
        (`_recompute_failed_loads`)."""
        left = self._discard_tokens.get(req_id)
        if req_id not in recomputed:
            if not left or not model_runner_output.sampled_token_ids[index]:
                return False
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id, ())
            if left > 1 + len(drafts):
                self._discard_tokens[req_id] = left - 1 - len(drafts)
            else:
                del self._discard_tokens[req_id]
        if scheduler_output.scheduled_spec_decode_tokens.get(req_id):
            self._end_draft_step(req_id)   # (its draft bookkeeping goes on)
        return True
