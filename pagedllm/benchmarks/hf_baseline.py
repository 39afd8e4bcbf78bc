"""The same workload through Hugging Face `transformers` `generate`, in static batches.

Batches of `batch_size` requests in workload order, left-padded with an attention mask, greedy,
`min_new_tokens = max_new_tokens` = the batch's longest output (EOS cannot stop early). With
random output lengths a batch generates up to its longest request; only each request's own
`output_len` tokens are counted, the rest is static batching's waste (as in vLLM's HF baseline).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from pagedllm.benchmarks.report import PeakRSSMonitor
from pagedllm.benchmarks.throughput import throughput_figures, warmup_prompt
from pagedllm.benchmarks.workload import BenchRequest


def load_hf_model(model_path: str, dtype: torch.dtype):
    """The HF model in `dtype` on the engine's device (`current_platform`), so the baseline runs
    where the engine does."""
    from transformers import AutoModelForCausalLM

    from pagedllm.platforms import current_platform

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    return model.to(current_platform.device).eval()


def pad_token_id(model) -> int:
    """The id HF `generate` pads with: the generation config's pad id, else its (first) EOS
    id, else the same two of the model config, else 0."""
    for source in (model.generation_config, model.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return 0


@torch.inference_mode()
def hf_generate_batch(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy-generate exactly `max_new_tokens` tokens for each (left-padded) prompt."""
    pad_id = pad_token_id(model)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    out = model.generate(input_ids=input_ids.to(model.device),
                         attention_mask=attention_mask.to(model.device), do_sample=False,
                         max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                         pad_token_id=pad_id, num_beams=1)
    return out[:, width:].tolist()


def run_hf_throughput(model_path: str, requests: list[BenchRequest], dtype: torch.dtype,
                      batch_size: int, warmup: bool = True,
                      before_timing: Callable[[], None] | None = None
                      ) -> tuple[dict[str, Any], list[list[int]]]:
    """Returns (figures as `run_throughput`'s, output token ids per request); `before_timing`
    is called after the model is loaded and warm, just before the timed run."""
    with PeakRSSMonitor() as mem:
        model = load_hf_model(model_path, dtype)
        if warmup:
            hf_generate_batch(model, [warmup_prompt(requests)], 4)
        if before_timing is not None:
            before_timing()
        outputs: list[list[int]] = []
        generated = 0
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            max_new = max(r.output_len for r in batch)
            tokens = hf_generate_batch(model, [r.prompt_token_ids for r in batch], max_new)
            generated += sum(len(t) for t in tokens)
            outputs.extend(t[:r.output_len] for r, t in zip(batch, tokens))
        elapsed = time.perf_counter() - start
    figures = throughput_figures("hf", requests, outputs, elapsed, mem.peak_bytes)
    figures["batch_size"] = batch_size
    figures["num_generated_tokens_incl_padding"] = generated
    del model
    return figures, outputs
