"""Sleep mode and in-place weight updates (engine/sleep_mode.py, worker/sleep_mode.py) on one tiny
Llama engine: sleep frees the KV cache (level 1) or the KV cache and the weights (level 2),
requests are refused while asleep, wake-up gives the same greedy tokens; an update to another
checkpoint's weights gives HF's tokens of that checkpoint, one with other shapes is refused and
the old weights keep serving."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedllm import LLM, SamplingParams
from pagedllm.engine.sleep_mode import EngineSleepingError
from pagedllm.worker.sleep_mode import model_tensors, tensor_bytes
from tests.fixtures.checkpoints import make_tiny_checkpoint

PROMPTS = [[5, 17, 99, 42, 7, 3, 61], [200, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def _hf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return [hf.generate(torch.tensor([p]), max_new_tokens=PARAMS.max_tokens, do_sample=False,
                        eos_token_id=None, pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def _tokens(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama):
    """(the engine's checkpoint, another seed's of the same shapes, one of other shapes)."""
    root = tmp_path_factory.mktemp("sleep_mode")
    tokenizer = tiny_llama   # (its tokenizer files are copied)
    other = make_tiny_checkpoint(root / "seed1", "LlamaForCausalLM", tokenizer, seed=1)
    wider = make_tiny_checkpoint(root / "wide", "LlamaForCausalLM", tokenizer, seed=2,
                                 intermediate_size=96)
    return tiny_llama, other, wider


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints[0]), dtype="float32", kv_cache_memory_bytes=4 << 20,
               max_num_seqs=4, enable_sleep_mode=True)


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def test_sleep_frees_and_wake_up_restores(llm):
    want = _tokens(llm)
    runner = _runner(llm)
    kv_bytes = sum(c.numel() for c in runner.kv_caches)
    assert kv_bytes > 0

    llm.sleep(level=1)
    assert llm.is_sleeping()
    assert runner.kv_caches == []
    assert all(a.kv_cache.numel() == 0 for a in runner.model.attention_layers())
    with pytest.raises(EngineSleepingError, match="asleep"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert sum(c.numel() for c in runner.kv_caches) == kv_bytes
    assert _tokens(llm) == want

    llm.sleep(level=2)
    tensors = model_tensors(runner.model)
    assert tensors and all(t.numel() == 0 for t in tensors.values())
    llm.wake_up()
    assert all(t.numel() > 0 for t in model_tensors(runner.model).values())
    assert _tokens(llm) == want
    # (twice: the second round takes the native decode loop rebuilt over the new weights)
    assert _tokens(llm) == want


def test_sleep_refusals(llm, checkpoints):
    with pytest.raises(ValueError, match="sleep level must be 1 or 2"):
        llm.sleep(level=3)
    plain = LLM(str(checkpoints[0]), dtype="float32", kv_cache_memory_bytes=1 << 20)
    with pytest.raises(ValueError, match="enable_sleep_mode"):
        plain.sleep()


def test_update_weights_serves_the_new_checkpoint(llm, checkpoints):
    base, other, wider = checkpoints
    want_base = _tokens(llm)
    want_other = _hf_greedy(other, PROMPTS)
    assert want_other != want_base   # (else the test could not fail)

    llm.update_weights(str(other))
    assert _tokens(llm) == want_other

    with pytest.raises(ValueError, match="do not fit the serving model.*intermediate|mlp"):
        llm.update_weights(str(wider))
    assert _tokens(llm) == want_other   # the refused update changed nothing
    with pytest.raises(ValueError, match="model folder not found: .*missing"):
        llm.update_weights(str(wider / "missing"))

    # Level 2 reloads the checkpoint last loaded: the update's.
    llm.sleep(level=2)
    llm.wake_up()
    assert _tokens(llm) == want_other

    llm.collective_rpc("stage_weights", (str(base),))
    llm.collective_rpc("commit_weights")
    llm.reset_prefix_cache()
    assert _tokens(llm) == want_base
    with pytest.raises(ValueError, match="not a public Worker method"):
        llm.collective_rpc("_free")
    with pytest.raises(ValueError, match="call the engine's own method"):
        llm.collective_rpc("sleep", (1,))


@pytest.mark.slow
def test_tp2_update_weights_and_sleep(checkpoints):
    """Every rank of a tp=2 engine (mp workers) loads its shard of the update; a refused update
    leaves both ranks serving the old weights; level 2 reloads each rank's shard."""
    base, other, wider = checkpoints
    want_base = _hf_greedy(base, PROMPTS)
    want_other = _hf_greedy(other, PROMPTS)
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=1 << 21, enable_sleep_mode=True,
              tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        assert _tokens(llm) == want_base
        llm.update_weights(str(other))
        assert _tokens(llm) == want_other
        with pytest.raises(ValueError, match="do not fit"):
            llm.update_weights(str(wider))
        assert _tokens(llm) == want_other
        llm.sleep(level=2)
        llm.wake_up()
        assert _tokens(llm) == want_other
    finally:
        llm.llm_engine.engine_core.shutdown()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc (Linux)")
def test_sleep_level2_frees_resident_memory(tmp_path, tiny_llama):
    """Sleep level 2 hands >= 90% of what it frees (weights + KV cache, ~0.5 GiB here) back to
    the system: the process's resident set shrinks by that much; wake-up restores the tokens."""
    path = make_tiny_checkpoint(tmp_path / "big", "LlamaForCausalLM", tiny_llama,
                                hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
                                num_attention_heads=8, num_key_value_heads=8,
                                initializer_range=0.02)
    llm = LLM(str(path), dtype="float32", kv_cache_memory_bytes=256 << 20, max_num_seqs=4,
              enable_sleep_mode=True)
    want = _tokens(llm)
    engine = llm.llm_engine.engine_core
    runner = engine.executor.worker.model_runner
    freeable = (sum(c.numel() * c.element_size() for c in runner.kv_caches)
                + tensor_bytes(model_tensors(runner.model)))
    # (touch every KV page, so the cache is resident, as on a busy server)
    for cache in runner.kv_caches:
        cache.fill_(0)
    gc.collect()
    before = _rss_bytes()
    llm.sleep(level=2)
    gc.collect()
    after = _rss_bytes()
    print(f"RSS {before / 2**20:.0f} -> {after / 2**20:.0f} MiB; freeable "
          f"{freeable / 2**20:.0f} MiB; freed {(before - after) / freeable:.1%}")
    assert before - after >= 0.9 * freeable
    llm.wake_up()
    assert _tokens(llm) == want
