"""The batch-invariant mode (`batch_invariant=True`): the same seeded requests give bit-identical
token ids and logprobs alone, batched with other requests, with their prompts chunked, after a
prefix-cache hit and after preemption, on the bf16 path (the fused decoder) and on the GGUF path
(8-bit activations), and models whose kernels cannot keep the mode are refused at start-up.

The workload is chosen to hit every place where the default mode's floats move: contexts past
the attention kernel's 256-key split, prefill chunks and prefix-hit suffixes of 16+ tokens (the
register-blocked tiles), fresh prompts (SDPA on the module path), greedy requests decoded by the
native multi-step loop, and steps of different sizes.
"""

from __future__ import annotations

import numpy as np
import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.native.kernels import cpu_kernels
from tests.fixtures.checkpoints import make_tiny_checkpoint
from tests.fixtures.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="CPU kernels did not build")

_PROMPT_LENS = (340, 23, 150)
_VOCAB = 500   # prompt ids are drawn from [3, _VOCAB): inside the tiny tokenizer's 512 ids


def _targets(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    """Three requests: a long sampled prompt with logprobs, a greedy one (the native decode loop
    can take it), and a short one whose decode crosses the 256-key split."""
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, vocab_size, n).tolist() for n in _PROMPT_LENS]
    params = [SamplingParams(temperature=0.8, seed=11, max_tokens=24, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=250, ignore_eos=True),
              SamplingParams(temperature=0.7, top_p=0.9, seed=5, max_tokens=16, logprobs=3,
                             prompt_logprobs=1, ignore_eos=True)]
    return list(zip(prompts, params))


def _others(vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
    rng = np.random.default_rng(1)
    return [(rng.integers(3, vocab_size, int(n)).tolist(),
             SamplingParams(temperature=1.0, seed=int(n), max_tokens=int(m), ignore_eos=True))
            for n, m in zip(rng.integers(5, 200, 5), rng.integers(3, 40, 5))]


def _key(out) -> tuple:
    """Token ids, every logprob (chosen and top-k) and prompt logprobs, exactly."""
    c = out.outputs[0]
    lps = tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) for d in c.logprobs or ())
    plps = tuple(tuple(sorted((t, lp.logprob) for t, lp in d.items())) if d else ()
                 for d in out.prompt_logprobs or ())
    return tuple(c.token_ids), lps, plps


def _generate(model: str, requests, **engine_args):
    llm = LLM(model, batch_invariant=True, max_model_len=1024, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in requests],
                        [s for _, s in requests], use_tqdm=False)
    return llm, [_key(o) for o in outs]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, byte_level_tokenizer_dir):
    # head_size 32: the attention kernel's register-blocked tiles apply to such heads.
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bi") / "llama", "LlamaForCausalLM",
                                byte_level_tokenizer_dir, hidden_size=256,
                                intermediate_size=512, num_attention_heads=8,
                                num_key_value_heads=4, initializer_range=0.05)


@pytest.fixture(scope="module", params=["bf16", "gguf_q8_0"])
def model(request, checkpoint, tmp_path_factory):
    if request.param == "bf16":
        return str(checkpoint), {"dtype": "bfloat16"}
    path = write_gguf(checkpoint, tmp_path_factory.mktemp("bi_gguf") / "m.gguf", "Q8_0")
    return str(path), {}


def test_same_floats_alone_batched_chunked_cached_and_preempted(model):
    path, args = model
    llm = LLM(path, batch_invariant=True, max_model_len=1024, **args)
    targets, others = _targets(_VOCAB), _others(_VOCAB)
    alone = [_key(llm.generate([{"prompt_token_ids": p}], [s], use_tqdm=False)[0])
             for p, s in targets]
    del llm

    _, batched = _generate(path, targets + others, **args)
    assert batched[:3] == alone, "batched with other requests"

    for budget in (16, 37):
        _, chunked = _generate(path, others[:2] + targets, max_num_batched_tokens=budget,
                               enable_chunked_prefill=True, **args)
        assert chunked[2:] == alone, f"chunked prefill ({budget}-token steps)"

    llm = LLM(path, batch_invariant=True, max_model_len=1024, **args)
    # Prefixes of the targets first: the targets then hit the cache on all but a short tail
    # (the default mode computes it on another attention path than a whole prompt's).
    llm.generate([{"prompt_token_ids": p[:len(p) - 2]} for p, _ in targets],
                 SamplingParams(max_tokens=1), use_tqdm=False)
    hits = llm.generate([{"prompt_token_ids": p} for p, _ in targets], [s for _, s in targets],
                        use_tqdm=False)
    assert llm.get_stats().prefix_cache_stats.hits > 0
    assert [_key(o) for o in hits] == alone, "after a prefix-cache hit"

    llm, preempted = _generate(path, targets + others, num_gpu_blocks_override=26, **args)
    assert llm.get_stats().num_preemptions > 0
    assert preempted[:3] == alone, "after preemption"


def test_w8a8_keeps_the_mode(checkpoint):
    targets, others = _targets(_VOCAB)[:1], _others(_VOCAB)
    _, alone = _generate(str(checkpoint), targets, quantization="w8a8")
    _, batched = _generate(str(checkpoint), targets + others, quantization="w8a8",
                           max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert batched[:1] == alone


@pytest.mark.parametrize("case", ["int8_weight_only", "unpacked_weights", "gguf_float", "moe"])
def test_models_the_kernels_cannot_serve_invariantly_are_refused(case, checkpoint,
                                                                 tmp_path_factory,
                                                                 byte_level_tokenizer_dir,
                                                                 monkeypatch):
    path, args, named = str(checkpoint), {}, "Linear"
    if case == "int8_weight_only":
        args, named = {"quantization": "int8"}, "Int8LinearMethod"
    elif case == "unpacked_weights":
        monkeypatch.setenv("PAGEDLLM_CPU_PACKED_GEMM", "0")
        named = "UnquantizedLinearMethod"
    elif case == "gguf_float":
        monkeypatch.setenv("PAGEDLLM_GGUF_Q8_ACTIVATIONS", "0")
        path = str(write_gguf(checkpoint, tmp_path_factory.mktemp("bi_f") / "m.gguf", "Q8_0"))
        named = "GGUFLinearMethod"
    else:
        path = str(make_tiny_checkpoint(
            tmp_path_factory.mktemp("bi_moe") / "moe", "MixtralForCausalLM",
            byte_level_tokenizer_dir, num_local_experts=4, num_experts_per_tok=2))
        named = "mixture-of-experts"
    with pytest.raises(ValueError, match=f"batch_invariant=True is not available.*{named}"):
        LLM(path, batch_invariant=True, max_model_len=256, **args)
    LLM(path, max_model_len=256, **args)   # the default mode serves it
