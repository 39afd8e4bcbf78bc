"""`pagedllm bench latency --workload agent --compare no-spec`: the agent workload and the same
waves with and without speculative decoding in one run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.assets import default_model_path
from pagedllm.benchmarks.agent_workload import agent_prompts, make_agent_workload
from pagedllm.benchmarks.chat_workload import chat_prompts, chat_topics, make_chat_workload
from tests.benchmarks.test_bench_smoke import KV_BYTES, _load, _run, preset_dir  # noqa: F401


def test_agent_prompts_are_seeded_and_hold_the_text_to_repeat():
    a, b = agent_prompts(4, seed=1), agent_prompts(4, seed=1)
    assert a == b and a != agent_prompts(4, seed=2)
    record = json.loads(a[0].split("\n\n", 1)[1])       # the JSON task's record parses
    assert {"id", "name", "city", "age", "status", "tags"} <= set(record)
    assert "```python\ndef update_" in a[1]


def test_agent_workload_uses_the_chat_template():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_path())
    text = agent_prompts(1)[0]
    tok.chat_template = None
    assert make_agent_workload(tok, 1, 16)[0].prompt_token_ids == tok(text)["input_ids"]
    tok.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (request,) = make_agent_workload(tok, 1, 16)
    assert f"<<{text}>>" in tok.decode(request.prompt_token_ids)
    assert request.output_len == 16
    with pytest.raises(ValueError, match="num_prompts"):
        make_agent_workload(tok, 0, 16)


def test_chat_prompts_are_seeded_and_the_splits_disjoint():
    """The benchmark's chat questions ("eval") are about other topics than the ones a head is
    distilled on ("train"), seeded, and rendered through the chat template."""
    from transformers import AutoTokenizer

    a = chat_prompts(30, seed=3)
    assert a == chat_prompts(30, seed=3) and a != chat_prompts(30, seed=4)
    assert not set(chat_topics("eval")) & set(chat_topics("train"))
    assert all(any(t in q for t in chat_topics("eval")) for q in a)
    assert len(set(a)) == 30      # no pair twice before all are used
    tok = AutoTokenizer.from_pretrained(default_model_path())
    tok.chat_template = "{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}"
    (request,) = make_chat_workload(tok, 1, 16, seed=3)
    assert tok.decode(request.prompt_token_ids) == f"<<{a[0]}>>" and request.output_len == 16
    with pytest.raises(ValueError, match="split"):
        chat_prompts(2, split="test")


def test_latency_with_and_without_speculation(preset_dir: Path, tmp_path: Path):  # noqa: F811
    out = tmp_path / "lat.json"
    rc = _run(["bench", "latency", "--preset", "llama-tiny", "--preset-dir", str(preset_dir),
               "--dtype", "float32", "--kv-cache-memory-bytes", KV_BYTES, "--workload", "agent",
               "--output-len", "8", "--num-iters", "1", "--bandwidth-mib", "0",
               "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}',
               "--compare", "no-spec", "--output-json", str(out)])
    assert rc == 0
    spec, plain = _load(out)
    assert spec["speculative_config"]["method"] == "suffix" and plain["speculative_config"] is None
    assert spec["num_output_tokens"] == plain["num_output_tokens"] == 8
    assert spec["workload"] == "agent"
    assert plain["tpot_speedup_of_spec"] == pytest.approx(plain["tpot_ms_mean"]
                                                          / spec["tpot_ms_mean"])
    assert "spec_decoding" not in plain
    with pytest.raises(ValueError, match="no-spec"):
        _run(["bench", "latency", "--preset", "llama-tiny", "--preset-dir", str(preset_dir),
              "--compare", "no-spec"])


def test_no_ignore_eos_requests_end_at_eos():
    from pagedllm.benchmarks.workload import BenchRequest, sampling_params_for

    assert sampling_params_for(BenchRequest([1, 2], 5)).ignore_eos
    params = sampling_params_for(BenchRequest([1, 2], 5, ignore_eos=False))
    assert not params.ignore_eos and params.max_tokens == 5 and params.temperature == 0.0


def test_compare_greedy_outputs_finds_the_first_difference():
    from pagedllm.benchmarks.latency_cli import compare_greedy_outputs

    same = compare_greedy_outputs({"output_token_ids": [[1, 2], [3]]},
                                  {"output_token_ids": [[1, 2], [3]]})
    assert same == {"greedy_outputs_identical": True, "num_requests_differing": 0}
    diff = compare_greedy_outputs({"output_token_ids": [[1, 2], [3, 4, 5]]},
                                  {"output_token_ids": [[1, 2], [3, 9]]})
    assert not diff["greedy_outputs_identical"] and diff["num_requests_differing"] == 1
    assert diff["first_difference"] == {"request": 1, "position": 1}
    shorter = compare_greedy_outputs({"output_token_ids": [[1, 2]]}, {"output_token_ids": [[1]]})
    assert shorter["first_difference"] == {"request": 0, "position": 1}


def test_latency_no_ignore_eos_same_greedy_outputs(preset_dir: Path, tmp_path: Path):  # noqa: F811
    out = tmp_path / "lat.json"
    rc = _run(["bench", "latency", "--preset", "llama-tiny", "--preset-dir", str(preset_dir),
               "--dtype", "float32", "--kv-cache-memory-bytes", KV_BYTES, "--workload", "agent",
               "--output-len", "12", "--num-iters", "2", "--bandwidth-mib", "0",
               "--no-ignore-eos",
               "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}',
               "--compare", "no-spec", "--output-json", str(out)])
    assert rc == 0
    spec, plain = _load(out)
    assert spec["ignore_eos"] is False and plain["ignore_eos"] is False
    assert plain["greedy_outputs_identical"] and plain["num_requests_differing"] == 0
    assert spec["output_token_ids"] == plain["output_token_ids"]
    assert spec["output_lens"] == plain["output_lens"] == [len(t) for t in
                                                          spec["output_token_ids"]]
    assert all(1 <= n <= 12 for n in spec["output_lens"])
    with pytest.raises(ValueError, match="no-ignore-eos"):
        _run(["bench", "latency", "--preset", "llama-tiny", "--preset-dir", str(preset_dir),
              "--no-ignore-eos", "--compare", "llamacpp"])


def test_latency_alternate_pairs_and_same_greedy_outputs(preset_dir: Path,  # noqa: F811
                                                         tmp_path: Path):
    """`--alternate`: both engines side by side, the waves alternating; one TPOT ratio per timed
    wave pair, their median within [min, max], and the greedy tokens of the two engines equal
    (EOS honoured)."""
    out = tmp_path / "lat.json"
    rc = _run(["bench", "latency", "--preset", "llama-tiny", "--preset-dir", str(preset_dir),
               "--dtype", "float32", "--kv-cache-memory-bytes", KV_BYTES, "--workload", "agent",
               "--output-len", "12", "--num-iters", "3", "--bandwidth-mib", "0",
               "--no-ignore-eos", "--alternate",
               "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}',
               "--compare", "no-spec", "--output-json", str(out)])
    assert rc == 0
    spec, plain = _load(out)
    assert spec["speculative_config"]["method"] == "suffix" and plain["speculative_config"] is None
    assert "spec_decoding" not in plain
    assert plain["greedy_outputs_identical"]
    assert spec["output_token_ids"] == plain["output_token_ids"]
    assert spec["num_timed_requests"] == plain["num_timed_requests"] == 3
    alt = plain["alternation"]
    pairs = alt["pairs"]
    assert [p["wave"] for p in pairs] == [1, 2, 3]
    assert [p["first"] for p in pairs] == ["plain", "spec", "plain"]
    for p in pairs:
        if p["tpot_ratio"] is not None:
            assert p["tpot_ratio"] == pytest.approx(p["plain_tpot_ms"] / p["spec_tpot_ms"])
    ratios = [p["tpot_ratio"] for p in pairs if p["tpot_ratio"] is not None]
    assert alt["num_pairs"] == len(ratios) >= 1
    assert alt["tpot_ratio_min"] <= alt["tpot_ratio_median"] <= alt["tpot_ratio_max"]
    # The old aggregate figures are still there.
    assert plain["tpot_speedup_of_spec"] == pytest.approx(plain["tpot_ms_mean"]
                                                          / spec["tpot_ms_mean"])
    with pytest.raises(ValueError, match="alternate"):
        _run(["bench", "latency", "--preset", "llama-tiny", "--preset-dir", str(preset_dir),
              "--speculative-config", '{"method": "suffix", "num_speculative_tokens": 4}',
              "--alternate"])


def test_alternation_summary():
    from pagedllm.benchmarks.latency import alternation_summary

    pairs = [{"tpot_ratio": r, "e2e_ratio": e} for r, e in
             ((1.5, 1.4), (None, None), (2.0, 1.8), (1.0, 1.2), (1.7, 1.6))]
    out = alternation_summary(pairs)
    assert out["num_pairs"] == 4 and out["pairs"] is pairs
    assert out["tpot_ratio_median"] == pytest.approx(1.6)
    assert (out["tpot_ratio_min"], out["tpot_ratio_max"]) == (1.0, 2.0)
    assert out["tpot_ratio_iqr"] == pytest.approx(1.775 - 1.375)
    assert out["e2e_ratio_median"] == pytest.approx(1.5)
    empty = alternation_summary([{"tpot_ratio": None, "e2e_ratio": None}])
    assert empty["num_pairs"] == 0 and empty["tpot_ratio_median"] != empty["tpot_ratio_median"]
