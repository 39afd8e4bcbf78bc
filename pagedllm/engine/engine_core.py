"""EngineCore: the scheduler plus the executor; one `step()` = schedule, run, update.

It knows token ids only (no text): the front end (`LLMEngine`) tokenizes and detokenizes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from transformers import AutoTokenizer

from pagedllm.config import EngineConfig, hf_model_info
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput
from pagedllm.core.scheduler import Scheduler, SchedulerStats
from pagedllm.executor.abstract import get_executor_class
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


class EngineCore:
    """Owns the scheduler and the executor.

    Args:
        config: validated engine config.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = get_executor_class(config.parallel_config.distributed_executor_backend)(
            config)
        try:
            num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()
            raise
        spec = config.speculative_config
        # A draft model writes KV for the positions it proposes: reserve them.
        lookahead = spec.num_speculative_tokens if spec and spec.method == "draft_model" else 0
        self.structured_output_manager = StructuredOutputManager(
            lambda: AutoTokenizer.from_pretrained(
                config.tokenizer_path, trust_remote_code=config.model_config.trust_remote_code),
            hf_model_info(config.model_path).vocab_size, config.reasoning_parser)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config,
                                   config.max_model_len, num_blocks, lookahead,
                                   self.structured_output_manager,
                                   kv_cache_windows=self.executor.kv_cache_windows())
        self._block_hasher = (get_request_block_hasher(config.cache_config.block_size)
                              if config.cache_config.enable_prefix_caching else None)
        self.num_blocks = num_blocks

    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: if it can never fit the KV cache or its id is in use (the InputProcessor
                checks both before; this is the scheduler's own guard).
        """
        self.scheduler.add_request(Request(req.request_id, req.prompt_token_ids,
                                           req.sampling_params, req.max_tokens,
                                           self._block_hasher, req.arrival_time))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> list[EngineCoreOutput]:
        if not self.scheduler.has_unfinished_requests():
            return []
        scheduler_output = self.scheduler.schedule()
        runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, runner_output)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
