"""The native greedy decode loop (native/decode_loop.py, csrc/cpu_decode_loop.cpp).

Oracle: the same engine with one step per round. A multi-step round's later steps run in the
native loop where it applies; greedy tokens, finish reasons and texts must equal single steps
for every embedding / LM head storage it takes: plain float rows with a packed head (fp32 and
bf16), a tied packed weight, GGUF blocks (Q8_0 and Q4_0, 8-bit activations on and off, a Q4_K_M
mix with a tied Q6_K embedding), and across stop tokens and batches whose requests stop at
different steps. Where it does not apply (a sliding window shorter than the sequence,
sampling that is not plain greedy) the rounds run step by step, with the same results.
"""

from __future__ import annotations

import random

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.native.kernels import cpu_kernels
from pagedllm.layers.quantization.gguf import Q8_ACTIVATIONS_ENV
from pagedllm.native.decode_loop import GreedyDecodeLoop
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_files import write_gguf
from tests.fixtures.runner_steps import count_loop_tokens

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="needs the native CPU kernels")


@pytest.fixture(autouse=True)
def gguf_view_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_GGUF_CACHE", str(tmp_path / "gguf_views"))


@pytest.fixture
def loop_calls(monkeypatch):
    """Counts the requests decoded by `GreedyDecodeLoop.run` (steps x requests)."""
    return count_loop_tokens(monkeypatch, GreedyDecodeLoop)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


def results(outputs) -> list[tuple]:
    return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason, o.outputs[0].text)
            for o in outputs]


def compare(model: str, prompts, params, **kwargs) -> list[tuple]:
    """Generate with rounds of 8 and with single steps; assert equal; return the results."""
    common = dict(block_size=8, num_gpu_blocks_override=96, max_num_seqs=8, **kwargs)
    got = LLM(model, num_scheduler_steps=8, **common).generate(prompts, params, use_tqdm=False)
    want = LLM(model, num_scheduler_steps=1, **common).generate(prompts, params, use_tqdm=False)
    assert results(got) == results(want)
    return results(got)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(4, 30))] for _ in range(n)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("variant", ["llama", "llama_mqa_tied_llama3"])
def test_float_weights(tiny_checkpoints, loop_calls, variant, dtype):
    prompts = _prompts(1, 4)
    compare(str(tiny_checkpoints[variant]), prompts, [greedy(20)] * 4, dtype=dtype)
    assert loop_calls["tokens"] > 0


@pytest.mark.parametrize("tensor_type,q8", [("Q8_0", True), ("Q4_0", True), ("Q4_0", False)])
def test_gguf_weights(tiny_checkpoints, tmp_path, loop_calls, monkeypatch, tensor_type, q8):
    monkeypatch.setenv(Q8_ACTIVATIONS_ENV, "1" if q8 else "0")
    path = write_gguf(tiny_checkpoints["llama"], tmp_path / f"{tensor_type}.gguf", tensor_type)
    compare(str(path), _prompts(2, 3), [greedy(18)] * 3, dtype="float32")
    assert loop_calls["tokens"] > 0


def test_gguf_k_quants_tied(byte_level_tokenizer_dir, tmp_path, loop_calls):
    checkpoint = make_tiny_checkpoint(tmp_path / "llama256", "LlamaForCausalLM",
                                      byte_level_tokenizer_dir, hidden_size=256,
                                      intermediate_size=512, tie_word_embeddings=True)
    path = write_gguf(checkpoint, tmp_path / "q4_k_m.gguf", "Q4_K",
                      tensor_types={"attn_v": "Q6_K", "ffn_down": "Q6_K", "token_embd": "Q6_K"})
    compare(str(path), _prompts(3, 2), [greedy(16)] * 2, dtype="bfloat16")
    assert loop_calls["tokens"] > 0


def test_stops_inside_the_loop(tiny_checkpoints, loop_calls):
    """Requests of one batch stop at different steps of a round (stop tokens, max_tokens): the
    loop ends the round there, and the others go on in the next."""
    model = str(tiny_checkpoints["llama"])
    prompts = _prompts(4, 5)
    free = LLM(model, dtype="float32", num_scheduler_steps=1).generate(
        prompts, greedy(24), use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in free]
    params = [greedy(24, stop_token_ids=[tokens[0][4]]),
              greedy(24, stop_token_ids=[tokens[1][10]]),
              greedy(24, stop_token_ids=[tokens[2][14]]),
              greedy(13),
              SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[tokens[4][6]])]
    got = compare(model, prompts, params, dtype="float32")
    assert [r[1] for r in got] == ["stop", "stop", "stop", "length", "stop"]
    assert len(got[0][0]) == 5 and len(got[3][0]) == 13
    assert loop_calls["tokens"] > 0
    # One request alone: the loop ends at its stop token.
    alone = compare(model, prompts[:1], params[:1], dtype="float32")
    assert len(alone[0][0]) == 5


def test_falls_back_where_it_does_not_apply(tiny_checkpoints, loop_calls):
    """A sliding window shorter than the sequences, and seeded sampling with logprobs: the
    rounds run step by step (same results), never in the loop."""
    prompts = _prompts(5, 3)
    compare(str(tiny_checkpoints["mistral_sliding"]), prompts, [greedy(30)] * 3,
            dtype="float32")
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=16, ignore_eos=True,
                              logprobs=1) for i in range(3)]
    compare(str(tiny_checkpoints["llama"]), prompts, sampled, dtype="float32")
    assert loop_calls["tokens"] == 0


def test_switched_off(tiny_checkpoints, loop_calls, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_DECODE_LOOP", "0")
    compare(str(tiny_checkpoints["llama"]), _prompts(6, 2), [greedy(12)] * 2, dtype="float32")
    assert loop_calls["tokens"] == 0
