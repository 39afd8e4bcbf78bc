"""Worker: sets up the device, loads the model, sizes the KV cache and runs steps.

The KV cache size comes from a memory budget: explicit `kv_cache_memory_bytes`, or what the
platform allows after a profile run (`Platform.kv_cache_budget_bytes`). It is returned to the
engine (never written into a config).
"""

from __future__ import annotations

import logging

from transformers import AutoConfig

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.platforms import current_platform
from pagedllm.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Worker:
    """One model replica on one device."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.platform = current_platform
        self.device = self.platform.device
        self.dtype = self.platform.resolve_dtype(config.model_config.dtype)
        self.platform.init_device()
        self.platform.seed_everything(config.model_config.seed)
        self.hf_config = AutoConfig.from_pretrained(
            config.model_path, trust_remote_code=config.model_config.trust_remote_code)
        self.model_runner = ModelRunner(config, self.hf_config, self.device, self.dtype)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """Number of KV blocks (the null block included) that fit the memory budget.

        Raises:
            ValueError: if not even one full-length request fits.
        """
        cc = self.config.cache_config
        bytes_per_block = self.model_runner.kv_cache_bytes_per_block()
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            if cc.kv_cache_memory_bytes is not None:
                budget = cc.kv_cache_memory_bytes
            else:
                self.model_runner.profile_run()
                budget = self.platform.kv_cache_budget_bytes(cc.gpu_memory_utilization)
            num_blocks = budget // bytes_per_block
        if num_blocks < 2:
            raise ValueError(f"KV cache budget holds {num_blocks} blocks of {bytes_per_block} "
                             "bytes; at least 2 are needed. Give the cache more memory.")
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB, %s)", num_blocks - 1,
                    cc.block_size, (num_blocks - 1) * cc.block_size,
                    num_blocks * bytes_per_block / 2**20, str(self.dtype).removeprefix("torch."))
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.model_runner.execute_model(scheduler_output)
        return self.model_runner.sample_tokens()

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    def peak_memory_bytes(self) -> int:
        return self.platform.peak_memory_bytes()

