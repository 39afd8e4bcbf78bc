"""The later steps of a multi-step round (`SchedulerOutput.num_steps` > 1): `MultiStepRound`.

A round's first step is an ordinary `execute_model` + `sample_tokens`; `MultiStepRound.run`
then decodes each request's last sampled token, step after step, without the scheduler in
between (vLLM V0's multi-step scheduling; see docs/architecture.md "Multi-step rounds"):

- natively (`native/decode_loop.py`) when every request is plain greedy and the model takes the
  CPU's fused decoder path or a native hybrid stack (DeepSeek, Qwen3-Next): one call for all
  the steps;
- else step by step through the runner's step phases (`RoundSteps`): the previous step's
  inputs advanced in place while no request drops out, gathered anew when one does.

A request drops out of the round after the token the scheduler will end it at
(`stop_token_reached`, the scheduler's own stop-token check) or when its sampling failed; the
round's length never takes one past max_tokens or max_model_len (`Scheduler._num_decode_steps`).
The runner composes one round object; it holds the request states, the sampler and the
runner's step phases as callables, never the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from pagedllm.core.kv_cache_groups import STATE_ALIGN_GROUP
from pagedllm.core.request import stop_token_reached
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.native.decode_loop import GreedyDecodeLoop, HybridGreedyDecodeLoop
from pagedllm.platforms import current_platform
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.worker.input_batch import (PendingStep, RequestStates, StepInputs,
                                         record_sampled_tokens)
from pagedllm.worker.sampling_inputs import build_sampling_metadata


def native_decode_loop(model: torch.nn.Module, hybrid: bool = False
                       ) -> GreedyDecodeLoop | HybridGreedyDecodeLoop | None:
    """`model`'s native greedy decode loop (native/decode_loop.py) where it takes the model:
    its attention backend is `cpu_paged` (with `hybrid`, also a Qwen3-Next stack on it, or a
    DeepSeek MLA stack on `mla_cpu_paged`) and `PAGEDLLM_CPU_DECODE_LOOP` is not 0."""
    if not current_platform.options.cpu_decode_loop:
        return None
    layers = model.attention_layers()
    backend = getattr(layers[0].backend, "name", None) if layers else None
    if backend == "cpu_paged":
        loop = GreedyDecodeLoop.for_model(model)
        if loop is None and hybrid:
            return HybridGreedyDecodeLoop.for_model(model)
        return loop
    if hybrid and backend == "mla_cpu_paged":
        return HybridGreedyDecodeLoop.for_model(model)
    return None


@dataclass(frozen=True)
class RoundSteps:
    """The runner's step phases a round calls.

    Attributes:
        advance: the same requests' next decode step, the inputs advanced in place.
        gather: the next decode step of the given requests (the others left), gathered anew.
        forward: the forward of a step's inputs -> its logits.
        sample: sample a step's logits and record the tokens in the given output (and the
            request states), failed rows in its `request_errors`.
        native_ok: whether the native loop may take the round now (None: always); False
            while the round's adapters adapt the embedding or the LM head, which the native
            loop does not apply.
    """

    advance: Callable[[StepInputs], StepInputs]
    gather: Callable[[list[str]], StepInputs]
    forward: Callable[[StepInputs], PendingStep]
    sample: Callable[[PendingStep, ModelRunnerOutput], None]
    native_ok: Callable[[], bool] | None = None


class MultiStepRound:
    """Runs the later steps of multi-step rounds.

    Args:
        states: the runner's request states (read, and given the round's tokens).
        steps: the runner's step phases.
        sampler: the runner's sampler (plain greedy steps call it directly).
        block_size: tokens per KV block.
        model: the model where the native loop may take rounds (the CPU, one attention KV
            cache group and at most a state group, nothing between steps), else None.
        state_group: the state group's kind (`STATE_GROUP`, or `STATE_ALIGN_GROUP` for
            prefix caching's mode "align"; its block table is the last group's), or None
            where there is none.
    """

    def __init__(self, states: RequestStates, steps: RoundSteps, sampler, block_size: int,
                 model: torch.nn.Module | None = None, state_group: str | None = None) -> None:
        self.states = states
        self.steps = steps
        self.sampler = sampler
        self.block_size = block_size
        self._model = model
        self.state_group = state_group

    @cached_property
    def native_loop(self) -> GreedyDecodeLoop | HybridGreedyDecodeLoop | None:
        """The model's native greedy decode loop (`native_decode_loop`), decided at the first
        round, where the runner allows it."""
        return None if self._model is None else native_decode_loop(self._model, hybrid=True)

    def run(self, inputs: StepInputs, num_steps: int, output: ModelRunnerOutput
            ) -> ModelRunnerOutput:
        """Up to `num_steps` decode steps after the step that ran on `inputs` and returned
        `output`; each request's tokens (and logprobs) of every step are appended to its
        entries in `output`, which is returned.

        Each step decodes, for every request still going, the token it sampled last: its
        `num_computed_tokens` advances by one and the scheduler's blocks (allocated for the whole
        round) take the new slots. Where every request is plain greedy on the fused decoder
        path, the steps run in the native loop instead, which ends the round after a step where
        a request stopped (the scheduler then gives the others back the round's unused slots).
        Every rank of a tensor- or pipeline-parallel engine runs the same steps: they all hold
        the same sampled tokens, so they drop the same requests.
        """
        st = self.states
        going = self._still_going(inputs.batch.req_ids, output)
        loop = self._native_loop_for(inputs, going, num_steps)
        if loop is not None:
            return self._run_native(loop, inputs, num_steps, output)
        greedy: SamplingMetadata | None = None   # while every request left is plain greedy
        for _ in range(num_steps):
            if not going:
                break
            if going == inputs.batch.req_ids:
                inputs = self.steps.advance(inputs)
            else:
                inputs = self.steps.gather(going)
                greedy = None
            pending = self.steps.forward(inputs)
            rows = inputs.batch.idx_mapping
            if greedy is None and bool(st.plain_greedy[rows].all()):
                greedy = build_sampling_metadata(st, rows, pending.logits.shape[-1],
                                                 pending.logits.device)
            if greedy is not None:
                # Plain greedy rows (no logprobs, nothing that edits the logits, no drafts):
                # the round's metadata is reused and only the tokens are recorded.
                tokens = self.sampler(pending.logits, greedy).sampled_token_ids.tolist()
                record_sampled_tokens(output, inputs.batch.req_ids, [[t] for t in tokens],
                                      states=st, rows=rows)
            else:
                self.steps.sample(pending, output)
            going = self._still_going(inputs.batch.req_ids, output)
        return output

    def _still_going(self, req_ids: list[str], output: ModelRunnerOutput) -> list[str]:
        """Those of `req_ids` (the requests of the step just sampled) that take the next step:
        not failed, and their last token not one the scheduler ends them at."""
        st = self.states
        index = output.req_id_to_index
        going = []
        for req_id in req_ids:
            tokens = output.sampled_token_ids[index[req_id]]
            if not tokens or req_id in output.request_errors:
                continue
            row = st.req_id_to_index[req_id]
            if not stop_token_reached(tokens[-1], st.stop_token_ids[row],
                                      st.num_tokens[row] - st.num_prompt_tokens[row],
                                      st.min_tokens[row]):
                going.append(req_id)
        return going

    def _native_loop_for(self, inputs: StepInputs, going: list[str], num_steps: int
                         ) -> GreedyDecodeLoop | HybridGreedyDecodeLoop | None:
        """The native loop where it takes this round: every request of the first step still
        going and plain greedy, and the fused decoder taking its batch and lengths."""
        loop = self.native_loop
        batch = inputs.batch
        if (loop is None or going != batch.req_ids
                or (self.steps.native_ok is not None and not self.steps.native_ok())
                or not bool(self.states.plain_greedy[batch.idx_mapping].all())
                or not loop.applies(len(going), int(batch.seq_lens_np.max()) + num_steps,
                                    inputs.common.batch_invariant)):
            return None
        return loop

    def _run_native(self, loop: GreedyDecodeLoop | HybridGreedyDecodeLoop, inputs: StepInputs, num_steps: int,
                    output: ModelRunnerOutput) -> ModelRunnerOutput:
        """The round's later steps in `loop`, for the requests of its first step (see
        `_native_loop_for`)."""
        st = self.states
        batch = inputs.batch
        rows = batch.idx_mapping
        positions = st.num_computed_tokens[rows].astype(np.int64)
        state = {}
        if self.state_group is not None:
            state = dict(state_table=batch.group_commons[-1].block_table,
                         state_align=self.state_group == STATE_ALIGN_GROUP)
        tokens = loop.run(st.token_ids_cpu[rows, positions + 1], positions,
                          inputs.common.block_table, self.block_size, num_steps,
                          [st.stop_token_ids[r] for r in rows], **state)
        record_sampled_tokens(output, batch.req_ids, tokens.T.tolist(), states=st, rows=rows)
        st.num_computed_tokens[rows] += len(tokens)
        return output
