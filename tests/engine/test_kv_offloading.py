"""The OffloadingConnector end to end on a tiny Llama: 12 distinct 64-token prefixes against a
device cache of 23 blocks (368 tokens) do not fit, so their second use hits the host tier;
greedy and seeded tokens equal those of an engine without the tier, the hits show as cached
tokens and in /metrics, sleep keeps the tier and a weight update forgets it (its KV belongs
to the old weights). With a disk tier below a small host tier, evicted prefixes come back from disk, a
restarted engine hits the files of the old one, and bad files are misses."""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.kv_cache_utils import NONE_HASH, hash_block_tokens
from pagedllm.core.kv_connector.disk_tier import block_file, encode_block_file
from tests.fixtures.checkpoints import make_tiny_checkpoint
from pagedllm.engine.async_llm import IterationStats
from pagedllm.entrypoints.openai.metrics import PrometheusStatLogger

RNG = random.Random(0)
PREFIXES = [[RNG.randrange(3, 500) for _ in range(64)] for _ in range(12)]
FIRST = [p + [RNG.randrange(3, 500) for _ in range(5)] for p in PREFIXES]
SECOND = [p + [RNG.randrange(3, 500) for _ in range(5)] for p in PREFIXES]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=11, max_tokens=4, ignore_eos=True)]
ENGINE = dict(dtype="float32", num_gpu_blocks_override=24, block_size=16, max_num_seqs=2)


def _run(llm: LLM) -> tuple[list, list[int]]:
    """Tokens of both rounds under both params, and the second round's cached tokens."""
    tokens, cached = [], []
    for params in PARAMS:
        for prompts in (FIRST, SECOND):
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
            if prompts is SECOND:
                cached += [o.num_cached_tokens for o in outs]
    return tokens, cached


@pytest.fixture(scope="module")
def without_tier(tiny_llama):
    return _run(LLM(str(tiny_llama), **ENGINE))


def test_tier_hits_and_same_tokens(tiny_llama, without_tier):
    want, cached_without = without_tier
    assert cached_without == [0] * 24   # the device cache alone keeps none of the prefixes
    llm = LLM(str(tiny_llama), **ENGINE, kv_offloading_size=0.01, enable_sleep_mode=True)
    got, cached = _run(llm)
    assert got == want
    assert cached == [64] * 24
    connector = llm.llm_engine.engine_core.scheduler.kv_connector
    stats = connector.stats()
    assert stats.loaded_blocks >= 24 * 4 and stats.stored_blocks > 0

    # /metrics counts the tier's traffic (in blocks).
    metrics = PrometheusStatLogger("tiny")
    metrics.record(llm.get_stats(), IterationStats())
    text = metrics.render().decode()
    assert f'pagedllm:kv_offload_loaded_blocks_total{{model_name="tiny"}} ' \
           f'{float(stats.loaded_blocks)}' in text
    assert "pagedllm:kv_offload_hits_total" in text

    # Sleep empties the device cache but keeps the tier (the same weights come back).
    llm.sleep(level=1)
    llm.wake_up()
    outs = llm.generate(SECOND, PARAMS[0], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want[1]
    assert [o.num_cached_tokens for o in outs] == [64] * 12

    llm.update_weights(str(tiny_llama))   # (the same weights: what counts is the reset)
    assert connector.num_tier_blocks_used == 0


def test_tier_config_errors(tiny_llama):
    with pytest.raises(ValueError, match="needs enable_prefix_caching"):
        LLM(str(tiny_llama), **ENGINE, kv_offloading_size=0.01, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="unknown kv_connector"):
        LLM(str(tiny_llama), **ENGINE, kv_transfer_config={"kv_connector": "Mooncake"})
    with pytest.raises(ValueError, match="kv_offloading_size must be"):
        LLM(str(tiny_llama), **ENGINE, kv_transfer_config={
            "kv_connector": "OffloadingConnector"})


def test_disk_tier_survives_restart_and_refuses_bad_files(tiny_llama, without_tier, tmp_path):
    """A host tier of ~13 blocks over a disk tier: the prefixes the host tier evicted come back
    from disk; a new engine on the same folder hits the files of the old one; a corrupt, a
    truncated and a foreign (another model's layout) file are misses, the tokens unchanged."""
    want, _ = without_tier
    tier = dict(kv_offloading_size=0.0001, kv_offloading_dir=str(tmp_path / "kv"))
    llm = LLM(str(tiny_llama), **ENGINE, **tier)
    got, cached = _run(llm)
    assert got == want and cached == [64] * 24
    assert llm.llm_engine.engine_core.scheduler.kv_connector.stats().disk_loaded_blocks > 0
    llm.llm_engine.engine_core.shutdown()
    del llm

    files = sorted((tmp_path / "kv").glob("*.r0.kv"))
    assert len(files) >= 12 * 4
    assert _second_round(tiny_llama, tier) == (want[1], [64] * 12)   # every prefix from disk

    # The first block of prefixes 0, 1, 2: one byte flipped, truncated, another layout.
    first_blocks = [_first_block_hash(p) for p in PREFIXES[:3]]
    paths = [block_file(tmp_path / "kv", h, 0) for h in first_blocks]
    data = bytearray(paths[0].read_bytes())
    data[-1] ^= 0xFF
    paths[0].write_bytes(bytes(data))
    paths[1].write_bytes(paths[1].read_bytes()[:-10])
    paths[2].write_bytes(encode_block_file(first_blocks[2], "another model", b"\0" * 8192))
    # Prefix 0's second block too: indexed at start-up, behind the first bad one, so not
    # checked by the lookup; storing the recomputed block must replace it all the same.
    second_block = hash_block_tokens(first_blocks[0], PREFIXES[0][16:32])
    block_file(tmp_path / "kv", second_block, 0).write_bytes(b"garbage")
    assert _second_round(tiny_llama, tier) == (want[1], [0, 0, 0] + [64] * 9)
    assert _second_round(tiny_llama, tier) == (want[1], [64] * 12)   # all written anew


def _second_round(path, tier: dict) -> tuple[list, list[int]]:
    """A new engine's greedy tokens and cached tokens of SECOND."""
    llm = LLM(str(path), **ENGINE, **tier)
    try:
        outs = llm.generate(SECOND, PARAMS[0], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], [o.num_cached_tokens for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def _first_block_hash(tokens: list[int]) -> bytes:
    return hash_block_tokens(NONE_HASH, tokens[:16])


@pytest.mark.slow
def test_tp2_tier_same_tokens(tiny_llama, without_tier, tmp_path):
    """tp=2 (mp workers): each rank keeps its shard's host tier and disk files, the scheduler
    side one index; the tokens equal the single-process engine's without a tier."""
    want, _ = without_tier
    llm = LLM(str(tiny_llama), **ENGINE, kv_offloading_size=0.0001,
              kv_offloading_dir=str(tmp_path / "kv"), tensor_parallel_size=2,
              distributed_executor_backend="mp")
    try:
        got, cached = _run(llm)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert got == want and cached == [64] * 24
    assert {p.name.split(".")[1] for p in (tmp_path / "kv").iterdir()} == {"r0", "r1"}


def test_disk_files_of_updated_weights_never_match_the_base(tiny_llama, without_tier, tmp_path):
    """Blocks stored after a weight update carry the new checkpoint's fingerprint: an engine of
    the original checkpoint on the same folder recomputes them rather than load them."""
    want, _ = without_tier
    other = make_tiny_checkpoint(tmp_path / "seed1", "LlamaForCausalLM", tiny_llama, seed=1)
    tier = dict(kv_offloading_size=0.0001, kv_offloading_dir=str(tmp_path / "kv"))
    llm = LLM(str(tiny_llama), **ENGINE, **tier)
    llm.update_weights(str(other))
    llm.generate(FIRST, PARAMS[0], use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()
    del llm
    assert len(list((tmp_path / "kv").glob("*.kv"))) >= 12 * 4
    assert _second_round(tiny_llama, tier) == (want[1], [0] * 12)


class _RecordingConnector:
    """A worker connector that records the per-layer calls it gets, then passes them on."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.calls: list[tuple[str, str]] = []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.calls.append(("wait", layer_name))
        self.inner.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name, kv_layer) -> None:
        self.calls.append(("save", layer_name))
        self.inner.save_kv_layer(layer_name, kv_layer)


def _tier(asynchronous: bool, size: float = 0.01) -> dict:
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"kv_offloading_size": size,
                                          "async_transfers": asynchronous}}


@pytest.mark.parametrize("fused", ["0", "1"])
def test_async_transfers_per_layer_and_same_tokens(tiny_llama, without_tier, monkeypatch,
                                                   fused):
    """Asynchronous transfers: on the module path each attention layer waits for its own
    loads and hands its saves over right after (wait 0, save 0, wait 1, ...); the fused
    decoder's one native call waits for every layer first (run with synchronous transfers,
    `async_transfers: false`). Greedy and seeded tokens equal the engine's without a tier."""
    monkeypatch.setenv("PAGEDLLM_CPU_FUSED_DECODER", fused)
    want, _ = without_tier
    llm = LLM(str(tiny_llama), **ENGINE, kv_transfer_config=_tier(fused == "1"))
    worker = llm.llm_engine.engine_core.executor.worker
    recorder = worker.kv_connector = _RecordingConnector(worker.kv_connector)
    got, cached = _run(llm)
    assert got == want and cached == [64] * 24
    layers = list(worker.model_runner.kv_caches_by_layer())
    step = recorder.calls[:2 * len(layers)]   # (every step calls each layer's seams once)
    if fused == "0":
        assert step == [(kind, name) for name in layers for kind in ("wait", "save")]
    else:
        assert step[:len(layers)] == [("wait", name) for name in layers]
    assert len(recorder.calls) % (2 * len(layers)) == 0


def test_async_tier_with_chunked_prefill_and_preemption(tiny_llama, without_tier):
    """32-token chunks and 4 sequences in an 8-block device cache (requests are preempted and
    recomputed, their tier loads redone): the tokens do not change."""
    want, _ = without_tier
    engine = dict(ENGINE, num_gpu_blocks_override=8, max_num_seqs=4,
                  max_num_batched_tokens=32)
    llm = LLM(str(tiny_llama), **engine, kv_offloading_size=0.01)
    got, cached = _run(llm)
    assert got == want
    assert sum(cached) > 0
    assert llm.get_stats().num_preemptions > 0


def test_abort_while_loads_are_in_flight(tiny_llama, without_tier):
    """With async scheduling the next step is scheduled while the current one (and its tier
    loads) runs; requests aborted then, loaded or still waiting, end without a hang and the
    others' tokens do not change."""
    want, _ = without_tier
    llm = LLM(str(tiny_llama), **ENGINE, kv_offloading_size=0.01, async_scheduling=True)
    llm.generate(FIRST, PARAMS[0], use_tqdm=False)   # (every prefix is in the tier)
    engine = llm.llm_engine
    for i, prompt in enumerate(SECOND[:4]):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, PARAMS[0])
    engine.step()
    engine.abort_request(["r0", "r2"])
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    assert done == {"r1": want[1][1], "r3": want[1][3]}
    outs = llm.generate(SECOND, PARAMS[0], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want[1]
    assert [o.num_cached_tokens for o in outs] == [64] * 12
