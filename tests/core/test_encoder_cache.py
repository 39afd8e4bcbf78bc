"""The scheduler's encoder budget and encoder cache (core/encoder_cache_manager.py), from plain
configs and fake image features: an image is encoded once while it stays cached (chunks, n
children, preemption), a chunk stops before an image the step cannot encode, eviction is LRU
among unreferenced images and is reported to the worker, and block hashes cover image
identifiers."""

from __future__ import annotations

import numpy as np

from pagedllm.config import CacheConfig, SchedulerConfig
from pagedllm.core.kv_cache_utils import get_request_block_hasher
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4


def feature(identifier: str, offset: int, length: int) -> MultiModalFeature:
    """An image over [offset, offset + length) whose first and last tokens are separators."""
    is_embed = np.ones(length, dtype=bool)
    is_embed[[0, -1]] = False
    return MultiModalFeature("image", identifier, offset, length, is_embed, {})


def make_scheduler(budget: int = 64, encoder_budget: int = 16, cache: int = 32,
                   num_blocks: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=8),
                     CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True),
                     max_model_len=256, num_blocks=num_blocks,
                     max_num_encoder_input_tokens=encoder_budget, encoder_cache_size=cache)


def add(sched: Scheduler, req_id: str, features: list[MultiModalFeature], num_tokens: int = 40,
        max_tokens: int = 2, first_token: int = 1) -> Request:
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    req = Request(req_id, list(range(first_token, first_token + num_tokens)), sp, max_tokens,
                  get_request_block_hasher(BLOCK_SIZE), mm_features=features)
    sched.add_request(req)
    return req


def finish_step(sched: Scheduler, out: SchedulerOutput) -> None:
    """Feed back one sampled token for each request whose prompt is done."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
               else [] for r in req_ids]
    sched.update_from_output(out, ModelRunnerOutput(req_ids, {r: i for i, r in
                                                              enumerate(req_ids)}, sampled))


def test_chunks_inside_an_image_encode_it_once():
    sched = make_scheduler(budget=8)
    add(sched, "a", [feature("img", 4, 14)])     # 12 embeddings over tokens 4..17
    encoded = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        encoded += [(r, i) for r, ids in out.scheduled_encoder_inputs.items() for i in ids]
        finish_step(sched, out)
    assert encoded == [("a", 0)]
    assert sched.make_stats().num_encoder_runs == 1


def test_budget_cuts_the_chunk_before_an_image():
    sched = make_scheduler(encoder_budget=12)
    add(sched, "a", [feature("x", 4, 14)])
    add(sched, "b", [feature("y", 6, 14)], first_token=50)   # no prefix shared with a
    out = sched.schedule()
    # a's image takes the whole encoder budget: b stops just before its own image.
    assert out.scheduled_encoder_inputs == {"a": [0]}
    assert out.num_scheduled_tokens["b"] == 6
    finish_step(sched, out)
    out = sched.schedule()
    assert out.scheduled_encoder_inputs == {"b": [0]}


def test_same_image_shared_by_requests_and_after_preemption():
    sched = make_scheduler()
    add(sched, "0_p", [feature("img", 4, 14)])
    add(sched, "1_p", [feature("img", 4, 14)])
    out = sched.schedule()
    assert out.scheduled_encoder_inputs == {"0_p": [0]}
    finish_step(sched, out)
    # Preempted, then back: its image is still cached (unreferenced entries stay).
    request = sched.requests["1_p"]
    sched._preempt(request, SchedulerOutput.make_empty())
    out = sched.schedule()
    assert out.num_scheduled_tokens.get("1_p") and not out.scheduled_encoder_inputs
    assert sched.make_stats().num_encoder_runs == 1


def test_eviction_is_lru_among_unreferenced_images_and_reported():
    sched = make_scheduler(cache=24, encoder_budget=24)
    for i, name in enumerate(("a", "b")):
        add(sched, name, [feature(name, 2, 14)], max_tokens=1)
        out = sched.schedule()
        finish_step(sched, out)
        assert not sched.has_unfinished_requests()
    assert set(sched.encoder_cache_manager.freeable) == {"a", "b"}
    add(sched, "c", [feature("c", 2, 14)], max_tokens=1)
    out = sched.schedule()
    assert out.scheduled_encoder_inputs == {"c": [0]}
    assert out.free_encoder_mm_hashes == ["a"]       # the older one, only as much as needed


def test_block_hashes_cover_image_identifiers():
    hasher = get_request_block_hasher(BLOCK_SIZE)
    sp = SamplingParams(max_tokens=1)
    tokens = list(range(1, 21))
    a = Request("a", tokens, sp, 1, hasher, mm_features=[feature("A", 8, 6)])
    b = Request("b", tokens, sp, 1, hasher, mm_features=[feature("B", 8, 6)])
    c = Request("c", tokens, sp, 1, hasher, mm_features=[feature("A", 8, 6)])
    # Blocks 0-1 (tokens 0..7) are text only: shared; from block 2 (the image) on: not.
    assert a.block_hashes[:2] == b.block_hashes[:2]
    assert all(x != y for x, y in zip(a.block_hashes[2:], b.block_hashes[2:]))
    assert a.block_hashes == c.block_hashes


def test_encoder_budget_is_spent_only_by_a_scheduled_request():
    # A request looked at but then skipped (its LoRA adapter does not fit the step, or it gets
    # no KV blocks) must leave the step's encoder budget to the requests after it.
    sched = make_scheduler(encoder_budget=12)
    req = add(sched, "a", [feature("x", 4, 14)])
    n, to_encode = sched._encoder_inputs(req, 0, 40)
    assert (n, to_encode) == (40, [0])
    assert sched._encoder_budget == 12
    sched._commit_encoder_inputs(req, to_encode, SchedulerOutput.make_empty())
    assert sched._encoder_budget == 0
