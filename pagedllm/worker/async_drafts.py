"""The worker's side of asynchronous scheduling with speculative decoding.

With `async_scheduling` and a `speculative_config` the scheduler plans step N+1 before step N's
output reaches it (core/scheduler.py, module docstring): a request that samples in step N is
scheduled in N+1 for its new token plus `DRAFT_PLACEHOLDER` draft slots, and its
`num_computed_tokens` counts every draft of step N as accepted. The runner holds what the
scheduler lacks, since it ran step N to the end (verification and drafting) before it prepares
step N+1 (the model thread runs steps in order):

- the drafts it proposed in step N, which fill the placeholder slots (fewer drafts than slots:
  the request computes fewer tokens this step; the output says how many it verified);
- how many of step N's scheduled drafts it rejected, subtracted from the `num_computed_tokens`
  of the requests the scheduler lists in `optimistic_req_ids`.

`AsyncDrafts.resolve` turns a SchedulerOutput into the step the runner computes, and
`AsyncDrafts.record` keeps a finished step's drafts and rejections for the next one. Steps without
placeholders (synchronous ones, real drafts) pass through unchanged, so the runner keeps one path.
The design follows vLLM's V1 runner (optimistic placeholder drafts in the scheduler, the runner
substituting the drafts it keeps and correcting positions by the rejected count).
"""

from __future__ import annotations

from dataclasses import replace

from pagedllm.core.sched_output import DRAFT_PLACEHOLDER, ModelRunnerOutput, SchedulerOutput


class AsyncDrafts:
    """Drafts and rejections of the runner's last step, for the placeholders of the next."""

    def __init__(self) -> None:
        # req_id -> drafts proposed in the last step (its output's `draft_token_ids`).
        self.drafts: dict[str, list[int]] = {}
        # req_id -> drafts the scheduler counted for it in the last step minus those accepted.
        self.num_rejected: dict[str, int] = {}
        # Of the step being run: req_id -> draft slots scheduled, and -> drafts verified where
        # fewer than scheduled.
        self._num_scheduled_drafts: dict[str, int] = {}
        self._num_verified_drafts: dict[str, int] = {}

    def resolve(self, so: SchedulerOutput) -> SchedulerOutput:
        """The step to compute for `so`: placeholder drafts replaced by the kept drafts (the
        request's scheduled tokens cut where there are fewer), optimistic requests'
        `num_computed_tokens` corrected. `so` itself is not changed (the engine reads it when
        the step's output comes back).

        Raises:
            RuntimeError: a placeholder draft mixed with real ones (a scheduler bug).
        """
        spec = so.scheduled_spec_decode_tokens
        self._num_scheduled_drafts = {r: len(d) for r, d in spec.items()}
        self._num_verified_drafts = {}
        if not so.optimistic_req_ids and not any(
                d and d[0] == DRAFT_PLACEHOLDER for d in spec.values()):
            return so
        new_spec: dict[str, list[int]] = {}
        num_scheduled = dict(so.num_scheduled_tokens)
        for req_id, drafts in spec.items():
            if DRAFT_PLACEHOLDER not in drafts:
                new_spec[req_id] = drafts
                continue
            if any(d != DRAFT_PLACEHOLDER for d in drafts):
                raise RuntimeError(f"request {req_id!r}: placeholder and real drafts mixed "
                                   f"({drafts})")
            kept = self.drafts.get(req_id, [])[:len(drafts)]
            num_scheduled[req_id] -= len(drafts) - len(kept)
            if kept:
                new_spec[req_id] = kept
            if len(kept) < len(drafts):
                self._num_verified_drafts[req_id] = len(kept)
        cached = so.scheduled_cached_reqs
        num_computed = [n - self.num_rejected.get(r, 0) if r in so.optimistic_req_ids else n
                        for r, n in zip(cached.req_ids, cached.num_computed_tokens)]
        return replace(so, scheduled_cached_reqs=replace(cached, num_computed_tokens=num_computed),
                       num_scheduled_tokens=num_scheduled,
                       total_num_scheduled_tokens=sum(num_scheduled.values()),
                       scheduled_spec_decode_tokens=new_spec)

    def record(self, output: ModelRunnerOutput) -> None:
        """Keep the step's drafts for the next one and count its rejected drafts (against the
        slots the scheduler counted); report the requests that verified fewer drafts than
        scheduled in `output.num_draft_tokens`."""
        self.drafts = dict(output.draft_token_ids)
        self.num_rejected = {}
        for req_id, num_slots in self._num_scheduled_drafts.items():
            index = output.req_id_to_index.get(req_id)
            num_new = 0 if index is None else len(output.sampled_token_ids[index])
            if num_new:
                self.num_rejected[req_id] = num_slots - (num_new - 1)
        output.num_draft_tokens.update(self._num_verified_drafts)
        self._num_scheduled_drafts, self._num_verified_drafts = {}, {}
