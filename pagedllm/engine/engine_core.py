"""EngineCore: the scheduler plus the executor; one `step()` = schedule, run, update.

It knows token ids only (no text): the front end (`LLMEngine`) tokenizes and detokenizes.

With `async_scheduling` a step call schedules and launches step N+1 before it waits for step N
and updates the scheduler with N's tokens (`_step_async`), so at most two steps are in flight and
the host's scheduling of N+1 and the caller's output processing of N overlap N+1's forward. Steps
fall back to synchronous (in-flight steps drained first) while a live request needs its previous
tokens on the host (`Scheduler.needs_sync_step`: structured output, penalties, bad words, logits
processors). With speculative decoding step N+1 is scheduled with placeholder drafts before
step N's accepted tokens and drafts reach the scheduler (core/scheduler.py, worker/async_drafts.py;
docs/spec_decode.md). See docs/architecture.md.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from dataclasses import dataclass

from transformers import AutoTokenizer

from pagedllm.config import EngineConfig
from pagedllm.hf_config import hf_model_info
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.kv_connector.base import KVConnectorScheduler
from pagedllm.core.kv_connector.factory import create_scheduler_connector
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import (EngineCoreOutput, EplbStats, ModelRunnerOutput,
                                        SchedulerOutput)
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.engine.sleep_mode import EngineSleepingError, weight_reload_refusal
from pagedllm.executor.abstract import get_executor_class
from pagedllm.lora.request import LoRARequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.platforms import current_platform
from pagedllm.sampling_params import SamplingParams
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreRequest:
    """A tokenized, validated request as it reaches the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    arrival_time: float | None = None
    priority: int = 0
    lora_request: LoRARequest | None = None
    # The prompt's images (their placeholder ranges and encoder inputs); None: text only.
    mm_features: list[MultiModalFeature] | None = None


class EngineCore:
    """Owns the scheduler and the executor.

    Args:
        config: validated engine config.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        executor_class = get_executor_class(config.parallel_config.distributed_executor_backend)
        self.async_scheduling = resolve_async_scheduling(config, executor_class)
        self.num_scheduler_steps = resolve_num_scheduler_steps(config, self.async_scheduling)
        self.executor = executor_class(config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(num_blocks)
            kv_connector = self._make_kv_connector()
        except BaseException:
            self.executor.shutdown()
            raise
        spec = config.speculative_config
        self.structured_output_manager = StructuredOutputManager(
            lambda: AutoTokenizer.from_pretrained(
                config.tokenizer_path, trust_remote_code=config.model_config.trust_remote_code),
            hf_model_info(config.model_path).vocab_size, config.reasoning_parser)
        mm = config.multimodal_config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config,
                                   config.max_model_len, num_blocks,
                                   config.num_lookahead_tokens,
                                   self.structured_output_manager,
                                   kv_cache_windows=self.executor.kv_cache_windows(),
                                   async_scheduling=self.async_scheduling,
                                   num_scheduler_steps=self.num_scheduler_steps,
                                   num_speculative_tokens=spec.num_speculative_tokens
                                   if spec else 0,
                                   max_loras=config.lora_config.max_loras
                                   if config.lora_config else 0,
                                   kv_connector=kv_connector,
                                   max_num_encoder_input_tokens=mm.max_num_encoder_input_tokens,
                                   encoder_cache_size=mm.encoder_cache_size)
        # Async scheduling: steps launched and not yet through update_from_output, oldest first.
        self._in_flight: deque[tuple[SchedulerOutput, object]] = deque()
        self._block_hasher = (get_request_block_hasher(config.cache_config.block_size)
                              if config.cache_config.enable_prefix_caching else None)
        self.num_blocks = num_blocks
        # The largest over the ranks (pipeline stages hold different layers), for /metrics.
        self.kv_cache_bytes_per_token = max(
            self.executor.collective_rpc("kv_cache_bytes_per_token"))
        # What one request can ever hold (the front end's gate asks it, as add_request does).
        self.kv_cache_capacity = self.scheduler.kv_cache_capacity
        # The last EPLB rebalance the driver worker reported (None: none yet, or EPLB off).
        self.eplb_stats: EplbStats | None = None
        # 0 awake, else the level of the last `sleep` (engine/sleep_mode.py).
        self.sleep_level = 0

    def _make_kv_connector(self) -> KVConnectorScheduler | None:
        """The KV connector of `kv_transfer_config` (workers' sides first; their tiers' size
        sets the scheduler side's), or None.

        Raises:
            ValueError: a model with several KV cache groups (sliding-window layers), which
                the connectors do not support yet, or settings the connector refuses.
        """
        config = self.config.kv_transfer_config
        if config is None:
            return None
        if self.executor.kv_cache_windows() != (None,):
            raise ValueError(f"kv_transfer_config: {config.kv_connector} supports models with "
                             "one full-attention KV cache group only (this one has "
                             "sliding-window layers)")
        infos = self.executor.collective_rpc("init_kv_connector")
        if config.kv_connector == "OffloadingConnector":
            logger.info("KV connector %s (%s): a host tier of %d blocks%s",
                        config.kv_connector, config.kv_role,
                        min(i["num_tier_blocks"] for i in infos),
                        f", a disk tier in {config.kv_connector_extra_config['kv_offloading_dir']}"
                        if config.kv_connector_extra_config.get("kv_offloading_dir") else "")
        else:
            logger.info("KV connector %s (%s), transfer endpoint %s:%d", config.kv_connector,
                        config.kv_role, config.kv_ip, config.kv_port)
        return create_scheduler_connector(config, self.config.cache_config.block_size, infos)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: if it can never fit the KV cache or its id is in use (the InputProcessor
                checks both before; this is the scheduler's own guard).
            EngineSleepingError: the engine is asleep (engine/sleep_mode.py).
        """
        self.check_awake()
        self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids,
                                           req.sampling_params, req.max_tokens,
                                           self._request_block_hasher(req.lora_request),
                                           req.arrival_time, req.priority, req.lora_request,
                                           req.mm_features))

    def _request_block_hasher(self, lora_request: LoRARequest | None):
        """The block hasher of a request under `lora_request`: an adapter changes every
        layer's KV, so its id is an extra key of each block hash (the same prompt under two
        adapters shares no block)."""
        if self._block_hasher is None or lora_request is None:
            return self._block_hasher
        return get_request_block_hasher(self.config.cache_config.block_size,
                                        ("lora", lora_request.lora_int_id))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        """Run one step; the outputs of the step that completed (with async scheduling, the
        previous one: the step just launched runs on)."""
        if self.async_scheduling:
            return self._step_async()
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(
            scheduler_output, self.scheduler.get_grammar_output(scheduler_output))
        return self._update(scheduler_output, runner_output)

    def _update(self, scheduler_output: SchedulerOutput,
                runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        if runner_output.eplb_stats is not None:
            self.eplb_stats = runner_output.eplb_stats
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def _step_async(self) -> list[EngineCoreOutput]:
        """Schedule and launch step N+1 (its decodes take step N's tokens on the device), then
        wait for step N and update the scheduler with it.

        All in-flight steps are waited for when the new step computes nothing (every running
        request waits for its last token) and before a synchronous step, which is then run by
        the next call.
        """
        if self.scheduler.needs_sync_step() or not self.scheduler.has_unfinished_requests():
            if self._in_flight:
                return self._drain()
            if not self.scheduler.has_unfinished_requests():
                return []
            scheduler_output = self.scheduler.schedule()
            return self._update(scheduler_output, self.executor.execute_model(
                scheduler_output, self.scheduler.get_grammar_output(scheduler_output)))
        scheduler_output = self.scheduler.schedule()
        # (Its grammar output is None: a structured request makes the steps synchronous.)
        self._in_flight.append((scheduler_output, self.executor.execute_model(
            scheduler_output, self.scheduler.get_grammar_output(scheduler_output),
            non_block=True)))
        if scheduler_output.total_num_scheduled_tokens == 0:
            return self._drain()
        outputs: list[EngineCoreOutput] = []
        while len(self._in_flight) > 1:
            outputs.extend(self._update_oldest())
        return outputs

    def _update_oldest(self) -> list[EngineCoreOutput]:
        scheduler_output, future = self._in_flight.popleft()
        try:
            runner_output = future.result()
        except BaseException:
            # The step failed: the later in-flight steps are moot; wait for them (ignoring their
            # errors) so that the next call, after the caller aborted its requests, starts clean.
            while self._in_flight:
                try:
                    self._in_flight.popleft()[1].result()
                except Exception:  # noqa: BLE001 - the first error is the one raised
                    pass
            raise
        return self._update(scheduler_output, runner_output)

    def _drain(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        while self._in_flight:
            outputs.extend(self._update_oldest())
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def get_num_unfinished_requests(self) -> int:
        return self.scheduler.get_num_unfinished_requests()

    def check_health(self) -> None:
        """In this process the core lives as long as its caller (the multiprocess client's
        raises EngineDeadError when its process died)."""

    def wake(self) -> None:
        """No-op: `step()` here never waits (the multiprocess client's ends a wait for outputs)."""

    def call_utility(self, method: str, *args):
        """`self.<method>(*args)`: the uniform way to call an engine-core method through any
        client (core_client.py); `method` must be public."""
        if method.startswith("_"):
            raise AttributeError(f"{method!r} is private; only public engine-core methods are "
                                 f"called")
        return getattr(self, method)(*args)

    def reset_prefix_cache(self) -> int:
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    # ------------------------------------------- sleep mode and weight updates (sleep_mode.py)
    def is_sleeping(self) -> bool:
        return self.sleep_level > 0

    def check_awake(self) -> None:
        """Raises EngineSleepingError while asleep."""
        if self.sleep_level:
            raise EngineSleepingError(f"the engine is asleep (sleep level {self.sleep_level}); "
                                      "it serves requests again after wake_up")

    def _require_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what} needs an idle engine: "
                               f"{self.scheduler.get_num_unfinished_requests()} requests are "
                               "unfinished (let them finish, abort them, or pause generation "
                               "with mode 'abort')")

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1; the weights go to host memory, or stay where they are on
        the CPU) or the KV cache and the weights (level 2; reloaded by `wake_up`). The prefix
        cache is dropped. A no-op when already asleep at this level or deeper.

        Raises:
            ValueError: sleep mode not enabled, a level other than 1 or 2, or level 2 where the
                weights cannot be reloaded (`weight_reload_refusal`).
            RuntimeError: requests are unfinished.
        """
        if not self.config.model_config.enable_sleep_mode:
            raise ValueError("sleep mode is off; start the engine with enable_sleep_mode=True "
                             "(--enable-sleep-mode)")
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
        if level == 2 and (why := weight_reload_refusal(self.config)):
            raise ValueError(f"sleep level 2: {why}; use level 1")
        if self.sleep_level >= level:
            return
        if self.sleep_level:
            self.wake_up()
        self._require_idle("sleep")
        # (The KV connector's tier stays: the weights it was computed with come back.)
        self.scheduler.reset_prefix_cache(reset_connector=False)
        freed = sum(self.executor.collective_rpc("sleep", (level,)))
        self.sleep_level = level
        logger.info("asleep (level %d): %.1f MiB freed", level, freed / 2**20)

    def wake_up(self) -> None:
        """Weights back (level 2: reloaded from the checkpoint last loaded) and an empty KV
        cache of the same size; a no-op when awake.

        Raises:
            ValueError, FileNotFoundError: level 2's checkpoint cannot be loaded again (the
                engine stays asleep).
        """
        if not self.sleep_level:
            return
        self.executor.collective_rpc("wake_up")
        self.sleep_level = 0
        logger.info("awake")

    def update_weights(self, model_path: str) -> None:
        """Replace the weights by those of the checkpoint at `model_path` in place, on every
        rank (each loads its shard), without a restart; the prefix cache is dropped. The
        engine's config (shapes, RoPE, norms' eps) stays: the checkpoint must have the same
        architecture and tensor shapes. Every rank loads and checks its shard before any rank
        copies: a refused update leaves the old weights serving everywhere.

        Raises:
            ValueError: weights that do not fit (names, shapes or dtypes, named), a checkpoint
                that cannot be loaded, or an engine whose weights cannot be reloaded.
            EngineSleepingError: the engine is asleep.
            RuntimeError: requests are unfinished.
        """
        if why := weight_reload_refusal(self.config):
            raise ValueError(f"update_weights: {why}")
        if not os.path.isdir(model_path):
            raise ValueError(f"update_weights: model folder not found: {model_path}")
        self.check_awake()
        self._require_idle("update_weights")
        refusals = [r for r in self.executor.collective_rpc("stage_weights", (str(model_path),))
                    if r is not None]
        if refusals:
            self.executor.collective_rpc("discard_weights")
            raise ValueError(f"update_weights: {refusals[0]}; the old weights keep serving")
        self.executor.collective_rpc("commit_weights")
        self.scheduler.reset_prefix_cache()
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.update_worker_infos(
                self.executor.collective_rpc("kv_connector_info"))
        logger.info("weights updated from %s", model_path)

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """`Worker.method(*args)` on every rank (vLLM's `collective_rpc`); results by rank.

        Raises:
            ValueError: `method` is not a public method of the worker.
            Whatever the worker raised (uniproc) or WorkerDiedError (mp, Ray).
        """
        from pagedllm.worker.worker import Worker
        if not isinstance(method, str) or method.startswith("_") \
                or not callable(getattr(Worker, method, None)):
            raise ValueError(f"collective_rpc: {method!r} is not a public Worker method")
        if method in _ENGINE_MANAGED_WORKER_METHODS:
            raise ValueError(f"collective_rpc: {method!r} changes state the engine keeps in "
                             f"step with the workers; call the engine's own method instead "
                             f"(sleep, wake_up, update_weights, ...)")
        return self.executor.collective_rpc(method, tuple(args))

    def shutdown(self) -> None:
        if self.scheduler.kv_connector is not None:
            self.scheduler.kv_connector.shutdown()
        self.structured_output_manager.shutdown()
        self.executor.shutdown()


# Worker methods only the engine calls (each has engine-side state to keep in step).
_ENGINE_MANAGED_WORKER_METHODS = frozenset({
    "load_model", "determine_num_blocks", "initialize_kv_cache", "init_kv_connector",
    "execute_model", "execute_model_async", "execute_model_reporting_kv", "sleep", "wake_up",
    "shutdown"})


def resolve_async_scheduling(config: EngineConfig, executor_class: type) -> bool:
    """Whether the engine schedules asynchronously (`SchedulerConfig.async_scheduling`).

    None picks it where it helps: CUDA (the device runs step N while the host prepares N+1) with
    an executor that supports it (`supports_async_scheduling`: uniproc). It stays off on the
    CPU: there the forward is host work too and measured no faster (docs/architecture.md).
    True combines with speculative decoding (placeholder drafts: core/scheduler.py); None
    leaves it off with speculation (measured on the CPU only: docs/spec_decode.md).

    Routed-experts capture (`enable_return_routed_experts`) reads each step's routing with
    its output, so it keeps every step synchronous (vLLM's R3 users turn async scheduling off
    likewise).

    Raises:
        ValueError: async_scheduling=True with an executor that cannot (mp, ray), or with
            enable_return_routed_experts.
    """
    requested = config.scheduler_config.async_scheduling
    if config.model_config.enable_return_routed_experts:
        if requested:
            raise ValueError("async_scheduling cannot be combined with "
                             "enable_return_routed_experts; drop --async-scheduling")
        return False
    supported = getattr(executor_class, "supports_async_scheduling", False)
    backend = config.parallel_config.distributed_executor_backend
    if requested and not supported:
        raise ValueError(f"async_scheduling is supported with distributed_executor_backend 'uni' "
                         f"(one process) only, not {backend!r}; drop --async-scheduling")
    if requested is None:
        # Multi-step rounds asked for explicitly: they replace async scheduling.
        requested = (supported and current_platform.device_type == "cuda"
                     and (config.scheduler_config.num_scheduler_steps or 1) == 1
                     and config.speculative_config is None)
    return bool(requested)


# Decode steps per round on CPU when `num_scheduler_steps` is left to the engine (offline use).
DEFAULT_CPU_NUM_SCHEDULER_STEPS = 16


def resolve_num_scheduler_steps(config: EngineConfig, async_scheduling: bool) -> int:
    """Decode steps per scheduling round (`SchedulerConfig.num_scheduler_steps`).

    None picks DEFAULT_CPU_NUM_SCHEDULER_STEPS on the CPU, where the scheduler, the output
    processing and the detokenizer run on the cores that also run the forward (at batch 1 of a
    small quantized model a sizeable share of each step: docs/architecture.md, "Multi-step
    rounds"; docs/benchmarks.md, "Measurements behind choices in the code"); 1 elsewhere (CUDA
    overlaps them through async scheduling), and 1 with speculative decoding, async scheduling,
    EPLB or routed-experts capture. `AsyncLLM.from_engine_args` (the server) passes 1 unless told otherwise.

    Raises:
        ValueError: more than one step together with speculative decoding, async scheduling,
            EPLB (each needs the engine between steps) or routed-experts capture (it collects
            each step's routing with that step's output).
    """
    requested = config.scheduler_config.num_scheduler_steps
    routed = config.model_config.enable_return_routed_experts
    if requested is None:
        return (DEFAULT_CPU_NUM_SCHEDULER_STEPS if current_platform.device_type == "cpu"
                and not async_scheduling and config.speculative_config is None
                and not config.parallel_config.enable_eplb and not routed else 1)
    if requested > 1 and routed:
        raise ValueError(f"num_scheduler_steps={requested} cannot be combined with "
                         f"enable_return_routed_experts; use 1")
    if requested > 1 and config.parallel_config.enable_eplb:
        raise ValueError(f"num_scheduler_steps={requested} cannot be combined with EPLB (it "
                         f"reports each rebalance with the step that made it); use 1")
    if requested > 1 and config.speculative_config is not None:
        raise ValueError(f"num_scheduler_steps={requested} cannot be combined with speculative "
                         f"decoding (it proposes drafts between steps); use 1")
    if requested > 1 and async_scheduling:
        raise ValueError(f"num_scheduler_steps={requested} cannot be combined with "
                         f"async_scheduling; use one or the other")
    return requested
