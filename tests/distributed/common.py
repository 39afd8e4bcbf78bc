"""Shared prompts, engine arguments and a run helper of the distributed tests."""

from __future__ import annotations

from pathlib import Path

from pagedllm import LLM, SamplingParams

PROMPTS = ["Hello world, this is", "The quick brown fox jumps over", "a b c d e f g h i j k l m"]
# max_num_batched_tokens=16 chunks the prompts, so chunked prefill runs under TP/PP too.
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory_bytes=1 << 21, max_num_batched_tokens=16,
                   enable_prefix_caching=False)


def generate(llm: LLM, params: SamplingParams) -> list[list[int]]:
    """Token ids of each prompt of PROMPTS."""
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def run(path: Path | str, params_list: list[SamplingParams], **parallel) -> list[list[list[int]]]:
    """Start an engine with ENGINE_ARGS + `parallel`, generate once per params, shut it down."""
    llm = LLM(str(path), **ENGINE_ARGS, **parallel)
    try:
        return [generate(llm, p) for p in params_list]
    finally:
        llm.llm_engine.engine_core.shutdown()
