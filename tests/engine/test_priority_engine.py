"""Priority scheduling through the engine: time to first token counted in engine steps (so the
test does not depend on the machine's speed), greedy outputs equal to fcfs, and the fcfs rule."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import GenerateError

ENGINE = {"dtype": "float32", "kv_cache_memory_bytes": 16_000_000, "seed": 0, "max_num_seqs": 4,
          "num_scheduler_steps": 1}
LOW = [f"background job {i}: the quick brown fox" for i in range(8)]
HIGH = [f"urgent question {i}?" for i in range(4)]


def test_high_priority_first_tokens_come_early_under_low_priority_load(tiny_llama: Path) -> None:
    engine = LLMEngine.from_engine_args(str(tiny_llama), scheduling_policy="priority", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for i, prompt in enumerate(LOW):
        engine.add_request(f"low{i}", prompt, params, priority=10)
    added_at: dict[str, int] = {f"low{i}": 0 for i in range(len(LOW))}
    first_token_at: dict[str, int] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 3:
            for i, prompt in enumerate(HIGH):
                engine.add_request(f"high{i}", prompt, params, priority=0)
                added_at[f"high{i}"] = steps
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token_at.setdefault(out.request_id, steps)
        steps += 1
    waited = {req_id: first_token_at[req_id] - added_at[req_id] for req_id in added_at}
    high = statistics.median(waited[f"high{i}"] for i in range(len(HIGH)))
    low = statistics.median(waited[f"low{i}"] for i in range(len(LOW)))
    assert high * 3 <= low, waited


def test_priority_does_not_change_greedy_outputs(tiny_llama: Path) -> None:
    prompts = LOW[:6]
    params = SamplingParams(temperature=0, max_tokens=24)
    fcfs = LLM(str(tiny_llama), **ENGINE)
    expected = [o.outputs[0].token_ids for o in fcfs.generate(prompts, params, use_tqdm=False)]
    with pytest.raises(GenerateError, match="priority 1 needs the priority scheduling policy"):
        fcfs.generate(prompts[:1], params, use_tqdm=False, priority=[1])
    del fcfs
    llm = LLM(str(tiny_llama), scheduling_policy="priority", **ENGINE)
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=[5, -1, 3, 0, 9, 2])
    assert [o.outputs[0].token_ids for o in outputs] == expected
    with pytest.raises(ValueError, match="priorities"):
        llm.generate(prompts, params, priority=[0])
