"""Scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute.

There are no prefill/decode modes. Each request has `num_computed_tokens`; a step gives it
`num_tokens - num_computed_tokens` more tokens (capped by the budget), so a decode is 1 token, a
prompt is many, and a long prompt is split over steps (chunked prefill) and batched with decodes.
Running requests are served first, in admission order; when blocks run out the most recently
admitted running request is preempted (its blocks freed, it goes back to the front of the waiting
queue and is recomputed later; its tokens so far are kept, so nothing is lost).

Priority scheduling (`scheduling_policy="priority"`, vLLM's): the waiting queue is ordered by
(`priority`, arrival), lower first (request_queue.py); the victim of a preemption is the running
request that comes last in that order; and a waiting request that cannot be admitted for want
of a sequence slot or blocks preempts running requests that come after it in that order, so a
high-priority request starts at once under a load of low-priority ones.

Asynchronous scheduling (`async_scheduling`): step N+1 is scheduled before step N's tokens are
known. Every request that samples in a step gets one *output placeholder* until
`update_from_output` brings its token, and `_num_new_tokens` counts placeholders as tokens, so a
decode request is scheduled again for the position of its still unknown token (the worker fills
that input on the device). A request that stops in step N has already been scheduled in N+1: that
extra token is computed and dropped (the request is gone when N+1's output arrives). Prefix-cache
blocks are only published once all their tokens are known (`allocate_slots` caches up to
`request.num_tokens`, which excludes placeholders), and by then their KV is written by a step
that runs before any later reader. Requests whose sampling needs their previous tokens on the
host (see `needs_sync_step`) make the engine run synchronous steps while they live.

With speculative decoding too, a step that verifies d drafts counts 1 + d placeholders (as if
every draft is accepted) and leaves the request `num_speculative_tokens` DRAFT_PLACEHOLDER drafts,
so the next step is scheduled for the new token plus the drafts the worker proposes meanwhile
(vLLM's optimistic scheduling of placeholder drafts). Its `num_computed_tokens` then counts the
previous step's rejected drafts as computed: the step lists the request in `optimistic_req_ids`
and the worker, which knows how many it rejected, corrects its positions; `update_from_output`
rolls the scheduler's count back as in synchronous steps. Drafts a step's output brings are
taken only when no later step of the request is already scheduled (synchronous steps, the last
step of a drain); otherwise the worker already holds and uses them.

Multi-step rounds (`num_scheduler_steps`, vLLM V0's multi-step scheduling): when every running
request decodes, none needs the host between its tokens (structured output, logits processors)
and no waiting request could be admitted (none waits, or max_num_seqs are running), one
SchedulerOutput asks for `num_steps` decode steps. Each request gets KV
slots for all of them (lookahead slots, cached only once their tokens are known) and its
`num_computed_tokens` advances by `num_steps`; the worker feeds each sampled token into the next
forward and returns up to `num_steps` tokens per request; `update_from_output` applies the stop
conditions token by token, as with accepted drafts. `num_steps` never takes a request past its
max_tokens or max_model_len, and a round is only made when its slots fit the free blocks (it
never preempts).

Images (vision-language models): a request's `mm_features` mark its prompt's image placeholder
ranges. Before a request's tokens are granted, every image their range overlaps must have its
embeddings in the encoder cache or be encoded this step within the step's encoder budget
(`max_num_encoder_input_tokens`) and the cache (core/encoder_cache_manager.py); otherwise the
chunk stops before that image. A chunk may end inside an image: its embeddings stay cached.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.encoder_cache_manager import EncoderCacheManager, schedule_encoder_inputs
from pagedllm.core.kv_cache_groups import (STATE_ALIGN_GROUP, KVCacheCapacity,
                                           make_kv_cache_groups)
from pagedllm.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from pagedllm.core.kv_load_recovery import KVLoadRecovery
from pagedllm.core.request import Request, RequestStatus, stop_token_reached
from pagedllm.core.routed_experts import RoutedExperts
from pagedllm.core.request_queue import check_priority, make_request_queue, priority_key
from pagedllm.core.sched_output import (DRAFT_PLACEHOLDER, EngineCoreOutput, GrammarOutput,
                                        KVConnectorStats, KVTransferError, ModelRunnerOutput,
                                        NewRequestData, SchedulerOutput)
from pagedllm.core.spec_decode_stats import SpecDecodingStats
from pagedllm.core.state_cache_group_manager import align_prefill_tokens

if TYPE_CHECKING:   # (core/kv_connector imports this folder's modules)
    from pagedllm.core.kv_connector.base import KVConnectorScheduler


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler's state for logging and metrics."""

    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_stats: PrefixCacheStats
    num_preemptions: int
    spec_decoding_stats: SpecDecodingStats
    # The KV connector's counts since start (None: no connector).
    kv_connector_stats: KVConnectorStats | None = None
    # Images encoded since start (each once per cache entry: see encoder_cache_manager.py).
    num_encoder_runs: int = 0


class Scheduler(KVLoadRecovery):
    """Decide what each step computes.

    Args:
        scheduler_config: token and sequence budgets.
        cache_config: block size and prefix caching.
        max_model_len: context length in tokens.
        num_blocks: KV blocks available (measured by the worker).
        num_lookahead_tokens: extra KV slots reserved past each running request's scheduled
            tokens (a draft model writes KV there while proposing).
        structured_output_manager: grammar state for structured requests (duck-typed: see
            pagedllm/structured_output/manager.py); None if the engine has none.
        kv_cache_windows: the KV cache groups' sliding windows (None = full attention), as the
            worker reports them (`kv_cache_group_windows`); `num_blocks` is group 0's.
        async_scheduling: count output placeholders (see the module docstring); the engine
            then drains in-flight steps before any synchronous one.
        num_scheduler_steps: most decode steps per SchedulerOutput (see the module docstring;
            the engine never combines it with async scheduling or drafts).
        num_speculative_tokens: most draft tokens the worker proposes per request and step (0 =
            no speculative decoding); with drafts a step may compute a request's last position.
        max_loras: most distinct LoRA adapters in one step (0 = LoRA off); a request whose
            adapter would exceed it waits for a later step, as for the token budget.
        kv_connector: supplies prefix tokens beyond the device cache and moves KV blocks
            (core/kv_connector/base.py for where it is called); None = none.
        max_num_encoder_input_tokens: most image embeddings encoded in one step.
        encoder_cache_size: most image embeddings (tokens) the worker keeps between steps.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 max_model_len: int, num_blocks: int, num_lookahead_tokens: int = 0,
                 structured_output_manager=None,
                 kv_cache_windows: tuple[int | None, ...] = (None,),
                 async_scheduling: bool = False, num_scheduler_steps: int = 1,
                 num_speculative_tokens: int = 0, max_loras: int = 0,
                 kv_connector: KVConnectorScheduler | None = None,
                 max_num_encoder_input_tokens: int = 8192,
                 encoder_cache_size: int = 8192) -> None:
        self.config = scheduler_config
        # The KV connector's scheduler side (core/kv_connector/base.py), or None.
        self.kv_connector = kv_connector
        self.max_num_encoder_input_tokens = max_num_encoder_input_tokens
        self.encoder_cache_manager = EncoderCacheManager(encoder_cache_size)
        # The encoder budget left in the step being scheduled.
        self._encoder_budget = max_num_encoder_input_tokens
        self.max_loras = max_loras
        self.num_scheduler_steps = num_scheduler_steps
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        # Prefix caching mode "align" of a hybrid model: prefill steps end on block boundaries.
        self._align_state = STATE_ALIGN_GROUP in kv_cache_windows
        groups = make_kv_cache_groups(num_blocks, kv_cache_windows, cache_config.block_size,
                                      scheduler_config.max_num_seqs,
                                      scheduler_config.max_num_batched_tokens,
                                      num_lookahead_tokens)
        self.kv_cache_manager = KVCacheManager(num_blocks, cache_config.block_size,
                                               cache_config.enable_prefix_caching, groups)
        threshold = scheduler_config.long_prefill_token_threshold
        # What `add_request` (and the front end's gate) admit: `_num_new_tokens` never gives one
        # request more than max_num_scheduled_tokens a step, nor slots past `_max_kv_tokens`.
        self.kv_cache_capacity = KVCacheCapacity(
            groups, cache_config.block_size, max_model_len,
            max_num_scheduled_tokens=min(scheduler_config.max_num_batched_tokens,
                                         threshold or scheduler_config.max_num_batched_tokens),
            num_lookahead_tokens=num_lookahead_tokens,
            computes_last_token=(async_scheduling or num_lookahead_tokens > 0
                                 or num_speculative_tokens > 0))
        self.requests: dict[str, Request] = {}
        self.policy = scheduler_config.scheduling_policy
        self.waiting = make_request_queue(self.policy)
        self.running: list[Request] = []
        # Ids the worker must drop at the next step.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_lookahead_tokens = num_lookahead_tokens
        self.spec_decoding_stats = SpecDecodingStats()
        self.structured_output_manager = structured_output_manager
        # Requests finished with an error outside `update_from_output`, reported by its next call.
        self._error_outputs: list[EngineCoreOutput] = []
        self.async_scheduling = async_scheduling
        # req_id -> tokens sampled in steps scheduled but not yet through `update_from_output`.
        self.num_output_placeholders: dict[str, int] = {}
        # Live requests whose sampling reads their previous tokens on the host.
        self._num_sync_requests = 0
        self.num_speculative_tokens = num_speculative_tokens
        # Async scheduling with speculative decoding: placeholder drafts (module docstring).
        self._placeholder_drafts = async_scheduling and num_speculative_tokens > 0
        # req_id -> its steps with drafts scheduled and not yet through update_from_output, and
        # how many of those must not roll back num_computed_tokens (preempted since).
        self._draft_steps_in_flight: dict[str, int] = {}
        self._void_draft_rollbacks: dict[str, int] = {}
        # Recovery from failed KV loads (`_recompute_failed_loads`): requests the worker must
        # drop at the next step, and req_id -> tokens of its steps still in flight to discard.
        self._load_failed_req_ids: set[str] = set()
        self._discard_tokens: dict[str, int] = {}

    # ----------------------------------------------------------------- requests in and out
    def add_request(self, request: Request) -> None:
        """Queue a new request.

        Raises:
            ValueError: if its id is in use, if it can never fit the KV cache even alone
                (`kv_cache_capacity.check`), if it has structured output and this scheduler
                has no grammar support, or if it has a priority under the fcfs policy.
        """
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        check_priority(request.priority, self.policy)
        self.kv_cache_capacity.check(request.num_tokens, request.max_tokens)
        if request.sampling_params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("this engine has no structured output support")
            self.structured_output_manager.add_request(request.request_id,
                                                       request.sampling_params.structured_outputs)
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request_needs_sync_step(request):
            self._num_sync_requests += 1

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus = RequestStatus.FINISHED_ABORTED,
                        error: str | None = None) -> None:
        """Finish (abort) requests from outside, e.g. a stop string or a client disconnect.

        Unknown or already finished ids are ignored. With `FINISHED_ERROR`, the next
        `update_from_output` reports each one with finish_reason "error" and `error`.
        """
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)
            if finished_status == RequestStatus.FINISHED_ERROR:
                self._error_outputs.append(EngineCoreOutput(
                    req_id, [], finish_reason="error", error=error,
                    num_cached_tokens=max(request.num_cached_tokens, 0)))

    def _free_request(self, request: Request) -> dict | None:
        """Free a finished request; the connector's `kv_transfer_params` for its output."""
        if self.structured_output_manager is not None:
            self.structured_output_manager.remove_request(request.request_id)
        kv_transfer_params = None
        if self.kv_connector is not None:
            _, kv_transfer_params = self.kv_connector.request_finished(
                request, self.kv_cache_manager.get_block_ids(request.request_id)[0])
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.num_output_placeholders.pop(request.request_id, None)
        self._draft_steps_in_flight.pop(request.request_id, None)
        self._void_draft_rollbacks.pop(request.request_id, None)
        self._discard_tokens.pop(request.request_id, None)
        if request_needs_sync_step(request):
            self._num_sync_requests -= 1
        return kv_transfer_params

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.running)

    def needs_sync_step(self) -> bool:
        """Whether the next step must see every earlier step's tokens before it is scheduled:
        some live request has structured output (its grammar bitmask needs the last token) or
        sampling that reads its previous tokens on the host (penalties, bad words, logits
        processors); see `request_needs_sync_step`."""
        return self._num_sync_requests > 0

    # ----------------------------------------------------------------- one step
    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and tokens, allocate their blocks, advance their
        `num_computed_tokens` (as if the step succeeds)."""
        out = SchedulerOutput.make_empty()
        self._encoder_budget = self.max_num_encoder_input_tokens
        if self.policy == "priority":
            self._preempt_for_priority(out)
        num_priority_preemptions = len(out.preempted_req_ids)
        out.num_steps = self._num_decode_steps()
        # The step's LoRA adapters (ids), budgeted against max_loras.
        loras: set[int] = set()
        token_budget = self._schedule_running(out, self.config.max_num_batched_tokens,
                                              out.num_steps, loras)
        # Admit waiting requests only if no running request ran out of blocks this step.
        if len(out.preempted_req_ids) == num_priority_preemptions:
            self._schedule_waiting(out, token_budget, loras)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        for req_id, n in out.num_scheduled_tokens.items():
            request = self.requests[req_id]
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            if self._draft_steps_in_flight.get(req_id):
                # Its previous step's drafts are counted as accepted (module docstring).
                out.optimistic_req_ids.add(req_id)
            if num_drafts:
                self._draft_steps_in_flight[req_id] = (
                    self._draft_steps_in_flight.get(req_id, 0) + 1)
            # (A multi-step round: its later steps compute one token each.)
            request.num_computed_tokens += n + out.num_steps - 1
            if (self.async_scheduling and request.num_computed_tokens
                    >= request.num_tokens + self.num_output_placeholders.get(req_id, 0)):
                # It samples this step; its tokens are unknown until update_from_output.
                self.num_output_placeholders[req_id] = (
                    self.num_output_placeholders.get(req_id, 0) + 1 + num_drafts)
                if self._placeholder_drafts:
                    request.spec_token_ids = [DRAFT_PLACEHOLDER] * self.num_speculative_tokens
            if request.mm_features:
                self._free_computed_encoder_inputs(request)
        out.free_encoder_mm_hashes = self.encoder_cache_manager.take_freed_mm_hashes()
        # (Dropped by the worker before it adds this step's new requests: one may be back.)
        out.preempted_req_ids |= self._load_failed_req_ids
        self._load_failed_req_ids = set()
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta(out)
        return out

    def _encoder_inputs(self, request: Request, num_computed: int, num_new_tokens: int
                        ) -> tuple[int, list[int]]:
        """`num_new_tokens` cut where an image can be neither found in the encoder cache nor
        encoded this step, and the images to encode (`schedule_encoder_inputs`). The step's
        encoder budget is spent only by `_commit_encoder_inputs`, once the request is scheduled
        (a request skipped for its LoRA adapter or its KV blocks spends none)."""
        if not request.mm_features or num_new_tokens == 0:
            return num_new_tokens, []
        n, to_encode, _ = schedule_encoder_inputs(
            request, num_computed, num_new_tokens, self._encoder_budget,
            self.encoder_cache_manager)
        if n < num_new_tokens and not self.config.enable_chunked_prefill:
            return 0, []
        return n, to_encode

    def _commit_encoder_inputs(self, request: Request, to_encode: list[int],
                               out: SchedulerOutput) -> None:
        for i in to_encode:
            self.encoder_cache_manager.allocate(request, i)
            self._encoder_budget -= request.mm_features[i].num_embeds
        if to_encode:
            out.scheduled_encoder_inputs[request.request_id] = to_encode

    def _free_computed_encoder_inputs(self, request: Request) -> None:
        """Drop `request`'s references to images whose tokens are all computed (after this
        step); their entries stay cached until their space is needed."""
        for i, feature in enumerate(request.mm_features):
            if feature.offset + feature.length <= request.num_computed_tokens:
                self.encoder_cache_manager.free_encoder_input(request, i)

    def _num_decode_steps(self) -> int:
        """Steps of this round: `num_scheduler_steps` when every running request decodes one
        known token and may take that many more, none needs the host between tokens
        (structured output, logits processors, drafts), no waiting request could be admitted
        now (none waits, or every sequence slot is taken), and the round's KV slots fit the
        free blocks; else 1. The round is capped where the first request reaches max_tokens or
        max_model_len, so a slot frees no later than a round ends."""
        steps = self.num_scheduler_steps
        if (steps == 1 or not self.running
                or (self.waiting and len(self.running) < self.config.max_num_seqs)
                or len(self.running) > self.config.max_num_batched_tokens):
            return 1
        for request in self.running:
            params = request.sampling_params
            if (request.num_computed_tokens != request.num_tokens - 1 or request.spec_token_ids
                    or params.structured_outputs is not None or params.logits_processors):
                return 1
            steps = min(steps, min(request.num_prompt_tokens + request.max_tokens,
                                   self.max_model_len) - request.num_tokens)
        if steps > 1 and not self.kv_cache_manager.slots_fit(
                [(r.request_id, r.num_computed_tokens + steps) for r in self.running]):
            # A round never preempts: its lookahead slots would push a request out for tokens
            # single steps would compute later anyway (and recompute is not bit-exact in bf16).
            return 1
        return max(steps, 1)

    def _schedule_running(self, out: SchedulerOutput, token_budget: int, num_steps: int,
                          loras: set[int]) -> int:
        """Schedule running requests in admission order (decodes, prefill chunks, drafts),
        preempting the most recently admitted ones when blocks run out; with `num_steps` > 1
        (only decodes are running), KV slots for that many tokens each; requests whose LoRA
        adapter would make `loras` exceed max_loras are skipped this step. Returns the budget
        left.
        """
        cached = out.scheduled_cached_reqs
        req_index = 0
        while req_index < len(self.running) and token_budget > 0:
            request = self.running[req_index]
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens,
                                                  token_budget)
            num_new_tokens, to_encode = self._encoder_inputs(
                request, request.num_computed_tokens, num_new_tokens)
            if num_new_tokens == 0 or not self._lora_fits(request, loras):
                req_index += 1
                continue
            while True:
                new_block_ids = self.kv_cache_manager.allocate_slots(
                    request, num_new_tokens,
                    num_lookahead_tokens=max(self._lookahead(request, num_new_tokens),
                                             num_steps - 1))
                if new_block_ids is not None:
                    break
                # Requests already given their tokens this step keep them.
                victim = self._preemption_victim(self.running[req_index:])
                self._preempt(victim, out)
                if victim is request:
                    break
            if new_block_ids is None:
                break
            num_spec = (request.num_computed_tokens + num_new_tokens - request.num_tokens
                        - self.num_output_placeholders.get(request.request_id, 0))
            if num_spec > 0:
                out.scheduled_spec_decode_tokens[request.request_id] = \
                    request.spec_token_ids[:num_spec]
            request.spec_token_ids = []
            self._commit_encoder_inputs(request, to_encode, out)
            cached.req_ids.append(request.request_id)
            cached.new_block_ids.append(new_block_ids)
            cached.num_computed_tokens.append(request.num_computed_tokens)
            out.num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            self._add_lora(request, loras)
            req_index += 1
        return token_budget

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """Whether `request`'s adapter (if any) fits the step's LoRA budget `loras`."""
        lora = request.lora_request
        return lora is None or lora.lora_int_id in loras or len(loras) < self.max_loras

    @staticmethod
    def _add_lora(request: Request, loras: set[int]) -> None:
        if request.lora_request is not None:
            loras.add(request.lora_request.lora_int_id)

    def _schedule_waiting(self, out: SchedulerOutput, token_budget: int,
                          loras: set[int]) -> None:
        """Admit waiting requests in order (prefix-cache hits count as computed) while budget,
        sequence slots and blocks last. Structured requests whose grammar is still compiling,
        and requests whose LoRA adapter exceeds the step's budget (`loras`, max_loras), wait
        without blocking the others."""
        compiling: list[Request] = []
        while (self.waiting and token_budget > 0
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting.peek()
            try:
                ready = self._grammar_ready(request)
            except Exception as e:  # noqa: BLE001 - its grammar failed: it fails alone
                self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR,
                                     f"its structured output grammar failed to compile: {e}")
                continue
            if not ready or not self._lora_fits(request, loras):
                compiling.append(self.waiting.pop())
                continue
            hit_blocks, num_hit_tokens = self.kv_cache_manager.get_computed_blocks(request)
            # Tokens after the device hits that the KV connector loads instead of computing
            # (None: its transfer runs; it waits like a compiling grammar).
            try:
                num_external = (0 if self.kv_connector is None else
                                self.kv_connector.get_num_new_matched_tokens(request,
                                                                             num_hit_tokens))
            except KVTransferError as e:
                self.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR,
                                     f"KV transfer failed: {e}")
                continue
            if num_external is None:
                compiling.append(self.waiting.pop())
                continue
            num_computed = num_hit_tokens + num_external
            num_new_tokens = self._num_new_tokens(request, num_computed, token_budget)
            num_new_tokens, to_encode = self._encoder_inputs(request, num_computed,
                                                             num_new_tokens)
            if num_new_tokens == 0:
                break
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_external + num_new_tokens, hit_blocks, num_hit_tokens,
                self._lookahead(request, num_computed + num_new_tokens))
            if new_block_ids is None:
                break
            self.waiting.pop()
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(
                    request, self.kv_cache_manager.get_block_ids(request.request_id)[0],
                    num_external)
            request.num_computed_tokens = num_computed
            if request.num_cached_tokens < 0:
                # Counted once per request: a resumed request's hits on its own blocks are not
                # prefix sharing.
                request.num_cached_tokens = num_computed
                self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_hit_tokens)
            out.scheduled_new_reqs.append(NewRequestData(
                req_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params, block_ids=new_block_ids,
                num_computed_tokens=num_computed, lora_request=request.lora_request,
                mm_features=request.mm_features or None))
            self._commit_encoder_inputs(request, to_encode, out)
            out.num_scheduled_tokens[request.request_id] = num_new_tokens
            token_budget -= num_new_tokens
            self._add_lora(request, loras)
        self.waiting.push_front(compiling)

    def _grammar_ready(self, request: Request) -> bool:
        return (request.sampling_params.structured_outputs is None
                or self.structured_output_manager.is_ready(request.request_id))

    def get_grammar_output(self, scheduler_output: SchedulerOutput) -> GrammarOutput | None:
        """The grammar bitmask rows of the structured requests that sample in
        `scheduler_output` (just returned by `schedule`, before any `update_from_output`), for
        the worker's `sample_tokens`; None when there are none."""
        rows = [(req_id, scheduler_output.scheduled_spec_decode_tokens.get(req_id, []))
                for req_id in scheduler_output.num_scheduled_tokens
                if self.requests[req_id].sampling_params.structured_outputs is not None
                and self.requests[req_id].num_computed_tokens
                >= self.requests[req_id].num_tokens]
        if not rows:
            return None
        return GrammarOutput([r for r, _ in rows],
                             self.structured_output_manager.grammar_bitmask(rows))

    def _max_kv_tokens(self, request: Request) -> int:
        """Token slots `add_request` checked the cache can hold for `request` alone
        (`KVCacheCapacity.max_num_slots`).

        NOTE(issue #5): draft tokens and lookahead slots are capped by this too; past it a request
        could need more blocks than the whole cache, preempt itself and never be readmitted.
        """
        return self.kv_cache_capacity.max_num_slots(request.num_prompt_tokens, request.max_tokens)

    def _lookahead(self, request: Request, num_new_tokens: int) -> int:
        return max(0, min(self.num_lookahead_tokens, self._max_kv_tokens(request)
                          - request.num_computed_tokens - num_new_tokens))

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        """Tokens to compute for `request` this step, its draft tokens included (0 = cannot
        schedule it now). Never past max_model_len nor past prompt + max_tokens."""
        n = min(request.num_tokens_with_spec
                + self.num_output_placeholders.get(request.request_id, 0),
                self._max_kv_tokens(request)) - num_computed
        threshold = self.config.long_prefill_token_threshold
        if threshold:
            n = min(n, threshold)
        if n > token_budget and not self.config.enable_chunked_prefill:
            return 0
        n = min(n, token_budget)
        if self._align_state:
            n = align_prefill_tokens(request.num_prompt_tokens, request.num_tokens, num_computed,
                                     n, self.block_size)
        return n

    def _preemption_victim(self, candidates: list[Request]) -> Request:
        """The running request to preempt among `candidates` (a tail of `running`): the most
        recently admitted one (fcfs), or the one last in priority order (priority)."""
        if self.policy == "priority":
            return max(candidates, key=priority_key)
        return candidates[-1]

    def _preempt_for_priority(self, out: SchedulerOutput) -> None:
        """Priority policy: make room for the waiting requests this step could admit, in
        priority order. While the next one lacks a sequence slot or the blocks of its first
        chunk (after those of the ones before it), preempt the running request last in priority
        order if its priority is lower (a larger value; equal priorities never preempt each
        other). Stops at the first request that cannot get room, or when the token budget of the
        step is spent."""
        seats = self.config.max_num_seqs - len(self.running)
        budget = self.config.max_num_batched_tokens
        reserved: list[tuple[str, int]] = []
        for head in list(self.waiting):
            try:
                if not self._grammar_ready(head):
                    continue
            except Exception:  # noqa: BLE001 - its grammar failed: _schedule_waiting ends it
                continue
            chunk = min(head.num_tokens, budget, self._max_kv_tokens(head))
            if chunk <= 0:
                return
            while seats <= 0 or not self.kv_cache_manager.slots_fit(
                    [*reserved, (head.request_id, chunk)]):
                victim = self._preemption_victim(self.running) if self.running else None
                if victim is None or victim.priority <= head.priority:
                    return
                self._preempt(victim, out)
                seats += 1
            reserved.append((head.request_id, chunk))
            seats -= 1
            budget -= chunk

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Take a running request out (its blocks freed) and queue it again; it is recomputed
        later with its tokens so far."""
        self.running.remove(request)
        out.preempted_req_ids.add(request.request_id)
        self.kv_cache_manager.free(request)
        self.encoder_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        # Its in-flight tokens still arrive (appended while it waits); it is recomputed later,
        # so their drafts must not roll its num_computed_tokens back.
        self.num_output_placeholders.pop(request.request_id, None)
        if self._draft_steps_in_flight.get(request.request_id):
            self._void_draft_rollbacks[request.request_id] = \
                self._draft_steps_in_flight[request.request_id]
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(request)

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply stop conditions, free finished requests.

        Returns one `EngineCoreOutput` per request that got tokens or finished this step. A
        failure that belongs to one request (its grammar matcher, a logits processor reported in
        `request_errors`) finishes that request with finish_reason "error"; the others go on.
        Blocks a KV connector failed to load (`invalid_block_ids`) are recomputed
        (core/kv_load_recovery.py).
        """
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        errors = dict(model_runner_output.request_errors)
        recomputed = (self._recompute_failed_loads(scheduler_output, model_runner_output)
                      if model_runner_output.invalid_block_ids else set())
        for req_id, index in model_runner_output.req_id_to_index.items():
            request = self.requests.get(req_id)
            if (request is None or request.is_finished() or req_id in errors
                    or self._discards(req_id, index, recomputed, scheduler_output,
                                      model_runner_output)):
                continue
            try:
                out = self._update_request(request, index, scheduler_output, model_runner_output)
            except Exception as e:  # noqa: BLE001 - its own state failed: it fails alone
                errors[req_id] = f"{type(e).__name__}: {e}"
                # So finish_requests below frees it (from the queue it is in).
                request.status = (RequestStatus.RUNNING if request in self.running
                                  else RequestStatus.PREEMPTED)
                continue
            if out is not None:
                outputs.append(out)
            if request.is_finished():
                finished.append(request)
        for request in finished:
            # With async scheduling a request preempted while its step ran may finish waiting.
            (self.running if request in self.running else self.waiting).remove(request)
            kv_transfer_params = self._free_request(request)
            if kv_transfer_params is not None:
                for out in outputs:
                    if out.request_id == request.request_id:
                        out.kv_transfer_params = kv_transfer_params
        for req_id, message in errors.items():
            self.finish_requests(req_id, RequestStatus.FINISHED_ERROR, message)
        outputs.extend(self._error_outputs)
        self._error_outputs = []
        return outputs

    def _update_request(self, request: Request, index: int, scheduler_output: SchedulerOutput,
                        model_runner_output: ModelRunnerOutput) -> EngineCoreOutput | None:
        """One request's part of `update_from_output` (None: nothing to report)."""
        req_id = request.request_id
        prompt_logprobs = model_runner_output.prompt_logprobs_dict
        new_token_ids = model_runner_output.sampled_token_ids[index]
        routed = model_runner_output.routed_experts.get(req_id)
        # (Passed on at once: the front end keeps them, core/routed_experts.py.)
        new_routed = None if routed is None else (routed[0], RoutedExperts.from_numpy(routed[1]))
        drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
        if new_token_ids and self.num_output_placeholders.get(req_id):
            self.num_output_placeholders[req_id] = max(
                0, self.num_output_placeholders[req_id] - 1 - len(drafts or ()))
        if new_token_ids and scheduler_output.num_steps > len(new_token_ids):
            # A multi-step round the worker ended early (a request of it sampled a stop token):
            # the round's later slots stay the request's, for its next tokens.
            request.num_computed_tokens -= scheduler_output.num_steps - len(new_token_ids)
        rollback = bool(drafts) and self._end_draft_step(req_id)
        if drafts and new_token_ids:
            # Rejected draft positions are not computed: their KV is overwritten later.
            num_accepted = len(new_token_ids) - 1
            if rollback:
                request.num_computed_tokens -= len(drafts) - num_accepted
            # (Placeholder slots: as many drafts as the worker had and verified.)
            num_verified = model_runner_output.num_draft_tokens.get(req_id, len(drafts))
            if num_verified:
                self.spec_decoding_stats.observe_draft(num_verified, num_accepted)
        if not new_token_ids:
            if req_id in prompt_logprobs or new_routed is not None:
                return EngineCoreOutput(req_id, [],
                                        new_prompt_logprobs=prompt_logprobs.get(req_id),
                                        new_routed_experts=new_routed)
            return None
        accepted: list[int] = []
        structured = request.sampling_params.structured_outputs is not None
        for token_id in new_token_ids:
            accepted.append(token_id)
            request.append_output_token_ids([token_id])
            if self._check_stop(request, token_id):
                break
            if structured and self.structured_output_manager.accept_tokens(req_id, [token_id]):
                request.status = RequestStatus.FINISHED_STOPPED
                break
        if request.status != RequestStatus.RUNNING:
            # (Preempted while its step ran: it restarts without drafts.)
            request.spec_token_ids = []
        elif not self.num_output_placeholders.get(req_id):
            # (Else its next step is scheduled already, with placeholder drafts.)
            drafts = model_runner_output.draft_token_ids.get(req_id, [])
            if structured and drafts:
                drafts = self.structured_output_manager.validate_tokens(req_id, drafts)
            request.spec_token_ids = drafts
        logprobs = model_runner_output.logprobs.get(req_id)
        return EngineCoreOutput(
            request_id=req_id, new_token_ids=accepted,
            finish_reason=request.get_finished_reason(), stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            new_logprobs=logprobs.slice(0, len(accepted)) if logprobs else None,
            new_prompt_logprobs=prompt_logprobs.get(req_id),
            new_routed_experts=new_routed)

    def _end_draft_step(self, req_id: str) -> bool:
        """One of `req_id`'s steps with drafts came through `update_from_output`: whether its
        rejected drafts roll num_computed_tokens back (not if preempted since it was scheduled)."""
        left = self._draft_steps_in_flight.get(req_id, 0) - 1
        if left > 0:
            self._draft_steps_in_flight[req_id] = left
        else:
            self._draft_steps_in_flight.pop(req_id, None)
        void = self._void_draft_rollbacks.get(req_id, 0)
        if not void:
            return True
        if void > 1:
            self._void_draft_rollbacks[req_id] = void - 1
        else:
            del self._void_draft_rollbacks[req_id]
        return False

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        if stop_token_reached(token_id, params.all_stop_token_ids, request.num_output_tokens,
                              params.min_tokens):
            request.status = RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
            return True
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ----------------------------------------------------------------- stats
    def reset_prefix_cache(self, reset_connector: bool = True) -> int:
        """Drop the prefix cache's entries, and with `reset_connector` the KV connector's
        stored blocks too (a weight update: no stored KV is valid any more; sleep keeps them);
        returns device entries dropped."""
        if reset_connector and self.kv_connector is not None:
            self.kv_connector.reset_cache()
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        mgr = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running), num_waiting_reqs=len(self.waiting),
            kv_cache_usage=mgr.usage(), num_blocks=mgr.num_blocks,
            num_free_blocks=mgr.block_pool.get_num_free_blocks(),
            num_cached_blocks=mgr.num_cached_blocks(),
            prefix_cache_stats=replace(self.kv_cache_manager.prefix_cache_stats),
            num_preemptions=self.num_preemptions,
            spec_decoding_stats=self.spec_decoding_stats.copy(),
            kv_connector_stats=(self.kv_connector.stats() if self.kv_connector is not None
                                else None),
            num_encoder_runs=self.encoder_cache_manager.num_encoder_runs)


def request_needs_sync_step(request: Request) -> bool:
    """Whether `request`'s next step needs its previous tokens on the host (before it is
    scheduled or sampled): structured output (the grammar bitmask is built from the accepted
    tokens) or sampling that reads them (`SamplingParams.reads_previous_tokens`). Such requests
    run under synchronous steps even with `async_scheduling`."""
    sp = request.sampling_params
    return sp.structured_outputs is not None or sp.reads_previous_tokens
