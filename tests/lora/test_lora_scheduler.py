"""The scheduler's LoRA budget: never more than max_loras distinct adapters in one step, base
requests never held back, the others scheduled once a slot frees; adapter requests take
multi-step rounds."""

from __future__ import annotations

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.lora.request import LoRARequest
from pagedllm.sampling_params import SamplingParams


def _scheduler(max_loras: int, num_scheduler_steps: int = 1) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16),
                     CacheConfig(block_size=4, enable_prefix_caching=False), max_model_len=128,
                     num_blocks=128, num_scheduler_steps=num_scheduler_steps, max_loras=max_loras)


def _add(sched: Scheduler, req_id: str, lora_id: int | None, max_tokens: int = 3) -> None:
    lora = None if lora_id is None else LoRARequest(f"a{lora_id}", lora_id, f"/a{lora_id}")
    sched.add_request(Request(req_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens),
                              max_tokens, lora_request=lora))


def _step(sched: Scheduler) -> tuple[set[str], set[int]]:
    """One step whose every sampled row gets token 7; returns its requests and adapters."""
    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    loras = {sched.requests[r].lora_request.lora_int_id for r in req_ids
             if sched.requests[r].lora_request is not None}
    sched.update_from_output(out, ModelRunnerOutput(
        req_ids, {r: i for i, r in enumerate(req_ids)}, [[7] * out.num_steps for _ in req_ids]))
    return set(req_ids), loras


def test_at_most_max_loras_adapters_per_step():
    sched = _scheduler(max_loras=2)
    for i, lora_id in enumerate([1, None, 2, 3, 1, None, 3, 2]):
        _add(sched, f"r{i}", lora_id)
    seen: set[str] = set()
    first = True
    while sched.has_unfinished_requests():
        req_ids, loras = _step(sched)
        assert len(loras) <= 2
        if first:
            # Adapters 1 and 2 fill the budget; both base requests still run.
            assert req_ids == {"r0", "r1", "r2", "r4", "r5", "r7"}
            first = False
        seen |= req_ids
    assert seen == {f"r{i}" for i in range(8)}


def test_adapter_requests_take_multi_step_rounds_within_the_budget():
    sched = _scheduler(max_loras=1, num_scheduler_steps=4)
    _add(sched, "base", None, max_tokens=9)
    _add(sched, "lora", 1, max_tokens=9)
    assert _step(sched) == ({"base", "lora"}, {1})
    out = sched.schedule()
    assert out.num_steps == 4 and set(out.num_scheduled_tokens) == {"base", "lora"}
