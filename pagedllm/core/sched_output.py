"""Plain dataclasses that cross the scheduler -> worker boundary (they pickle; no tensors)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedllm.core.routed_experts import RoutedExperts
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen, or one resumed after preemption (sent whole again).

    `prompt_token_ids` + `output_token_ids` are all the request's tokens so far; `block_ids` its
    blocks, one list per KV cache group (a plain list of ints is taken as the blocks of a single
    group); `num_computed_tokens` the tokens already in those blocks (prefix-cache hits);
    `lora_request` its adapter (None: the base model); `mm_features` its prompt's images
    (None: text only).
    """

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int
    lora_request: LoRARequest | None = None
    mm_features: list[MultiModalFeature] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.block_ids, tuple):
            self.block_ids = (list(self.block_ids),)


# A draft slot scheduled before the drafts are known (async scheduling with speculative decoding):
# the worker fills it with the draft it proposed in the request's previous step.
DRAFT_PLACEHOLDER = -1


@dataclass
class CachedRequestData:
    """Requests the worker already holds: their new blocks (one list per KV cache group) and
    progress (parallel lists). Blocks a sliding window dropped are not announced: the worker's
    table keeps their ids, and the window hides those entries (see ModelRunner)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass
class SchedulerOutput:
    """What to compute in one step.

    Attributes:
        scheduled_new_reqs: requests new to the worker (incl. resumed after preemption).
        scheduled_cached_reqs: requests the worker already holds.
        num_scheduled_tokens: req_id -> tokens to compute this step.
        total_num_scheduled_tokens: sum of the above.
        finished_req_ids: requests finished (or aborted) since the last step: the worker drops them.
        preempted_req_ids: requests preempted this step: the worker drops them (they return later
            as new requests).
        scheduled_spec_decode_tokens: req_id -> draft tokens verified this step (they follow the
            request's tokens; `num_scheduled_tokens` counts them). With async scheduling they
            may be DRAFT_PLACEHOLDER each: slots for the drafts the worker proposed in the
            request's previous step, not yet known to the scheduler; the worker verifies its
            own drafts there (fewer if it has fewer: it then computes fewer tokens).
        optimistic_req_ids: cached requests whose `num_computed_tokens` counts every draft of
            their previous step, still running when this one was scheduled, as accepted (async
            scheduling with speculative decoding); the worker subtracts the ones it rejected.
        num_steps: decode steps of this round (multi-step scheduling; > 1 only when every
            scheduled request decodes one token): the worker feeds each sampled token into the
            next forward and returns up to `num_steps` tokens per request.
        kv_connector_metadata: the KV connector's transfers of this step (its own plain
            dataclass; None without a connector): see core/kv_connector/base.py.
        scheduled_encoder_inputs: req_id -> indices of its `mm_features` to encode this step
            (before the forward; each image once, however many requests share it).
        free_encoder_mm_hashes: image identifiers evicted from the encoder cache: the worker
            drops their embeddings.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_steps: int = 1
    kv_connector_metadata: object = None
    scheduled_encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    free_encoder_mm_hashes: list[str] = field(default_factory=list)
    optimistic_req_ids: set[str] = field(default_factory=set)

    @classmethod
    def make_empty(cls) -> SchedulerOutput:
        return cls([], CachedRequestData(), {}, 0, set(), set())


@dataclass
class GrammarOutput:
    """The grammar bitmask of one step's structured requests (`Scheduler.get_grammar_output`),
    for `ModelRunner.sample_tokens(grammar_output)` (vLLM's GrammarOutput).

    Attributes:
        structured_output_request_ids: structured requests that sample this step, in the order
            of the bitmask's rows (1 + number of drafts rows each).
        grammar_bitmask: int32 numpy [rows, ceil(vocab / 32)]: token t is allowed in a row iff
            bit t % 32 of word t // 32 is set.
    """

    structured_output_request_ids: list[str]
    grammar_bitmask: np.ndarray


@dataclass
class LogprobsLists:
    """Logprobs of n consecutive tokens of one request (plain lists; they cross processes).

    token_ids[i][0] is the i-th token itself, token_ids[i][1:] its top-k alternatives (k may be 0);
    logprobs[i] are their logprobs (same layout); ranks[i] is the rank of the token itself in the
    whole vocabulary (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]

    def slice(self, start: int, end: int) -> LogprobsLists:
        return LogprobsLists(self.token_ids[start:end], self.logprobs[start:end],
                             self.ranks[start:end])

    def extend(self, other: LogprobsLists) -> None:
        """Append `other`'s tokens after these (the next tokens of the same request)."""
        self.token_ids.extend(other.token_ids)
        self.logprobs.extend(other.logprobs)
        self.ranks.extend(other.ranks)


class KVTransferError(RuntimeError):
    """A KV connector cannot supply one request's KV (its peer is dead, a transfer timed out,
    its `kv_transfer_params` are bad): the scheduler fails that request alone
    (core/kv_connector/base.py)."""


@dataclass
class KVConnectorStats:
    """What a connector moved since start, in blocks (for /metrics;
    `SchedulerStats.kv_connector_stats`; the connectors are in core/kv_connector/)."""

    loaded_blocks: int = 0     # blocks loaded into the device cache (tier hits)
    stored_blocks: int = 0     # blocks written to the tier
    evicted_blocks: int = 0    # blocks dropped from the tier (LRU)
    queries: int = 0           # blocks looked up after the device cache missed
    hits: int = 0              # of those, found
    disk_loaded_blocks: int = 0    # of `loaded_blocks`, read from the disk tier
    disk_stored_blocks: int = 0    # blocks written to the disk tier


@dataclass
class EplbStats:
    """The MoE layers' expert-load imbalance at a worker's last EPLB rebalance (worker -> engine).

    Imbalance of a layer = max / mean over the EP ranks of the tokens routed to each rank's
    experts in the window the rebalance used: 1.0 is perfect balance, `ep_size` everything on one
    rank. `before` scores the window's loads under the placement that served them, `after` under
    the new placement (what the policy expects, if the next window routes alike).

    Attributes:
        num_rebalances: rebalances since the worker's start (after the profile run).
        layer_ids: [num_moe_layers] decoder-layer index of each MoE layer of the reporting stage.
        imbalance_before, imbalance_after: [num_moe_layers] floats, as above.
    """

    num_rebalances: int
    layer_ids: list[int]
    imbalance_before: list[float]
    imbalance_after: list[float]


@dataclass
class ModelRunnerOutput:
    """What the worker sends back after a step.

    `sampled_token_ids[i]` belongs to `req_ids[i]`; an empty list means nothing was sampled (a
    partial prefill chunk), several tokens = accepted draft tokens plus one. `logprobs[req_id]` covers the sampled tokens of requests that asked
    for logprobs; `prompt_logprobs_dict[req_id]` the prompt tokens whose logprobs were computed
    this step (the next prompt positions, in order).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs_dict: dict[str, tuple[int, LogprobsLists]] = field(default_factory=dict)
    # Draft tokens proposed for each request's next step (speculative decoding).
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Requests that verified fewer drafts than scheduled (placeholder slots the worker had fewer
    # drafts for): req_id -> drafts verified. The acceptance statistics count these.
    num_draft_tokens: dict[str, int] = field(default_factory=dict)
    # Requests whose own sampling code failed this step (a logits processor raised): req_id ->
    # message. Nothing was sampled for them; the scheduler finishes them with "error".
    request_errors: dict[str, str] = field(default_factory=dict)
    # Set on the steps after which EPLB rebalanced the experts (None otherwise).
    eplb_stats: EplbStats | None = None
    # Routed-experts capture (core/routed_experts.py): req_id -> (first position, rows
    # [m, num_moe_layers, top_k] int16) of the positions this step computed for requests that
    # asked; with a request's first step also its cached prefix's rows (from position 0).
    routed_experts: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)
    # KV connector: device block ids whose loads failed this step (vLLM's
    # `KVConnectorOutput.invalid_block_ids`): they hold zeros, not the stored KV. The scheduler
    # discards the step's tokens of the requests holding them and recomputes those blocks.
    invalid_block_ids: set[int] = field(default_factory=set)


@dataclass
class EngineCoreOutput:
    """Per-request delta of one step for the front end."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: tuple[int, LogprobsLists] | None = None
    # With finish_reason "error": what failed.
    error: str | None = None
    # With the final output: what a KV connector returns to the caller (prefill/decode
    # disaggregation: how the decode instance finds this request's KV).
    kv_transfer_params: dict | None = None
    # Routed-experts capture, for a request that asked (core/routed_experts.py): (first
    # position, rows [m, num_moe_layers, top_k]) of the positions this step computed; sent with
    # every step's delta (a prefill chunk's delta may carry these alone).
    new_routed_experts: tuple[int, RoutedExperts] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
