"""Worker: sets up the device, loads the model, sizes the KV cache and runs steps.

The KV cache size comes from a memory budget: explicit `kv_cache_memory_bytes`, or what the
platform allows after a profile run (`Platform.kv_cache_budget_bytes`). It is returned to the
engine (never written into a config). With tensor/pipeline parallelism each worker process is one
rank: it joins the torch.distributed world and its TP/PP groups before the model is built, so the
layers shard themselves (see distributed/parallel_state.py).
"""

from __future__ import annotations

import logging

from transformers import AutoConfig

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_groups import (KVCacheGroupSpec, is_state_group, kv_cache_bytes,
                                           num_blocks_for_budget)
from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.parallel_state import (destroy_model_parallel, get_pp_group,
                                                 get_tp_group, init_distributed_environment,
                                                 initialize_model_parallel)
from pagedllm.layers.vocab_embedding import VocabEmbedding
from pagedllm.platforms import current_platform
from pagedllm.worker.async_output import AsyncModelRunnerOutput
from pagedllm.worker.kv_cache import describe_kv_bytes_per_token
from pagedllm.worker.kv_connector.base import (KVConnectorWorker, KVLayerHooks,
                                                create_worker_connector, finish_step,
                                                model_fingerprint, start_step)
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.sleep_mode import SleepMode

logger = logging.getLogger(__name__)

# Tokens of the profile run where it is only a warm-up (`Platform.profile_run_at_max_batch`
# False): enough to take the prefill and decode paths once.
PROFILE_WARMUP_TOKENS = 64


def _describe_group(group: KVCacheGroupSpec, block_size: int, bytes_per_block: int) -> str:
    """'4096 blocks x 16 tokens = 65536 tokens' (+ the group's attention type); a state group:
    its slots and the state memory per request."""
    if group.state and group.align:
        total_mib = (group.num_blocks - 1) * bytes_per_block / 2**20
        return (f"{group.num_blocks - 1} state slots (one per running request, and as many "
                f"for steps that cross a block and for prefix-cache checkpoints: "
                f"mamba_cache_mode align) of {bytes_per_block / 2**20:.3f} MiB state memory "
                f"per request ({total_mib:.3f} MiB in all)")
    if group.state:
        return (f"{group.num_blocks - 1} state slots (one per running request) of "
                f"{bytes_per_block / 2**20:.3f} MiB state memory per request")
    kind = ("full attention" if group.sliding_window is None
            else f"sliding window {group.sliding_window}")
    return (f"{group.num_blocks - 1} blocks x {block_size} tokens = "
            f"{(group.num_blocks - 1) * block_size} tokens ({kind})")


class Worker:
    """One rank of the model on one device.

    Args:
        config: the engine config.
        rank: global rank (pp_rank * tp_size + tp_rank); 0 for the single-process engine.
        local_rank, local_world_size: index among / number of worker processes on this machine.
        distributed_init_method: torch.distributed rendezvous ("tcp://host:port" or "env://");
            needed when the world size (tp * pp) is above 1.

    Raises:
        ValueError: a world size above 1 without `distributed_init_method`.
    """

    def __init__(self, config: EngineConfig, rank: int = 0, local_rank: int = 0,
                 local_world_size: int = 1, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.platform = current_platform
        self.dtype = self.platform.resolve_dtype(config.model_config.dtype)
        pc = config.parallel_config
        # Among every worker process on this machine, the other local DP replicas' included.
        self.platform.init_device(*pc.machine_slot(local_rank, local_world_size),
                                  pc.cpu_threads_bind, pc.cpu_reserved_cores)
        self.device = self.platform.device
        if pc.world_size > 1:
            if distributed_init_method is None:
                raise ValueError(f"world size {pc.world_size} needs a distributed_init_method")
            init_distributed_environment(pc.world_size, rank, distributed_init_method,
                                         self.platform.dist_backend)
            initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                      self.platform.dist_backend)
        self.platform.seed_everything(config.model_config.seed)
        self.hf_config = AutoConfig.from_pretrained(
            config.model_path, trust_remote_code=config.model_config.trust_remote_code)
        self.model_runner = ModelRunner(config, self.hf_config, self.device, self.dtype)
        self.sleep_mode = SleepMode(config.model_path, self.model_runner.load_fresh_model)
        self._num_blocks = 0   # (set by initialize_kv_cache; wake_up allocates as many)
        self.kv_connector: KVConnectorWorker | None = None   # (set by init_kv_connector)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_blocks(self) -> int:
        """Number of KV blocks (the null block included) of KV cache group 0 that fit the
        memory budget together with the other groups' (see core/kv_cache_groups.py). Sized by a
        memory fraction on a platform with `cap_kv_cache_at_need` (the CPU), no more than
        max_num_seqs requests of max_model_len tokens can use.

        Raises:
            ValueError: if fewer than 2 blocks (the null block and one usable) fit.
        """
        cc, sc = self.config.cache_config, self.config.scheduler_config
        runner = self.model_runner
        group_bytes = runner.kv_cache_group_bytes_per_block()
        if cc.num_gpu_blocks_override is not None:
            num_blocks = cc.num_gpu_blocks_override
        else:
            if cc.kv_cache_memory_bytes is not None:
                budget = cc.kv_cache_memory_bytes
            else:
                runner.profile_run(None if self.platform.profile_run_at_max_batch
                                   else PROFILE_WARMUP_TOKENS)
                budget = self.platform.kv_cache_budget_bytes(cc.gpu_memory_utilization)
            num_blocks = num_blocks_for_budget(
                budget, group_bytes, runner.kv_cache_windows, cc.block_size, sc.max_num_seqs,
                sc.max_num_batched_tokens, self.config.num_lookahead_tokens)
            if ((cc.kv_cache_memory_bytes is None and self.platform.cap_kv_cache_at_need)
                    or (group_bytes[0] == 0 and num_blocks >= 2)):
                # (A model without attention layers, e.g. Mamba-2: group 0's blocks cost
                # nothing and only count token slots; as many as its requests can use.)
                # Enough for max_num_seqs requests at max_model_len, no more (Platform docs).
                num_blocks = min(num_blocks,
                                 1 + sc.max_num_seqs * self.config.max_num_blocks_per_req)
        if num_blocks < 2:
            windows = runner.kv_cache_windows
            need = kv_cache_bytes(2, group_bytes, windows, cc.block_size, sc.max_num_seqs,
                                  sc.max_num_batched_tokens, self.config.num_lookahead_tokens)
            states = (f", the state cache's slots for max_num_seqs={sc.max_num_seqs} requests "
                      "included (a lower max_num_seqs needs less)"
                      if any(is_state_group(w) for w in windows) else "")
            raise ValueError(f"KV cache budget holds {num_blocks} blocks of {sum(group_bytes)} "
                             f"bytes; at least 2 are needed: {need} bytes with this model's "
                             f"cache groups{states}. Give the cache more memory.")
        attn = runner._attention_layers()   # a drafter's layers (MTP modules) included
        groups = runner.kv_cache_groups(num_blocks)
        total_bytes = sum(g.num_blocks * b for g, b in zip(groups, group_bytes))
        # NOTE(reserved): the figure is the cache's size, set by the budget, not memory in use:
        # a small model's default budget reads like gigabytes used otherwise.
        logger.info("KV cache: %s; %.1f MiB reserved (%s, %s; blocks are filled as requests "
                    "need them); attention backend %s",
                    "; ".join(_describe_group(g, cc.block_size, b)
                              for g, b in zip(groups, group_bytes)),
                    total_bytes / 2**20,
                    str(runner.kv_cache_dtype).removeprefix("torch."),
                    describe_kv_bytes_per_token(attn, runner.kv_cache_dtype,
                                                runner.indexer_cache_dtype),
                    attn[0].backend.name if attn else "-")
        return num_blocks

    def kv_cache_windows(self) -> tuple[int | None, ...]:
        """The KV cache groups' sliding windows (None = full attention), group 0 first."""
        return self.model_runner.kv_cache_windows

    def kv_cache_bytes_per_token(self) -> int:
        """Bytes of KV cache one token takes on this rank, over every layer (an MLA latent, a
        DSA indexer key, int8 scales and a draft model's layers included): the start-up log's
        figure."""
        runner = self.model_runner
        return runner.kv_cache_bytes_per_block() // runner.block_size

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        self._num_blocks = num_blocks

    # ------------------------------------------- sleep mode and weight updates (sleep_mode.py)
    def sleep(self, level: int) -> int:
        """Free the KV cache, and the weights per `level` (worker/sleep_mode.py); returns the
        bytes freed (KV cache + weights leaving the device).

        Raises:
            ValueError: a level other than 1 or 2, or already asleep.
        """
        runner = self.model_runner
        kv_bytes = sum(c.numel() * c.element_size() for c in runner.kv_caches)
        weight_bytes = self.sleep_mode.sleep(runner.model, level)
        runner.release_kv_cache()
        self.platform.release_freed_memory()
        return kv_bytes + weight_bytes

    def wake_up(self) -> None:
        """Weights back (reloaded after level 2), an empty KV cache of the same size again.

        Raises:
            ValueError, FileNotFoundError: level 2's checkpoint cannot be loaded again.
        """
        runner = self.model_runner
        if self.sleep_mode.wake_up(runner.model):
            runner.weights_changed()
        if not runner.kv_caches:
            runner.initialize_kv_cache(self._num_blocks)
            if self.kv_connector is not None:
                self.kv_connector.register_kv_caches(runner.kv_caches_by_layer())

    def stage_weights(self, model_path: str) -> str | None:
        """Load and check the weights of the checkpoint at `model_path` for `commit_weights`;
        None when they fit, else why not (nothing changed)."""
        return self.sleep_mode.stage(self.model_runner.model, model_path)

    def commit_weights(self) -> None:
        """Copy the staged weights into the model in place (the KV connector's stored files
        are then marked as of the new checkpoint)."""
        self.sleep_mode.commit(self.model_runner.model)
        self.model_runner.weights_changed()
        if self.kv_connector is not None:
            self.kv_connector.set_model_fingerprint(
                model_fingerprint(self.sleep_mode.weights_path))

    def kv_connector_info(self) -> dict:
        """`KVConnectorWorker.info()` of this rank's connector."""
        return self.kv_connector.info()

    def discard_weights(self) -> None:
        """Drop a staged weight update."""
        self.sleep_mode.discard()

    def init_kv_connector(self) -> dict:
        """Create the KV connector's worker side (`kv_transfer_config`) over the allocated KV
        cache; returns what the scheduler side needs of this rank (`KVConnectorWorker.info`)."""
        runner = self.model_runner
        self.kv_connector = create_worker_connector(
            self.config.kv_transfer_config, runner.kv_caches_by_layer(),
            runner.kv_cache_bytes_per_block(), self.device, self.rank,
            model_fingerprint(self.config.model_path))
        return self.kv_connector.info()

    def execute_model(self, scheduler_output: SchedulerOutput,
                      grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """One step, or the `num_steps` decode steps of a multi-step round (whose requests have
        no grammar: `grammar_output` is the first step's); the KV connector's loads start
        before it, each attention layer waits for its own and hands its saves over, and the
        step ends when the saves are done (worker/kv_connector/base.py)."""
        self.platform.before_step()
        hooks = self._start_kv(scheduler_output)
        try:
            self.model_runner.execute_model(scheduler_output)
            output = self.model_runner.sample_tokens(grammar_output)
            if scheduler_output.num_steps > 1:
                output = self.model_runner.run_remaining_steps(scheduler_output.num_steps,
                                                               output)
        finally:
            self.model_runner.kv_hooks = None
        self._finish_kv(hooks, output)
        self.platform.after_step()
        return output

    def execute_model_async(self, scheduler_output: SchedulerOutput,
                            grammar_output: GrammarOutput | None = None
                            ) -> AsyncModelRunnerOutput:
        """As `execute_model`, leaving the sampled tokens on the device (async scheduling)."""
        self.platform.before_step()
        hooks = self._start_kv(scheduler_output)
        try:
            self.model_runner.execute_model(scheduler_output)
            output = self.model_runner.sample_tokens_async(grammar_output)
        finally:
            self.model_runner.kv_hooks = None
        self._finish_kv(hooks, output)
        self.platform.after_step()
        return output

    def _start_kv(self, scheduler_output: SchedulerOutput) -> KVLayerHooks | None:
        """The connector's loads start; its per-layer seams go to the runner's forwards."""
        if self.kv_connector is None:
            return None
        hooks = start_step(self.kv_connector, scheduler_output.kv_connector_metadata,
                           list(self.model_runner.kv_caches_by_layer()),
                           save_in_forward=scheduler_output.num_steps == 1)
        self.model_runner.kv_hooks = hooks
        return hooks

    def _finish_kv(self, hooks: KVLayerHooks | None,
                   output: ModelRunnerOutput | AsyncModelRunnerOutput) -> None:
        """The connector's saves end; the blocks whose loads failed go back in `output`
        (`invalid_block_ids`: the scheduler recomputes them; with several ranks the executor
        merges every rank's, `execute_model_reporting_kv`).
        """
        if hooks is None:
            return
        finish_step(hooks, self.model_runner.kv_caches_by_layer())
        output.invalid_block_ids = self.kv_connector.get_block_ids_with_load_errors()

    def execute_model_reporting_kv(self, scheduler_output: SchedulerOutput,
                                   grammar_output: GrammarOutput | None,
                                   reply_rank: int) -> ModelRunnerOutput | set[int]:
        """`execute_model` for the distributed executors with a KV connector: rank
        `reply_rank` (the driver) returns its ModelRunnerOutput, every other rank only the
        device block ids its connector failed to load this step (a set of ints, often
        empty), which the executor merges into the driver's (executor/abstract.py,
        `merge_invalid_block_ids`; vLLM's KVOutputAggregator)."""
        output = self.execute_model(scheduler_output, grammar_output)
        return output if self.rank == reply_rank else output.invalid_block_ids

    def layout_summary(self) -> str:
        """One line: this rank's place in the layout, its layers, heads, vocab rows and memory."""
        model = self.model_runner.model
        tp, pp = get_tp_group(), get_pp_group()
        attn = model.attention_layers()
        vocab = next((m for m in model.modules() if isinstance(m, VocabEmbedding)), None)
        rows = (f"vocab rows [{vocab.vocab_start_index}, {vocab.vocab_end_index})"
                if vocab is not None else "no vocab rows")
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        # Each allocation once, whole: int8 / fp8 caches with their scales, C8 indexer caches
        # (scales in the rows), caches that are views of one buffer.
        storages = {c.untyped_storage().data_ptr(): c.untyped_storage().nbytes()
                    for c in self.model_runner.kv_caches}
        kv_bytes = sum(storages.values())
        layers = (f"{len(attn)} layers ({attn[0].layer_name} .. {attn[-1].layer_name}), "
                  f"{attn[0].num_heads} attention heads and {attn[0].num_kv_heads} KV heads per "
                  "layer" if attn else "no attention layers")
        return (f"rank {self.rank} (tp {tp.rank_in_group}/{tp.world_size}, pp "
                f"{pp.rank_in_group}/{pp.world_size}): {layers}, {rows}; weights "
                f"{weight_bytes / 2**20:.1f} MiB, KV cache {kv_bytes / 2**20:.1f} MiB, peak "
                f"device memory {self.platform.peak_memory_bytes() / 2**20:.1f} MiB"
                + (f"; {self.platform.placement}" if self.platform.placement else ""))

    def encoder_stats(self) -> dict[str, float] | None:
        """The vision encoder's counters on this rank (`EncoderRunner.stats`: batches, images,
        seconds since start-up); None for a text-only model. For `collective_rpc`."""
        runner = self.model_runner.encoder_runner
        return None if runner is None else runner.stats()

    def shutdown(self) -> None:
        """Stop the KV connector's copy thread; leave the process groups (a no-op for the
        single-process engine)."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        if self.config.parallel_config.world_size > 1:
            destroy_model_parallel()

    def peak_memory_bytes(self) -> int:
        return self.platform.peak_memory_bytes()

