"""Engine arguments on the command line (vLLM's flag names), shared by `generate`, `serve`, `bench`."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pagedllm.config import MAX_NUM_SCHEDULER_STEPS, SCHEDULING_POLICIES
from pagedllm.reasoning import REASONING_PARSERS


def bounded_int(low: int, high: int | None = None) -> Callable[[str], int]:
    """argparse type: an int in [low, high] (no upper bound when `high` is None).

    The returned function raises argparse.ArgumentTypeError with a plain message ("expected an
    integer from 0 to 65535, got '99999'"), which argparse prints after the flag's name.
    """
    wanted = f"an integer >= {low}" if high is None else f"an integer from {low} to {high}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}")
        return value

    return parse


def optional_seed(text: str) -> int | None:
    """argparse type of the engine's `--seed`: an integer from 0 to 2**63 - 1, or "None" (as
    vLLM's optional ints: no fixed seed, `ModelConfig` draws one). Raises
    argparse.ArgumentTypeError as `bounded_int`."""
    return None if text in ("None", "none") else bounded_int(0, 2**63 - 1)(text)


def bounded_float(low: float) -> Callable[[str], float]:
    """argparse type: a finite float >= `low` (raises argparse.ArgumentTypeError, "expected a
    finite number >= 0, got '-1'", which argparse prints after the flag's name)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"expected a finite number >= {low:g}, got {text!r}")
        return value

    return parse


def non_empty(text: str) -> str:
    """argparse type: a string that is not empty or blank (raises ArgumentTypeError)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def read_text_file(path: str, flag: str) -> str:
    """The UTF-8 text of the file a command-line `flag` names.

    Raises:
        ValueError: naming `flag` and `path`: no such file, a folder or another OS error, or
            bytes that are not UTF-8.
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{flag} {path} is not UTF-8 text ({e.reason} at byte {e.start})") \
            from None
    except OSError as e:
        raise ValueError(f"{flag} {path}: {e.strerror or e}") from None


def _json_object(text: str) -> dict[str, Any]:
    """argparse type: a JSON object (raises ArgumentTypeError with a plain message)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="checkpoint folder, Hugging Face hub id or .gguf file (default: the "
                        "shipped model)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer folder or hub id (default: the model's own; a .gguf file's "
                        "comes from its metadata)")
    g.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template text) to use instead of "
                        "the tokenizer's own, for --chat and chat completions")
    g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    g.add_argument("--generation-config", default="auto",
                   help="default sampling parameters of requests that leave them out: auto (the "
                        "model's generation_config.json, or a .gguf file's general.sampling.*), "
                        "vllm (the built-in defaults only) or a folder holding a "
                        "generation_config.json")
    g.add_argument("--override-generation-config", type=_json_object, default=None,
                   help='JSON generation-config values over the file\'s, e.g. '
                        '\'{"temperature": 0.5, "max_new_tokens": 128}\'')
    g.add_argument("--quantization", default=None, choices=["gguf", "none", "int8", "w8a8"],
                   help="gguf: keep a .gguf file's linear weights in their blocks (native CPU "
                        "kernels; the default where every type has one); none: dequantize; "
                        "int8: quantize a safetensors model's linear weights per channel at "
                        "load; w8a8: int8 weights and per-token int8 activations")
    g.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "int8", "fp8_e4m3", "fp8"],
                   help="KV cache dtype: auto (the model's), int8 (a scale per token and KV head) "
                        "or fp8_e4m3 (= fp8; per-tensor scales 1.0); CPU backends only for now")
    g.add_argument("--indexer-cache-dtype", default="auto",
                   choices=["auto", "int8", "fp8_e4m3", "fp8"],
                   help="DeepSeek-V3.2's DSA indexer K cache: auto (follows --kv-cache-dtype), "
                        "or int8 / fp8_e4m3 with a scale per token (the C8 cache)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens, prompt + output (default: the model's "
                        "max_position_embeddings)")
    g.add_argument("--seed", type=optional_seed, default=0,
                   help="seed of requests that give none (default 0; None: a random seed "
                        "drawn at start-up and logged)")
    g.add_argument("--block-size", type=int, default=16,
                   help="tokens per KV cache block (default 16)")
    g.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", dest="kv_cache_memory_bytes",
                   type=int, default=None, help="KV cache size in bytes")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="GPU: share of the device memory the engine may use, the KV cache "
                        "taking what the weights and activations leave (default 0.9)")
    g.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache blocks to allocate, instead of those the memory budget gives")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of equal prompt prefixes across requests (on)")
    g.add_argument("--mamba-cache-mode", choices=("align", "none"), default="align",
                   help="prefix caching of hybrid models' recurrent states: 'align' checkpoints "
                        "them at block boundaries so that prefixes hit, 'none' gives those "
                        "models no hits (default align; docs/hybrid_models.md)")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one engine step (default: chosen by the platform)")
    g.add_argument("--max-num-seqs", type=int, default=128,
                   help="most requests running at once (default 128)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=True, help="split long prompts over several steps (on)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="let transformers run code shipped with the checkpoint (config, "
                        "tokenizer)")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=1,
                   help="ranks each layer is split over (default 1)")
    g.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1,
                   help="pipeline stages the layers are split into (default 1)")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="default: uni for one process, mp (one process per rank) otherwise")
    g.add_argument("--nnodes", type=int, default=1, help="machines of a multi-node mp layout")
    g.add_argument("--node-rank", type=int, default=0, help="this machine's index (0 = engine)")
    g.add_argument("--master-addr", default=None, help="rank 0's address (default $MASTER_ADDR)")
    g.add_argument("--master-port", type=bounded_int(1, 65535), default=None,
                   help="rank 0's rendezvous port (default $MASTER_PORT)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: split experts whole over the tensor-parallel ranks")
    g.add_argument("--enable-eplb", action="store_true",
                   help="MoE: rebalance experts over the expert-parallel ranks while serving")
    g.add_argument("--eplb-config", type=_json_object, default=None,
                   help='JSON, e.g. \'{"window_size": 1000, "step_interval": 3000, '
                        '"num_redundant_experts": 2}\'')
    g.add_argument("--cpu-threads-bind", default="auto", type=non_empty,
                   help="CPU: the cores of each process on this machine: auto (tensor-parallel "
                        "ranks on disjoint cores, a NUMA node each where there are enough), "
                        "nobind, or CPU lists, one per process: 0-15|16-31 (vLLM's format)")
    g.add_argument("--cpu-reserved-cores", type=bounded_int(0), default=0, metavar="N",
                   help="CPU: physical cores kept from the kernels for the API server's threads "
                        "(serve's default: 1 where the machine allows at least 8, else 0)")
    g.add_argument("--speculative-config", type=_json_object, default=None,
                   help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\' or '
                        '\'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}\'')
    g.add_argument("--logprobs-mode", default="raw_logprobs",
                   choices=["raw_logprobs", "processed_logprobs"],
                   help="logprobs of the raw model output, or of the distribution tokens are "
                        "sampled from (after penalties, temperature, top-k/top-p)")
    g.add_argument("--max-logprobs", type=int, default=20,
                   help="most logprobs alternatives a request may ask for (-1: the vocabulary)")
    g.add_argument("--max-n", type=int, default=128,
                   help="most output sequences per prompt (a request's n)")
    g.add_argument("--max-logit-bias", type=int, default=300,
                   help="most logit_bias entries per request")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="the model's <think> format: the server returns reasoning_content apart "
                        "from content, and structured output constrains only the answer")
    g.add_argument("--cudagraph-mode", default="FULL_DECODE_ONLY",
                   choices=["NONE", "FULL_DECODE_ONLY"],
                   help="CUDA graphs for steps whose every request decodes one token (CUDA with "
                        "the triton_paged attention backend only; ignored on CPU)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (as --cudagraph-mode NONE)")
    g.add_argument("--cudagraph-capture-sizes", type=bounded_int(1), nargs="+", default=None,
                   metavar="N", help="decode batch sizes to capture, ascending (default: 1 2 4 "
                                     "8 16 24 ... up to --max-num-seqs, at most 512)")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule step N+1 while step N runs (default: on with CUDA and one "
                        "process, off on CPU)")
    g.add_argument("--num-scheduler-steps", type=bounded_int(1, MAX_NUM_SCHEDULER_STEPS),
                   default=None, metavar="N",
                   help="decode steps per scheduling round while every request decodes (the "
                        "scheduler and output processing run once per round; default: 16 for "
                        "offline generation on CPU, 1 for the server and on CUDA)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=list(SCHEDULING_POLICIES),
                   help="fcfs: arrival order; priority: each request's `priority` (lower "
                        "first, ties by arrival), preempting lower-priority running requests")
    g.add_argument("--batch-invariant", action="store_true", default=False,
                   help="outputs and logprobs bit for bit the same whatever the batch, the "
                        "chunking, prefix-cache hits or preemptions (fixed reduction orders; "
                        "slower, CPU only)")
    g.add_argument("--enable-sleep-mode", action="store_true", default=False,
                   help="allow sleep / wake_up (the dev-mode routes /sleep and /wake_up with "
                        "PAGEDLLM_SERVER_DEV_MODE=1; docs/sleep_mode.md)")
    g.add_argument("--kv-transfer-config", type=_json_object,
                   default=None, metavar="JSON",
                   help="a KV connector, vLLM's KVTransferConfig: '{\"kv_connector\": "
                        "\"OffloadingConnector\", \"kv_role\": \"kv_both\", "
                        "\"kv_connector_extra_config\": {...}}' (docs/kv_connectors.md)")
    g.add_argument("--kv-offloading-size", type=float, default=None, metavar="GiB",
                   help="a host-memory tier of this many GiB for the prefix cache (the "
                        "OffloadingConnector; docs/kv_connectors.md)")
    g.add_argument("--kv-offloading-dir", default=None, metavar="DIR",
                   help="a disk tier below the host tier (--kv-offloading-size): block files "
                        "kept across restarts (docs/kv_connectors.md)")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT format) on the base model (docs/lora.md)")
    g.add_argument("--max-loras", type=bounded_int(1), default=1,
                   help="most distinct LoRA adapters in one step")
    g.add_argument("--max-lora-rank", type=bounded_int(1), default=16,
                   help="the largest LoRA rank accepted")
    g.add_argument("--max-cpu-loras", type=bounded_int(1), default=None,
                   help="LoRA adapters kept loaded in host memory (default: --max-loras)")
    g.add_argument("--limit-mm-per-prompt", type=_json_object, default=None,
                   help='most images in one prompt of a vision-language model, as JSON: '
                        '\'{"image": 4}\' (the default)')
    g.add_argument("--max-image-pixels", type=bounded_int(1), default=1 << 25,
                   help="most pixels (width x height) of one image; larger ones are refused "
                        "before they are decoded")
    g.add_argument("--max-num-encoder-input-tokens", type=bounded_int(1), default=8192,
                   help="most image embeddings the vision encoder computes in one step")
    g.add_argument("--encoder-cache-size", type=bounded_int(1), default=8192,
                   help="most image embeddings (tokens) kept between steps")


_ENGINE_KEYS = ("tokenizer", "chat_template", "dtype", "quantization", "max_model_len", "seed",
                "block_size", "kv_cache_dtype", "indexer_cache_dtype", "mamba_cache_mode",
                "kv_cache_memory_bytes", "gpu_memory_utilization", "num_gpu_blocks_override",
                "enable_prefix_caching", "max_num_batched_tokens", "max_num_seqs",
                "enable_chunked_prefill", "trust_remote_code", "tensor_parallel_size",
                "pipeline_parallel_size", "distributed_executor_backend", "nnodes", "node_rank",
                "master_addr", "master_port", "enable_expert_parallel", "enable_eplb",
                "eplb_config", "speculative_config",
                "logprobs_mode", "max_logprobs", "max_n", "max_logit_bias", "reasoning_parser",
                "cudagraph_mode", "enforce_eager", "cudagraph_capture_sizes", "async_scheduling",
                "num_scheduler_steps", "scheduling_policy", "generation_config",
                "override_generation_config", "batch_invariant", "enable_sleep_mode",
                "cpu_threads_bind", "kv_transfer_config", "kv_offloading_size",
                "kv_offloading_dir",
                "cpu_reserved_cores", "enable_lora", "max_loras", "max_lora_rank",
                "max_cpu_loras", "limit_mm_per_prompt", "max_image_pixels",
                "max_num_encoder_input_tokens", "encoder_cache_size")


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for `LLM(...)` / `LLMEngine.from_engine_args(...)` (model included)."""
    kwargs = {k: getattr(args, k) for k in _ENGINE_KEYS}
    if args.model is None:
        from pagedllm.assets import default_model_path
        kwargs["model"] = default_model_path()
    else:
        kwargs["model"] = args.model
    return kwargs
