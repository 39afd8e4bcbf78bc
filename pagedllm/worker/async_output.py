"""A step's sampled tokens while they are still on the device (asynchronous scheduling).

With `async_scheduling` the runner does not read a step's sampled token ids on the host before the
next step is launched. `SampledTokens` keeps them on the device, with a host copy under way:

- the next step's inputs take them from the device tensor (`_fill_placeholders`,
  worker/runner_inputs.py);
- the engine's `AsyncModelRunnerOutput.get_output()` waits for the host copy and builds the
  `ModelRunnerOutput` of the step, in the engine thread, while the next step runs;
- a later step writes them into the runner's `token_ids_cpu` (`write_to`), once the copy is done.

On the CPU the "copy" is the tensor itself and is ready as soon as the step has run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.core.sched_output import EplbStats, LogprobsLists, ModelRunnerOutput
from pagedllm.sample.logprobs import LogprobsTensors
from pagedllm.worker.input_batch import record_sampled_tokens, request_logprobs


def start_host_copy(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], object | None]:
    """Start copying device tensors to the host without waiting.

    Returns the host tensors (pinned; valid once the event has completed) and a CUDA event
    recorded after the copies, or the tensors themselves and None when they are on the CPU.
    """
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    host = []
    for t in tensors:
        h = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        h.copy_(t, non_blocking=True)
        host.append(h)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass
class SampledTokens:
    """One step's sampled token of each sampling row, on the device.

    Attributes:
        req_ids: [num_sampled] ids of the requests that sampled (failed rows excluded).
        slots: [num_sampled] int64 numpy, their request slots (req_index) at that step.
        positions: [num_sampled] int64 numpy, the token index each token takes in its request.
        token_ids: [num_sampled] int64 on the device.
        host_token_ids: [num_sampled] int64 on the CPU, valid once `event` has completed.
        event: CUDA event after the host copy, or None (already on the host).
    """

    req_ids: list[str]
    slots: np.ndarray
    positions: np.ndarray
    token_ids: torch.Tensor
    host_token_ids: torch.Tensor
    event: object | None = None

    def __post_init__(self) -> None:
        self.index_of = {r: i for i, r in enumerate(self.req_ids)}

    def is_ready(self) -> bool:
        """Whether the host copy is complete (never blocks)."""
        return self.event is None or self.event.query()

    def host_values(self) -> list[int]:
        """The token ids on the host; waits for the copy."""
        if self.event is not None:
            self.event.synchronize()
        return self.host_token_ids.tolist()

    def write_to(self, token_ids_cpu: np.ndarray, req_id_to_index: dict[str, int]) -> None:
        """Write each token into `token_ids_cpu[slot, position]` where the slot still holds the
        same request (a slot freed and reused since is skipped; a request sent again after
        preemption arrives with its real tokens)."""
        for req_id, slot, pos, tok in zip(self.req_ids, self.slots.tolist(),
                                          self.positions.tolist(), self.host_values()):
            if req_id_to_index.get(req_id) == slot:
                token_ids_cpu[slot, pos] = tok


class CompletedModelRunnerOutput:
    """A step's `ModelRunnerOutput` already complete on the host, behind the interface of
    `AsyncModelRunnerOutput` (speculative decoding: the model thread finishes each step)."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        self.output = output

    def get_output(self) -> ModelRunnerOutput:
        return self.output


class AsyncModelRunnerOutput:
    """The `ModelRunnerOutput` of a step whose sampled tokens are still being copied.

    `get_output()` blocks until the copies are done (safe to call from another thread than the
    runner's: it reads only what this object holds).

    Args:
        req_ids: [num_reqs] the step's requests in batch order.
        sampled_batch_idx: [num_sampled] batch rows that sampled, in logits-row order.
        sampled: the tokens of the rows that did not fail (`sampled.req_ids`), or None.
        failed: {batch row: message} of rows whose logits processor failed.
        logprobs: per-row logprobs tensors of the sampled rows (device) or None;
            logprobs_k: [num_sampled] top-k kept per row (-1 = none asked).
        prompt_logprobs: already on the host.
        eplb_stats: the worker's EPLB report of this step (None: none).
        request_errors: {req_id: message} of requests that fail for another reason (an
            adapter that could not be read).
    """

    def __init__(self, req_ids: list[str], sampled_batch_idx: np.ndarray,
                 sampled: SampledTokens | None, failed: dict[int, str],
                 logprobs: LogprobsTensors | None, logprobs_k: np.ndarray,
                 prompt_logprobs: dict[str, tuple[int, LogprobsLists]],
                 eplb_stats: EplbStats | None = None,
                 request_errors: dict[str, str] | None = None) -> None:
        self.eplb_stats = eplb_stats
        self.request_errors = request_errors or {}
        self.req_ids = req_ids
        self.sampled_batch_idx = sampled_batch_idx
        self.sampled = sampled
        self.failed = failed
        self.logprobs_k = logprobs_k
        self.prompt_logprobs = prompt_logprobs
        self.invalid_block_ids: set[int] = set()   # (set by the worker after the step's loads)
        self._logprobs_host, self._logprobs_event = (None, None) if logprobs is None else \
            start_host_copy([logprobs.token_ids, logprobs.logprobs, logprobs.ranks])

    def get_output(self) -> ModelRunnerOutput:
        output = ModelRunnerOutput(req_ids=self.req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(self.req_ids)},
                                   sampled_token_ids=[[] for _ in self.req_ids],
                                   prompt_logprobs_dict=self.prompt_logprobs,
                                   eplb_stats=self.eplb_stats,
                                   request_errors=dict(self.request_errors),
                                   invalid_block_ids=set(self.invalid_block_ids))
        tokens = self.sampled.host_values() if self.sampled is not None else []
        by_req = dict(zip(self.sampled.req_ids, tokens)) if self.sampled is not None else {}
        lp = None
        if self._logprobs_host is not None:
            if self._logprobs_event is not None:
                self._logprobs_event.synchronize()
            lp = LogprobsLists(*(t.tolist() for t in self._logprobs_host))
        req_ids, new_tokens, logprobs = [], [], []
        for i, b in enumerate(self.sampled_batch_idx.tolist()):
            req_id = self.req_ids[b]
            if i in self.failed:
                output.request_errors[req_id] = self.failed[i]
                continue
            req_ids.append(req_id)
            new_tokens.append([by_req[req_id]])
            logprobs.append(request_logprobs(lp, i, 1, int(self.logprobs_k[i])))
        record_sampled_tokens(output, req_ids, new_tokens, logprobs)
        return output
