"""Logprobs, prompt logprobs, n > 1, logit bias, allowed tokens, bad words, output kinds,
logits processors and beam search (issue #7)."""

from __future__ import annotations

import itertools
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from pagedllm import (LLM, BeamSearchParams, RequestOutputKind, SamplingParams)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [100, 3, 250, 7]]


@pytest.fixture(scope="module")
def path(tiny_checkpoints):
    return str(tiny_checkpoints["llama"])


@pytest.fixture(scope="module")
def hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def llm(path):
    return LLM(path, dtype="float32", kv_cache_memory_bytes=16 << 20)


def _hf_log_softmax(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([tokens])).logits[0].log_softmax(-1)


def test_logprobs_match_hf(llm, hf):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                logprobs=3), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        comp = out.outputs[0]
        ref = _hf_log_softmax(hf, prompt + comp.token_ids)
        assert len(comp.logprobs) == len(comp.token_ids)
        total = 0.0
        for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[len(prompt) - 1 + i]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row > row[token]).sum()) + 1
            top = row.topk(3)
            for rank, (lp, tid) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
                assert entry[tid].logprob == pytest.approx(lp, abs=1e-4)
                assert entry[tid].rank == rank
            total += entry[token].logprob
        assert comp.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_processed_logprobs_follow_temperature(path, hf):
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=4 << 20,
              logprobs_mode="processed_logprobs")
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.5, max_tokens=3, seed=3,
                                                     ignore_eos=True, logprobs=0),
                       use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        logits = hf(torch.tensor([PROMPTS[0] + out.token_ids])).logits[0]
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        want = (logits[len(PROMPTS[0]) - 1 + i] / 0.5).log_softmax(-1)[token].item()
        assert entry[token].logprob == pytest.approx(want, abs=1e-4)


@pytest.mark.parametrize("engine_kwargs", [dict(), dict(max_num_batched_tokens=8)],
                         ids=["whole", "chunked"])
def test_prompt_logprobs_match_hf(path, hf, engine_kwargs):
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=4 << 20, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2)
    for _ in range(2):  # the second time the prefix is cached: logprobs must not be lost
        for prompt in PROMPTS:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            ref = _hf_log_softmax(hf, prompt)
            assert len(out.prompt_logprobs) == len(prompt) and out.prompt_logprobs[0] is None
            for i in range(1, len(prompt)):
                entry = out.prompt_logprobs[i]
                assert entry[prompt[i]].logprob == pytest.approx(ref[i - 1, prompt[i]].item(),
                                                                 abs=1e-4)
                assert entry[prompt[i]].rank == int((ref[i - 1] > ref[i - 1, prompt[i]]).sum()) + 1


def test_n_samples_share_the_prompt(path):
    llm = LLM(path, dtype="float32", kv_cache_memory_bytes=4 << 20)
    prompt = list(range(10, 90))  # 80 tokens = 5 full blocks
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    stats = llm.get_stats().prefix_cache_stats
    assert [o.index for o in first.outputs] == [0, 1, 2, 3]
    samples = [tuple(o.token_ids) for o in first.outputs]
    assert len(set(samples)) > 1
    # Children 1..3 found the prompt's full blocks (all but the last token's block) cached.
    assert stats.hits >= 3 * 64
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert [tuple(o.token_ids) for o in again.outputs] == samples


def test_logit_bias_allowed_tokens_bad_words(llm):
    forced = llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=0, max_tokens=5,
                                                       ignore_eos=True, logit_bias={42: 100}),
                          use_tqdm=False)[0].outputs[0]
    assert forced.token_ids == [42] * 5
    allowed = [7, 70, 300]
    out = llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=1, max_tokens=10,
                                               ignore_eos=True, allowed_token_ids=allowed),
                       use_tqdm=False)
    assert all(t in allowed for o in out for t in o.outputs[0].token_ids)
    base = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)
    tok = llm.get_tokenizer()
    word = tok.decode(base[1].outputs[0].token_ids[2:4]).strip()
    banned = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12,
                                                  ignore_eos=True, bad_words=[word]),
                          use_tqdm=False)
    for o in banned:
        ids = o.outputs[0].token_ids
        for seq in (tok(word, add_special_tokens=False).input_ids,
                    tok(" " + word, add_special_tokens=False).input_ids):
            assert not any(ids[i:i + len(seq)] == seq for i in range(len(ids)))


def test_output_kinds_detokenize_truncate_and_processors(llm):
    prompt = "the café was naïve"
    cumulative = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True), use_tqdm=False)[0]
    engine = llm.llm_engine
    for kind in RequestOutputKind:
        engine.add_request(f"kind-{kind.name}", prompt, SamplingParams(
            temperature=0.0, max_tokens=8, ignore_eos=True, output_kind=kind))
    pieces = {kind: [] for kind in RequestOutputKind}
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces[RequestOutputKind[out.request_id.split("-")[1]]].append(out)
    final = cumulative.outputs[0]
    assert len(pieces[RequestOutputKind.FINAL_ONLY]) == 1
    assert pieces[RequestOutputKind.FINAL_ONLY][0].outputs[0].text == final.text
    assert pieces[RequestOutputKind.CUMULATIVE][-1].outputs[0].text == final.text
    deltas = pieces[RequestOutputKind.DELTA]
    assert "".join(o.outputs[0].text for o in deltas) == final.text
    assert [t for o in deltas for t in o.outputs[0].token_ids] == final.token_ids

    raw = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                detokenize=False), use_tqdm=False)[0].outputs[0]
    assert raw.text == "" and raw.token_ids == final.token_ids
    ids = llm.get_tokenizer()(prompt).input_ids
    cut = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=2,
                                             truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-3:]

    seen = []

    def only_token_9(output_ids, logits):
        seen.append(list(output_ids))
        mask = torch.full_like(logits, float("-inf"))
        mask[9] = 0.0
        return logits + mask

    out = llm.generate([prompt], SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True,
                                                logits_processors=[only_token_9]),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [9, 9, 9] and seen == [[], [9], [9, 9]]


def test_beam_search_equals_brute_force(tmp_path, byte_level_tokenizer_dir):
    vocab, width, length, penalty = 10, 100, 3, 0.7
    for f in byte_level_tokenizer_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         initializer_range=0.5, eos_token_id=1, bos_token_id=0,
                         max_position_embeddings=64, architectures=["LlamaForCausalLM"])
    hf = LlamaForCausalLM(config).eval()
    hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_num_seqs=256)
    prompt = [3, 4, 5]
    got = llm.beam_search([prompt], BeamSearchParams(beam_width=width, max_tokens=length,
                                                     length_penalty=penalty))[0]

    def score(tokens, lp):
        n = len(tokens) - (1 if tokens[-1] == 1 else 0)
        return lp / n ** penalty

    # One batched forward over every full-length tail: a causal model's logits at a position do
    # not depend on the tokens after it, so the rows also score the shorter (EOS-ended) tails.
    tails = list(itertools.product(range(vocab), repeat=length))
    with torch.inference_mode():
        lps = hf(torch.tensor([prompt + list(t) for t in tails])).logits.log_softmax(-1)
    row_of = {t: i for i, t in enumerate(tails)}
    candidates = []
    for n in range(1, length + 1):
        for tail in itertools.product(range(vocab), repeat=n):
            if 1 in tail[:-1] or (n < length and tail[-1] != 1):
                continue  # EOS only at the end; shorter sequences must end in EOS
            row = row_of[tail + (0,) * (length - n)]
            lp = sum(lps[row, len(prompt) - 1 + i, t].item() for i, t in enumerate(tail))
            candidates.append((score(prompt + list(tail), lp), prompt + list(tail)))
    best = sorted(candidates, key=lambda c: c[0], reverse=True)[:width]
    assert [s.tokens for s in got.sequences][:20] == [t for _, t in best][:20]
    for seq, (sc, _) in zip(got.sequences, best):
        assert score(seq.tokens, seq.cum_logprob) == pytest.approx(sc, abs=1e-4)
