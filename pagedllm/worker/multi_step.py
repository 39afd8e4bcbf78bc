"""The later steps of a multi-step round (`SchedulerOutput.num_steps` > 1), for `ModelRunner`.

A round's first step is an ordinary `execute_model` + `sample_tokens`; `run_remaining_steps`
then decodes each request's last sampled token, step after step, without the scheduler in
between (vLLM V0's multi-step scheduling; see docs/architecture.md "Multi-step rounds"):

- natively (`native/decode_loop.py`) when every request is plain greedy and the model takes the
  CPU's fused decoder path: one call for all the steps;
- else step by step: the previous step's inputs advanced in place while no request drops out
  (`_advance_decode_inputs`), gathered anew (`_prepare_inputs`) when one does.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.native.decode_loop import GreedyDecodeLoop
from pagedllm.platforms import current_platform
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.worker.input_batch import InputBatch, RequestStates
from pagedllm.worker.sampling_inputs import build_sampling_metadata


class MultiStepRounds:
    """`ModelRunner`'s multi-step methods (a mixin: they use the runner's request states,
    input buffers, `_execute`, `_sample_tokens`, `_prepare_inputs` and `_update_states`)."""

    @torch.inference_mode()
    def run_remaining_steps(self, so: SchedulerOutput, output: ModelRunnerOutput
                            ) -> ModelRunnerOutput:
        """Steps 2..`so.num_steps` of a multi-step round (vLLM V0's multi-step scheduling),
        after `execute_model(so)` and `sample_tokens()` ran step 1 and returned `output`.

        Each step decodes, for every request still going, the token it sampled last: its
        `num_computed_tokens` advances by one and the scheduler's blocks (allocated for the whole
        round) take the new slots. A request drops out once it samples one of its stop tokens
        with min_tokens reached (the scheduler ends it there) or fails. Its tokens and logprobs
        of every step are appended to `output`'s lists, which is returned.

        Where every request is plain greedy on the fused decoder path, the steps run in the
        native loop instead (`_native_decode_loop`), which ends the round after a step where a
        request stopped. Otherwise, while no request drops out, a step's inputs are the last
        step's advanced in place (`_advance_decode_inputs`), else gathered anew for the
        requests left. Every rank of a tensor- or pipeline-parallel engine runs the same steps:
        they all hold the same sampled tokens, so they drop the same requests.
        """
        st = self.states
        going = [r for r, tokens in zip(output.req_ids, output.sampled_token_ids)
                 if tokens and not self._stopped(st.req_id_to_index[r], tokens[-1])]
        loop = self._native_decode_loop(going, so.num_steps - 1)
        if loop is not None:
            return self._run_native_steps(loop, so.num_steps - 1, output)
        no_grammar = SchedulerOutput.make_empty()
        greedy: SamplingMetadata | None = None   # while every request left is plain greedy
        for _ in range(so.num_steps - 1):
            if not going:
                break
            batch, common = self._last_inputs
            if going == batch.req_ids:
                batch, common = self._advance_decode_inputs(batch, common)
            else:
                step = _decode_step(going, st)
                self._update_states(step)
                batch, common = self._prepare_inputs(step)
                greedy = None
            self._execute(no_grammar, batch, common)
            if greedy is None and bool(st.plain_greedy[batch.idx_mapping].all()):
                greedy = build_sampling_metadata(st, batch.idx_mapping, self._pending[1].shape[-1],
                                                 self.device, self.logprobs_mode)
            step_tokens = (self._sample_greedy(greedy) if greedy is not None
                           else self._sample_tokens())
            output.request_errors.update(step_tokens.request_errors)
            still_going = []
            for req_id, tokens in zip(step_tokens.req_ids, step_tokens.sampled_token_ids):
                if not tokens:
                    continue
                output.sampled_token_ids[output.req_id_to_index[req_id]].extend(tokens)
                lp = step_tokens.logprobs.get(req_id)
                if lp is not None:
                    output.logprobs[req_id].extend(lp)
                if not self._stopped(st.req_id_to_index[req_id], tokens[-1]):
                    still_going.append(req_id)
            going = still_going
        return output

    def _native_decode_loop(self, going: list[str], num_steps: int) -> GreedyDecodeLoop | None:
        """The model's native greedy decode loop (native/decode_loop.py) when the round's later
        steps can run there: the CPU's fused decoder path, every request of the first step still
        going and plain greedy, nothing between steps (drafts, EPLB), and
        `PAGEDLLM_CPU_DECODE_LOOP` not 0."""
        if self._decode_loop is False:
            self._decode_loop = (
                GreedyDecodeLoop.for_model(self.model)
                if (self.device.type == "cpu" and self.drafter is None and self.eplb is None
                    and len(self.kv_cache_windows) == 1
                    and current_platform.options.cpu_decode_loop) else None)
        loop = self._decode_loop
        if loop is None or self._last_inputs is None or num_steps < 1:
            return None
        batch, common = self._last_inputs
        rows = batch.idx_mapping
        backend = self._attention_backends.get(self.model)
        if (going != batch.req_ids or getattr(backend, "name", None) != "cpu_paged"
                or not bool(self.states.plain_greedy[rows].all())
                or not loop.applies(len(rows), int(batch.seq_lens_np.max()) + num_steps,
                                    common.batch_invariant)):
            return None
        return loop

    def _run_native_steps(self, loop: GreedyDecodeLoop, num_steps: int,
                          output: ModelRunnerOutput) -> ModelRunnerOutput:
        """A round's later steps in `loop`, for the requests of its first step (see
        `_native_decode_loop`); their tokens are recorded as `_sample_tokens` records them. The
        loop ends the round after a step where a request stopped (the scheduler then gives the
        others back the round's unused slots)."""
        st = self.states
        batch, common = self._last_inputs
        self._last_inputs = None   # (the loop advanced past them)
        rows = batch.idx_mapping
        positions = st.num_computed_tokens[rows].astype(np.int64)
        tokens = loop.run(st.token_ids_cpu[rows, positions + 1], positions, common.block_table,
                          self.block_size, num_steps, [st.stop_token_ids[r] for r in rows])
        for b, (req_id, row) in enumerate(zip(batch.req_ids, rows)):
            new = tokens[:, b].tolist()
            st.append_tokens(row, new)
            st.num_computed_tokens[row] += len(new)
            output.sampled_token_ids[output.req_id_to_index[req_id]].extend(new)
        return output

    def _sample_greedy(self, metadata: SamplingMetadata) -> ModelRunnerOutput:
        """`_sample_tokens` for a round step whose requests are all plain greedy
        (`RequestStates.plain_greedy`: no logprobs, nothing that edits the logits, no drafts):
        the round's sampling metadata is reused, and only the tokens are recorded."""
        batch, logits, _ = self._pending
        self._pending = None
        tokens = self.sampler(logits, metadata).sampled_token_ids.tolist()
        for row, token in zip(batch.idx_mapping, tokens):
            self.states.append_tokens(row, [token])
        return ModelRunnerOutput(batch.req_ids, {}, [[t] for t in tokens],
                                 eplb_stats=None if self.eplb is None else self.eplb.take_stats())

    def _advance_decode_inputs(self, batch: InputBatch, common: CommonAttentionMetadata
                               ) -> tuple[InputBatch, CommonAttentionMetadata]:
        """The next step of a multi-step round for the same requests: each decodes the token it
        sampled last, one position further (what `_prepare_inputs` would build, without the
        per-request gathering)."""
        st = self.states
        rows = batch.idx_mapping
        n = len(rows)
        st.num_computed_tokens[rows] += 1
        positions = st.num_computed_tokens[rows].astype(np.int64)
        self.input_ids[:n].copy_(torch.from_numpy(st.token_ids_cpu[rows, positions]))
        self.positions[:n].copy_(torch.from_numpy(positions))
        seq_lens = (positions + 1).astype(np.int32)
        seq_lens_fields = dict(seq_lens=torch.from_numpy(seq_lens).to(self.device),
                               seq_lens_cpu=seq_lens, max_seq_len=int(seq_lens.max()))
        if self.kv_cache_windows == (None,):
            # The round's blocks were all in the block table from its first step.
            self.slot_mappings[0, :n].copy_(torch.from_numpy(
                st.block_table.compute_slot_mapping(rows, positions)), non_blocking=True)
            return replace(batch, seq_lens_np=seq_lens), replace(common, **seq_lens_fields)
        block_tables = self._compute_block_tables(rows, rows, positions, positions)
        common = replace(common, block_table=block_tables[0], **seq_lens_fields)
        group_commons = () if len(block_tables) == 1 else tuple(
            replace(common, block_table=table, slot_mapping=self.slot_mappings[g, :n])
            for g, table in enumerate(block_tables))
        return replace(batch, seq_lens_np=seq_lens, group_commons=group_commons), common

    def _stopped(self, idx: int, token_id: int) -> bool:
        """Whether the request in slot `idx` ends at `token_id`, its last token (a stop token
        once min_tokens are out; the scheduler's own check is `Scheduler._check_stop`)."""
        st = self.states
        return (token_id in st.stop_token_ids[idx]
                and st.num_tokens[idx] - st.num_prompt_tokens[idx] >= st.min_tokens[idx])


def _decode_step(req_ids: list[str], states: RequestStates) -> SchedulerOutput:
    """A multi-step round's next step for `req_ids` (held requests decoding one token each, no
    new blocks), as the scheduler would have sent it."""
    step = SchedulerOutput.make_empty()
    cached = step.scheduled_cached_reqs
    cached.req_ids = req_ids
    cached.new_block_ids = [tuple([] for _ in states.block_tables)] * len(req_ids)
    cached.num_computed_tokens = [int(states.num_computed_tokens[states.req_id_to_index[r]]) + 1
                                  for r in req_ids]
    step.num_scheduled_tokens = dict.fromkeys(req_ids, 1)
    step.total_num_scheduled_tokens = len(req_ids)
    return step
