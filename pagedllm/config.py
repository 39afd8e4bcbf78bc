"""Engine configuration: frozen dataclasses validated once at start-up.

`EngineConfig` groups the Model/Cache/Scheduler/Parallel configs. Every config is frozen after
validation; a value learned at run time (the number of KV blocks, the EOS id) is returned by whoever
learns it and passed explicitly, never written back into a config. Validation errors are
`ValueError`s that name the offending field.

The parallel, speculative, KV-connector and multimodal configs live in their own modules
(`parallel_config`, `speculative_config`, `kv_transfer_config`, `multimodal_config`); this module
re-exports them, so `pagedllm.config` stays the one import path for every config.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.generation_config import GENERATION_CONFIG_SAMPLING_KEYS, get_diff_sampling_param
from pagedllm.hf_config import context_sliding_window, hf_model_info
from pagedllm.kv_transfer_config import (KV_ROLES, KVTransferConfig, check_offloading_size,
                                         resolve_kv_transfer_config)
from pagedllm.multimodal_config import MultiModalConfig
from pagedllm.parallel_config import EPLBConfig, ParallelConfig, validate_parallel_layout
from pagedllm.speculative_config import SPEC_METHODS, SpeculativeConfig

if TYPE_CHECKING:
    from pagedllm.lora.config import LoRAConfig

logger = logging.getLogger(__name__)

_DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to run and how.

    Attributes:
        model: local checkpoint folder, Hugging Face hub id or .gguf file.
        tokenizer: tokenizer folder or hub id (defaults to `model`; a .gguf model's comes from
            its metadata).
        dtype: "auto" (the platform's preferred dtype), "float32", "bfloat16" or "float16".
        max_model_len: context length in tokens (prompt + output); None = the model's
            `max_position_embeddings`.
        seed: seed for requests without their own seed; None (vLLM's: no fixed seed) draws
            one at random when the config is built and logs it (INFO), so a run can be
            repeated with it.
        revision: hub revision.
        trust_remote_code: passed to transformers when reading config/tokenizer.
        logprobs_mode: "raw_logprobs" (model output) or "processed_logprobs" (the distribution
            tokens are sampled from); see pagedllm/sample/logprobs.py.
        quantization: how linear weights are kept: None (the checkpoint's own: GGUF blocks for
            a .gguf file on the CPU where every linear weight's type has a kernel, else
            float), "gguf" (GGUF blocks, native CPU kernels), "none" (dequantized at load), or
            for a safetensors checkpoint "int8" (per-channel int8 weights, quantized at load)
            or "w8a8" (int8 weights and per-token int8 activations).
        chat_template: a Jinja chat template (the text, or the path of a file holding it) that
            replaces the tokenizer's own for chat requests (vLLM's `--chat-template`); None =
            the tokenizer's.
        generation_config: where the default sampling parameters of requests that leave them
            out come from (vLLM's `--generation-config`): "auto" (the checkpoint's
            generation_config.json; a .gguf file's `general.sampling.*` metadata, which its
            view records there), "vllm" (none: the built-in defaults) or a folder holding a
            generation_config.json. See
            `generation_config.get_diff_sampling_param`.
        override_generation_config: generation-config values (HF names: temperature, top_p,
            top_k, min_p, repetition_penalty, max_new_tokens) that replace those of the file
            (vLLM's `--override-generation-config`); they apply with "vllm" too.
        batch_invariant: compute every request's tokens and logprobs bit for bit the same
            whatever else is in its steps, however its prompt is chunked, and whether its
            prefix came from the cache or it was preempted (vLLM's `VLLM_BATCH_INVARIANT`):
            fixed reduction orders in attention and one forward path per model (CPU only; the
            engine refuses at start-up a model whose kernels cannot keep it, naming the layer).
            Costs speed (docs/benchmarks.md, "Batch-invariant mode").
        enable_sleep_mode: allow `sleep` / `wake_up` (vLLM's; docs/sleep_mode.md). Weight
            updates (`update_weights`) need no switch.
        enable_return_routed_experts: record the experts each MoE layer's router chose for
            every token and return them with each finished sequence
            (`CompletionOutput.routed_experts`, vLLM's; docs/kv_connectors.md, "RL use").
    """

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int | None = 0
    revision: str | None = None
    trust_remote_code: bool = False
    logprobs_mode: str = "raw_logprobs"
    quantization: str | None = None
    chat_template: str | None = None
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    batch_invariant: bool = False
    enable_sleep_mode: bool = False
    enable_return_routed_experts: bool = False

    def __post_init__(self) -> None:
        self._validate_generation_config()
        if self.quantization not in (None, "none", "gguf", "int8", "w8a8"):
            raise ValueError(f"quantization must be 'gguf', 'none', 'int8' or 'w8a8' (or None "
                             f"for the checkpoint's own), got {self.quantization!r}")
        if self.quantization in ("int8", "w8a8") and \
                str(self.model).lower().endswith(".gguf"):
            raise ValueError(f"quantization={self.quantization!r} quantizes a safetensors "
                             f"checkpoint at load; {self.model!r} is a .gguf model (use "
                             f"quantization='gguf' or 'none')")
        if self.quantization == "gguf" and not str(self.model).lower().endswith(".gguf"):
            raise ValueError(f"quantization='gguf' needs a .gguf model, got {self.model!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError("logprobs_mode must be 'raw_logprobs' or 'processed_logprobs', "
                             f"got {self.logprobs_mode!r}")
        dtype = _DTYPE_ALIASES.get(str(self.dtype).replace("torch.", ""), str(self.dtype).replace("torch.", ""))
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {_DTYPE_NAMES}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.seed is None:
            object.__setattr__(self, "seed", secrets.randbelow(2**63))
            logger.info("seed=None: drew the engine seed %d (pass seed=%d to repeat this run)",
                        self.seed, self.seed)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) \
                or not 0 <= self.seed <= 2**63 - 1:
            raise ValueError(f"seed must be an int from 0 to 2**63 - 1 or None (it seeds the "
                             f"engine's random number generators), got {self.seed!r}")

    def _validate_generation_config(self) -> None:
        source = self.generation_config
        if not isinstance(source, str) or (source not in ("auto", "vllm")
                                           and not Path(source).expanduser().is_dir()):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json, got {source!r}")
        override = self.override_generation_config
        if override is None:
            override = {}
        if not isinstance(override, dict):
            raise ValueError(f"override_generation_config must be a dict, got {override!r}")
        unknown = sorted(set(override) - set(GENERATION_CONFIG_SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown keys {unknown}; known: "
                             f"{sorted(GENERATION_CONFIG_SAMPLING_KEYS)}")
        object.__setattr__(self, "override_generation_config", dict(override))


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_bytes: explicit KV budget in bytes (all layers, K and V); overrides
            `gpu_memory_utilization`.
        gpu_memory_utilization: fraction of the device's total memory the engine may use (weights,
            activations and KV); the KV cache gets what remains after a profile run.
        num_gpu_blocks_override: force the number of blocks (tests).
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        cache_dtype: the KV cache dtype (engine arg `kv_cache_dtype`, vLLM's name): "auto" (= the
            model dtype), "int8" (per token and KV head scales) or "fp8_e4m3" (float8 e4m3fn,
            per-tensor scales); "fp8" is taken as "fp8_e4m3". See docs/benchmarks.md.
        indexer_cache_dtype: DeepSeek-V3.2's DSA indexer K cache: "auto" (follows cache_dtype),
            "int8" or "fp8_e4m3" with a scale per token (the "C8" cache; docs/mla.md).
        mamba_cache_mode: prefix caching of a hybrid model's recurrent states (vLLM's name):
            "align" (states checkpointed at block boundaries, so prefixes hit) or "none" (their
            requests get no prefix hits); with prefix caching off always "none". Models without
            recurrent layers ignore it. See docs/hybrid_models.md.
    """

    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    indexer_cache_dtype: str = "auto"
    mamba_cache_mode: str = "align"

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ValueError(
                f"num_gpu_blocks_override must be >= 2, got {self.num_gpu_blocks_override}")
        if self.cache_dtype == "fp8":
            object.__setattr__(self, "cache_dtype", "fp8_e4m3")
        if self.cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError("kv_cache_dtype must be 'auto', 'int8' or 'fp8_e4m3' (= 'fp8'), got "
                             f"{self.cache_dtype!r}")
        if self.indexer_cache_dtype == "fp8":
            object.__setattr__(self, "indexer_cache_dtype", "fp8_e4m3")
        if self.indexer_cache_dtype not in ("auto", "int8", "fp8_e4m3"):
            raise ValueError("indexer_cache_dtype must be 'auto', 'int8' or 'fp8_e4m3' (= 'fp8'), "
                             f"got {self.indexer_cache_dtype!r}")
        if self.mamba_cache_mode not in ("none", "align"):
            raise ValueError(f"mamba_cache_mode must be 'none' or 'align', got "
                             f"{self.mamba_cache_mode!r}")

    @property
    def align_state_checkpoints(self) -> bool:
        """Whether recurrent states are checkpointed for prefix hits (mode "align" in effect)."""
        return self.enable_prefix_caching and self.mamba_cache_mode == "align"


# Most decode steps per scheduling round: the per-round work is amortized well before this, and
# a round holds that many lookahead KV slots per request.
MAX_NUM_SCHEDULER_STEPS = 64


# Orders of the scheduler's waiting queue (vLLM's --scheduling-policy): core/request_queue.py.
SCHEDULING_POLICIES = ("fcfs", "priority")
# How a data-parallel request picks its replica: engine/dp_router.py.
ROUTING_POLICIES = ("prefix_aware", "least_loaded", "round_robin")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_batched_tokens: token budget of one step (all requests together).
        max_num_seqs: most requests in one step.
        enable_chunked_prefill: split prompts longer than the remaining budget over several steps.
        long_prefill_token_threshold: cap on one request's prefill chunk (0 = no cap), so one long
            prompt cannot take the whole budget from waiting requests.
        async_scheduling: schedule step N+1 while step N runs (vLLM's name; see
            docs/architecture.md). None = on where it helps (CUDA with the uniproc executor),
            off elsewhere; True with an executor that cannot is an error at engine start.
        num_scheduler_steps: decode steps run per scheduling round (vLLM V0's multi-step
            scheduling): while every running request decodes and no waiting one could be
            admitted, the runner feeds each sampled token straight into the next forward up to
            this many times before the scheduler and the output processing run again. None =
            the engine's default (`resolve_num_scheduler_steps`: 16 for offline generation on
            CPU, else 1).
        scheduling_policy: "fcfs" (arrival order) or "priority" (each request's `priority`,
            lower first, ties by arrival; see core/scheduler.py), vLLM's names.
    """

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    async_scheduling: bool | None = None
    num_scheduler_steps: int | None = None
    scheduling_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {list(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.num_scheduler_steps is not None and (
                isinstance(self.num_scheduler_steps, bool)
                or not isinstance(self.num_scheduler_steps, int)
                or not 1 <= self.num_scheduler_steps <= MAX_NUM_SCHEDULER_STEPS):
            raise ValueError(f"num_scheduler_steps must be an integer in [1, "
                             f"{MAX_NUM_SCHEDULER_STEPS}], got {self.num_scheduler_steps!r}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")


CUDAGRAPH_MODES = ("NONE", "FULL_DECODE_ONLY")


@dataclass(frozen=True)
class CudaGraphConfig:
    """CUDA graphs for decode steps (vLLM's `cudagraph_mode`, `cudagraph_capture_sizes` and
    `enforce_eager`; used only on CUDA, see worker/cuda_graph.py).

    Attributes:
        cudagraph_mode: "NONE" (always eager) or "FULL_DECODE_ONLY" (steps whose every request
            decodes one token replay a graph of the whole forward, captured per batch size).
        enforce_eager: never capture (the mode acts as "NONE").
        cudagraph_capture_sizes: batch sizes to capture, ascending; None = the default for
            `max_num_seqs` (1, 2, 4, 8, 16, 24, ... see `worker/cuda_graph.py`).
    """

    cudagraph_mode: str = "FULL_DECODE_ONLY"
    enforce_eager: bool = False
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got "
                             f"{self.cudagraph_mode!r}")
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
                raise ValueError(f"cudagraph_capture_sizes must be positive integers, got "
                                 f"{sizes}")
            if list(sizes) != sorted(set(sizes)):
                raise ValueError(f"cudagraph_capture_sizes must be ascending without "
                                 f"duplicates, got {sizes}")


@dataclass(frozen=True)
class RequestLimits:
    """Caps every request is checked against at admission (vLLM's / OpenAI's values).

    Attributes:
        max_n: most output sequences per prompt (`n`).
        max_logprobs: most alternatives per token for `logprobs` / `prompt_logprobs`
            (vLLM's `max_logprobs`; -1 = up to the vocabulary size).
        max_logit_bias: most `logit_bias` entries per request (OpenAI allows 300).
    """

    max_n: int = 128
    max_logprobs: int = 20
    max_logit_bias: int = 300

    def __post_init__(self) -> None:
        for name, minimum in (("max_n", 1), ("max_logprobs", -1), ("max_logit_bias", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class EngineConfig:
    """All configs of one engine, validated against each other.

    `model_path` is the resolved local folder of the checkpoint (hub ids resolved by
    `model_loader.hub.resolve_model_path`; a .gguf file by its checkpoint view, see
    `model_loader/gguf.py`). `max_model_len` is the effective context length.
    """

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    model_path: str
    tokenizer_path: str
    max_model_len: int
    speculative_config: SpeculativeConfig | None = None
    # Resolved local folder of the draft model (speculative method "draft_model").
    draft_model_path: str | None = None
    request_limits: RequestLimits = RequestLimits()
    # The `<think>` format of a reasoning model (`pagedllm/reasoning`): structured output then
    # constrains only the answer after the reasoning.
    reasoning_parser: str | None = None
    # CUDA graphs for decode steps (worker/cuda_graph.py); ignored off CUDA.
    cudagraph_config: CudaGraphConfig = CudaGraphConfig()
    # The model's recommended sampling defaults, read once at start (`get_diff_sampling_param`):
    # SamplingParams field -> value, only those the generation config sets. A request field left
    # out takes its value from here, else the built-in default.
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    # Multi-LoRA serving (docs/lora.md); None = off (`enable_lora=False`).
    lora_config: LoRAConfig | None = None
    # A KV connector (docs/kv_connectors.md); None = none.
    kv_transfer_config: KVTransferConfig | None = None
    # Image inputs of vision-language models (ignored for text-only ones).
    multimodal_config: MultiModalConfig = MultiModalConfig()

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None:
            from pagedllm.reasoning import get_reasoning_parser
            get_reasoning_parser(self.reasoning_parser)     # ValueError for an unknown name
        sc = self.scheduler_config
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({sc.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) and chunked prefill is off: long prompts "
                "could never be scheduled. Raise max_num_batched_tokens or enable chunked prefill.")
        if self.speculative_config is not None and self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("speculative_config is not supported with pipeline_parallel_size > 1 "
                             "(issue #11); use tensor parallelism")
        if self.model_config.enable_return_routed_experts:
            self._validate_return_routed_experts()
        self._validate_kv_connector_cache()

    def _validate_kv_connector_cache(self) -> None:
        """Refuse a KV connector over a quantized KV cache: the connectors copy the K/V
        values only, not the int8/fp8 scales that share the cache's allocation
        (kv_cache_layout.py), so blocks loaded back would be dequantized with stale scales."""
        cc = self.cache_config
        if self.kv_transfer_config is None:
            return
        for name, value in (("kv_cache_dtype", cc.cache_dtype),
                            ("indexer_cache_dtype", cc.indexer_cache_dtype)):
            if value != "auto":
                raise ValueError(
                    f"{name}={value!r} cannot be combined with the KV connector "
                    f"{self.kv_transfer_config.kv_connector} (kv_transfer_config / "
                    f"kv_offloading_size): it does not carry a quantized cache's scales; use "
                    f"{name}='auto' or no connector")

    def _validate_return_routed_experts(self) -> None:
        """Refuse what routed-experts capture cannot serve (as vLLM refuses pipeline
        parallelism): the last pipeline stage would see only its own layers' routing, and a KV
        connector's loaded tokens have no routing recorded on this engine."""
        if self.parallel_config.pipeline_parallel_size > 1:
            raise ValueError("enable_return_routed_experts is not supported with "
                             "pipeline_parallel_size > 1 (each stage sees only its own layers' "
                             "routing); use tensor or expert parallelism")
        if self.kv_transfer_config is not None:
            raise ValueError("enable_return_routed_experts cannot be combined with a KV "
                             "connector (kv_transfer_config / kv_offloading_size): tokens it "
                             "loads carry no routing")

    @property
    def max_num_blocks_per_req(self) -> int:
        bs = self.cache_config.block_size
        return (self.max_model_len + bs - 1) // bs

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past each running request's scheduled tokens: a draft model writes
        the KV of the k positions it proposes there (n-gram drafts write none)."""
        spec = self.speculative_config
        return (spec.num_speculative_tokens
                if spec and spec.method in ("draft_model", "eagle", "eagle3", "mtp") else 0)


def resolve_chat_template(value: str | None) -> str | None:
    """A chat template argument as the template's text: a path of an existing file is read;
    text with Jinja markup (`{{` or `{%`) is the template itself.

    Raises:
        ValueError: neither (naming the value), or an unreadable / empty file.
    """
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"chat_template: could not read {value}: {e}") from e
        if not text.strip():
            raise ValueError(f"chat_template: {value} is empty")
        return text
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor a Jinja template "
                     f"(no {{{{ or {{% in it)")


def create_engine_config(model: str, *, tokenizer: str | None = None, dtype: str = "auto",
                         max_model_len: int | None = None, seed: int | None = 0,
                         revision: str | None = None, trust_remote_code: bool = False,
                         logprobs_mode: str = "raw_logprobs", block_size: int = 16,
                         kv_cache_memory_bytes: int | None = None,
                         gpu_memory_utilization: float = 0.9,
                         num_gpu_blocks_override: int | None = None,
                         enable_prefix_caching: bool = True,
                         max_num_batched_tokens: int | None = None, max_num_seqs: int = 128,
                         enable_chunked_prefill: bool = True,
                         long_prefill_token_threshold: int = 0,
                         tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                         distributed_executor_backend: str | None = None,
                         nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                         master_port: int | None = None,
                         enable_expert_parallel: bool = False, enable_eplb: bool = False,
                         eplb_config: dict[str, Any] | EPLBConfig | None = None,
                         speculative_config: dict[str, Any] | SpeculativeConfig | None = None,
                         max_n: int = 128, max_logprobs: int = 20, max_logit_bias: int = 300,
                         reasoning_parser: str | None = None,
                         cudagraph_mode: str = "FULL_DECODE_ONLY", enforce_eager: bool = False,
                         cudagraph_capture_sizes: Sequence[int] | None = None,
                         quantization: str | None = None,
                         kv_cache_dtype: str = "auto", indexer_cache_dtype: str = "auto",
                         mamba_cache_mode: str = "align",
                         async_scheduling: bool | None = None,
                         num_scheduler_steps: int | None = None,
                         scheduling_policy: str = "fcfs",
                         chat_template: str | None = None,
                         generation_config: str = "auto",
                         override_generation_config: dict[str, Any] | None = None,
                         batch_invariant: bool = False,
                         enable_sleep_mode: bool = False,
                         enable_return_routed_experts: bool = False,
                         cpu_threads_bind: str = "auto",
                         cpu_reserved_cores: int | None = 0,
                         data_parallel_size_local: int = 1, data_parallel_rank_local: int = 0,
                         enable_lora: bool = False, max_loras: int = 1,
                         max_lora_rank: int = 16, max_cpu_loras: int | None = None,
                         kv_transfer_config: dict[str, Any] | KVTransferConfig | None = None,
                         kv_offloading_size: float | None = None,
                         kv_offloading_dir: str | None = None,
                         limit_mm_per_prompt: dict[str, int] | None = None,
                         max_image_pixels: int = 1 << 25,
                         max_num_encoder_input_tokens: int = 8192,
                         encoder_cache_size: int = 8192
                         ) -> EngineConfig:
    """Build and validate an `EngineConfig` from flat engine arguments (vLLM's names).

    Resolves `model` to a local folder (hub ids through the huggingface_hub cache). Raises
    `ValueError` naming the field for invalid values, `FileNotFoundError` for missing files.
    """
    from pagedllm.logger import init_logger
    from pagedllm.model_loader.hub import resolve_model_path

    init_logger()   # the engine's log lines start here (ModelConfig logs a drawn seed)
    model_config = ModelConfig(model=model, tokenizer=tokenizer, dtype=dtype,
                               max_model_len=max_model_len, seed=seed, revision=revision,
                               trust_remote_code=trust_remote_code,
                               logprobs_mode=logprobs_mode, quantization=quantization,
                               chat_template=resolve_chat_template(chat_template),
                               generation_config=generation_config,
                               override_generation_config=override_generation_config or {},
                               batch_invariant=batch_invariant,
                               enable_sleep_mode=enable_sleep_mode,
                               enable_return_routed_experts=enable_return_routed_experts)
    model_path = resolve_model_path(model, revision)
    tokenizer_path = (resolve_model_path(tokenizer, revision, "tokenizer") if tokenizer
                      else model_path)
    info = hf_model_info(model_path)
    limit, limit_name = info.max_position_embeddings, "max_position_embeddings"
    window = context_sliding_window(info.raw)
    if window is not None and window < limit:
        # NOTE(config): these layers (Phi-3's; Llama's, for a Mistral GGUF) attend over the full
        # context; past the window such a model would attend differently, so the context is
        # capped at the window (as vLLM once did with disable_sliding_window). Mistral, Qwen2/3
        # and Gemma apply their windows and are not capped (_LAYER_WINDOW_ARCHITECTURES).
        limit, limit_name = window, "sliding_window"
    eff_len = max_model_len or limit
    if max_model_len is not None and max_model_len > limit:
        raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's {limit_name} "
                         f"({limit})")
    if speculative_config is not None and not isinstance(speculative_config, SpeculativeConfig):
        speculative_config = SpeculativeConfig.from_dict(speculative_config)
    draft_path = None
    if speculative_config is not None and speculative_config.method in ("eagle", "eagle3"):
        draft_path = resolve_model_path(speculative_config.model, None,
                                        "speculative_config.model")
    if (speculative_config is not None and speculative_config.method == "mtp"
            and not info.raw.get("num_nextn_predict_layers")):
        raise ValueError(f"speculative_config method 'mtp' needs a model with MTP layers "
                         f"(num_nextn_predict_layers > 0 in config.json); {model_path} has none")
    if speculative_config is not None and speculative_config.method == "draft_model":
        draft_path = resolve_model_path(speculative_config.model, None,
                                        "speculative_config.model")
        draft_info = hf_model_info(draft_path)
        if draft_info.vocab_size != info.vocab_size:
            raise ValueError(f"draft model vocab size {draft_info.vocab_size} differs from the "
                             f"target's {info.vocab_size}; they must share a tokenizer")
    parallel_config = ParallelConfig(tensor_parallel_size=tensor_parallel_size,
                                     pipeline_parallel_size=pipeline_parallel_size,
                                     distributed_executor_backend=distributed_executor_backend,
                                     nnodes=nnodes, node_rank=node_rank,
                                     master_addr=master_addr, master_port=master_port,
                                     enable_expert_parallel=enable_expert_parallel,
                                     enable_eplb=enable_eplb,
                                     cpu_threads_bind=cpu_threads_bind,
                                     cpu_reserved_cores=cpu_reserved_cores,
                                     data_parallel_size_local=data_parallel_size_local,
                                     data_parallel_rank_local=data_parallel_rank_local,
                                     eplb_config=(EPLBConfig.from_dict(eplb_config)
                                                  if isinstance(eplb_config, dict)
                                                  else eplb_config or EPLBConfig()))
    validate_parallel_layout(info.raw, parallel_config)
    lora_config = None
    if enable_lora:
        # (imported here: lora/ sits below the folders this module's importers reach)
        from pagedllm.lora.config import (LORA_MOE_ARCHITECTURES, LoRAConfig,
                                          check_lora_architectures)
        lora_config = LoRAConfig(max_loras=max_loras, max_lora_rank=max_lora_rank,
                                 max_cpu_loras=max_cpu_loras)
        check_lora_architectures(info.architectures)
        if enable_expert_parallel and set(info.architectures) & set(LORA_MOE_ARCHITECTURES):
            raise ValueError("enable_lora: LoRA on MoE experts is not supported with "
                             "enable_expert_parallel (each rank would need its experts' "
                             "adapters, moved with them by EPLB); start without one of them")
        if batch_invariant:
            # The grouped LoRA products' shapes follow the step's batch.
            raise ValueError("enable_lora cannot be combined with batch_invariant yet")
    if max_num_batched_tokens is None:
        max_num_batched_tokens = max(2048, max_num_seqs) if enable_chunked_prefill else max(
            eff_len, max_num_seqs)
    return EngineConfig(
        model_config=model_config,
        cache_config=CacheConfig(block_size=block_size, kv_cache_memory_bytes=kv_cache_memory_bytes,
                                 gpu_memory_utilization=gpu_memory_utilization,
                                 num_gpu_blocks_override=num_gpu_blocks_override,
                                 enable_prefix_caching=enable_prefix_caching,
                                 cache_dtype=kv_cache_dtype,
                                 indexer_cache_dtype=indexer_cache_dtype,
                                 mamba_cache_mode=mamba_cache_mode),
        scheduler_config=SchedulerConfig(max_num_batched_tokens=max_num_batched_tokens,
                                         max_num_seqs=max_num_seqs,
                                         enable_chunked_prefill=enable_chunked_prefill,
                                         long_prefill_token_threshold=long_prefill_token_threshold,
                                         async_scheduling=async_scheduling,
                                         num_scheduler_steps=num_scheduler_steps,
                                         scheduling_policy=scheduling_policy),
        parallel_config=parallel_config,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        max_model_len=eff_len,
        speculative_config=speculative_config,
        draft_model_path=draft_path,
        request_limits=RequestLimits(max_n=max_n, max_logprobs=max_logprobs,
                                     max_logit_bias=max_logit_bias),
        reasoning_parser=reasoning_parser,
        cudagraph_config=CudaGraphConfig(
            cudagraph_mode=cudagraph_mode, enforce_eager=enforce_eager,
            cudagraph_capture_sizes=(None if cudagraph_capture_sizes is None
                                     else tuple(cudagraph_capture_sizes))),
        default_sampling_params=get_diff_sampling_param(model_config, model_path),
        lora_config=lora_config,
        kv_transfer_config=resolve_kv_transfer_config(kv_transfer_config, kv_offloading_size,
                                                      kv_offloading_dir,
                                                      enable_prefix_caching),
        multimodal_config=MultiModalConfig(
            limit_per_prompt=(MultiModalConfig().limit_per_prompt if limit_mm_per_prompt is None
                              else dict(limit_mm_per_prompt)),
            max_image_pixels=max_image_pixels,
            max_num_encoder_input_tokens=max_num_encoder_input_tokens,
            encoder_cache_size=encoder_cache_size),
    )


__all__ = ["ModelConfig", "CacheConfig", "SchedulerConfig", "ParallelConfig", "EngineConfig",
           "EPLBConfig", "SpeculativeConfig", "RequestLimits", "MultiModalConfig",
           "create_engine_config",
           # re-exported from the modules split out of this one
           "KVTransferConfig", "KV_ROLES", "check_offloading_size", "SPEC_METHODS"]
