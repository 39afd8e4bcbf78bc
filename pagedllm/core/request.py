"""Request: the scheduler's record of one sequence (prompt, outputs, progress, block hashes).

Invariant: `num_computed_tokens <= num_tokens`; tokens in `[0, num_computed_tokens)` have their KV
in the cache. `block_hashes[i]` is the chained hash of full block i of `all_token_ids`, extended
whenever tokens are appended.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Container

from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    # The request's own parameters, grammar or logits processors failed inside a step.
    FINISHED_ERROR = 6

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> str | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


def stop_token_reached(token_id: int, stop_token_ids: Container[int], num_output_tokens: int,
                       min_tokens: int) -> bool:
    """Whether a request ends at its latest token `token_id` (counted in `num_output_tokens`):
    one of its stop tokens (EOS included) once `min_tokens` are out.

    The one stop-token check: `Scheduler._check_stop` applies it to each new token, and a
    multi-step round (worker/multi_step.py) to drop a request from the round's later steps.
    """
    return token_id in stop_token_ids and num_output_tokens >= min_tokens


class Request:
    """One generation request as the scheduler tracks it.

    Args:
        request_id: unique id.
        prompt_token_ids: non-empty list of token ids.
        sampling_params: validated `SamplingParams` (stop ids already include EOS).
        max_tokens: effective output limit in tokens (already capped by max_model_len).
        block_hasher: maps a request to the hashes of its full blocks (None: no prefix caching).
        arrival_time: time.monotonic() seconds when it reached the engine (now if None).
        priority: under the priority policy, lower values are scheduled first (vLLM's).
        lora_request: the adapter it runs under (None: the base model).
        mm_features: its prompt's images, in prompt order (None: text only).
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int],
                 sampling_params: SamplingParams, max_tokens: int,
                 block_hasher: Callable[[Request], list[bytes]] | None = None,
                 arrival_time: float | None = None, priority: int = 0,
                 lora_request: LoRARequest | None = None,
                 mm_features: list[MultiModalFeature] | None = None) -> None:
        self.request_id = request_id
        self.mm_features: list[MultiModalFeature] = list(mm_features or ())
        self.priority = priority
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.lora_request = lora_request
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when the request was first scheduled (-1 = not
        # scheduled yet).
        self.num_cached_tokens = -1
        self.num_preemptions = 0
        # Draft tokens proposed for the next step (speculative decoding); not part of the tokens.
        self.spec_token_ids: list[int] = []
        self._block_hasher = block_hasher
        self.block_hashes: list[bytes] = []
        self._update_block_hashes()

    @property
    def kv_transfer_params(self) -> dict | None:
        """What the caller passed for a KV connector (vLLM's
        `sampling_params.extra_args["kv_transfer_params"]`); None: nothing."""
        return (self.sampling_params.extra_args or {}).get("kv_transfer_params")

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> str | None:
        return RequestStatus.get_finished_reason(self.status)

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))
