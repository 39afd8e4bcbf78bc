"""Bad input: clear errors naming the problem; other requests unaffected."""

from __future__ import annotations

import json
import shutil

import pytest

from pagedllm import LLM, GenerateError, SamplingParams
from pagedllm.entrypoints.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(tiny_checkpoints):
    return LLM(str(tiny_checkpoints["llama"]), dtype="float32", kv_cache_memory_bytes=8 << 20,
               max_model_len=64)


def test_unknown_architecture(tiny_checkpoints, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["llama"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        LLM(str(path), dtype="float32")


def test_missing_and_corrupt_weights(tiny_checkpoints, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoints["llama"], path)
    (path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="model.safetensors"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(path), dtype="float32", kv_cache_memory_bytes=1 << 20)


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="/no/such/model"):
        LLM("/no/such/model")


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                    dict(max_tokens=0), dict(top_k=-2), dict(min_p=2.0),
                                    dict(repetition_penalty=0.0), dict(n=0)])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_bad_request_fails_alone(llm):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good = [[5, 6, 7], [8, 9]]
    with pytest.raises(GenerateError) as info:
        llm.generate([good[0], list(range(3, 100)), good[1], [], [10**9]], params,
                     use_tqdm=False)
    err = info.value
    assert isinstance(err, ValueError)
    assert set(err.errors) == {1, 3, 4}
    assert "max_model_len" in err.errors[1] and "empty" in err.errors[3]
    assert "vocabulary" in err.errors[4]
    assert [len(err.outputs[i].outputs[0].token_ids) for i in (0, 2)] == [4, 4]
    # The engine keeps working and gives the same tokens as before.
    again = llm.generate(good, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [err.outputs[0].outputs[0].token_ids,
                                                       err.outputs[2].outputs[0].token_ids]


def test_finish_reasons_and_stop_token_ids(llm):
    first = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6,
                                                     ignore_eos=True), use_tqdm=False)[0]
    out = first.outputs[0]
    assert out.finish_reason == "length" and out.stop_reason is None
    stop_id = out.token_ids[2]
    stopped = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6,
                                                       ignore_eos=True,
                                                       stop_token_ids=[stop_id]),
                           use_tqdm=False)[0].outputs[0]
    first_hit = out.token_ids.index(stop_id)
    assert stopped.token_ids == out.token_ids[:first_hit + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    # max_model_len caps generation.
    long = llm.generate([list(range(3, 60))], SamplingParams(temperature=0.0, max_tokens=50,
                                                             ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert len(long.token_ids) == 64 - 57 and long.finish_reason == "length"


def test_stop_string_cut_from_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    text = llm.generate(["hello world"], params, use_tqdm=False)[0].outputs[0].text
    assert len(text) > 4
    stop = text[2:4]
    out = llm.generate(["hello world"], SamplingParams(temperature=0.0, max_tokens=12,
                                                       ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:text.index(stop)]


def test_cli_generate(tiny_checkpoints, capsys):
    rc = cli_main(["generate", "--model", str(tiny_checkpoints["llama"]), "--dtype", "float32",
                   "--kv-cache-memory", str(4 << 20), "--prompt", "Once upon a time",
                   "--max-tokens", "5", "--temperature", "0", "--ignore-eos"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "generated tokens: 5" in out and "tokens/s" in out


def test_cli_bad_args(capsys):
    assert cli_main(["generate", "--model", "/no/such/dir", "--prompt", "x"]) == 1
    assert "model folder not found" in capsys.readouterr().err


# ----------------------------------------------------------------- issue #16: the admission gate

GREEDY4 = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _still_usable(llm, expected=None):
    """A normal greedy request still runs (and gives `expected` tokens when given)."""
    tokens = llm.generate([[5, 6, 7]], GREEDY4, use_tqdm=False)[0].outputs[0].token_ids
    assert len(tokens) == 4
    if expected is not None:
        assert tokens == expected
    assert not llm.llm_engine.has_unfinished_requests()
    return tokens


@pytest.mark.parametrize("kwargs", [
    dict(seed=2**63), dict(seed=-(2**63) - 1), dict(top_k=2**70), dict(n=2**70),
    dict(truncate_prompt_tokens=2**70), dict(max_tokens=2**64), dict(min_tokens=-1),
    dict(temperature=float("nan")), dict(temperature=float("inf")), dict(top_p=float("nan")),
    dict(logit_bias={1: float("nan")}), dict(logit_bias={"x": 1}), dict(n=True),
    dict(stop_token_ids=[-1]), dict(stop_token_ids=5), dict(stop=7), dict(ignore_eos="yes"),
    dict(allowed_token_ids=[2**64])])
def test_sampling_params_refuse_out_of_range_and_non_finite(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SamplingParams(**kwargs)


def test_int64_edges_run(llm):
    before = _still_usable(llm)
    outs = llm.generate([[5, 6, 7]], SamplingParams(seed=2**63 - 1, n=3, top_k=2**62,
                                                    min_tokens=2, max_tokens=3),
                        use_tqdm=False)
    assert len(outs[0].outputs) == 3
    _still_usable(llm, before)


@pytest.mark.parametrize("kwargs,field", [
    (dict(stop_token_ids=[10**6], min_tokens=1), "stop_token_ids"),
    (dict(logit_bias={10**6: 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[1, 10**6]), "allowed_token_ids"),
    (dict(logprobs=10**6), "logprobs"),
    (dict(prompt_logprobs=21), "prompt_logprobs"),
    (dict(n=10**9), "n"),
    (dict(logit_bias={i: 1.0 for i in range(301)}), "logit_bias"),
    (dict(structured_outputs={"regex": "(a|b"}), "structured_outputs"),
])
def test_gate_refuses_alone_and_llm_stays_usable(llm, kwargs, field):
    before = _still_usable(llm)
    with pytest.raises(GenerateError) as info:
        llm.generate([[5, 6, 7], [8, 9]], [GREEDY4, SamplingParams(max_tokens=4, **kwargs)],
                     use_tqdm=False)
    assert set(info.value.errors) == {1} and info.value.errors[1].startswith(field)
    assert info.value.outputs[0].outputs[0].token_ids == before
    _still_usable(llm, before)


def test_logits_processor_failure_fails_its_request_alone(llm):
    before = _still_usable(llm)

    def broken(output_ids, logits):
        if len(output_ids) == 2:
            raise RuntimeError("boom")
        return logits

    def wrong_shape(output_ids, logits):
        return logits[:3]

    with pytest.raises(GenerateError) as info:
        llm.generate([[5, 6, 7]] * 3, [GREEDY4, SamplingParams(max_tokens=4, logits_processors=[
            broken]), SamplingParams(max_tokens=4, logits_processors=[wrong_shape])],
                     use_tqdm=False)
    err = info.value
    assert set(err.errors) == {1, 2}
    assert "broken" in err.errors[1] and "boom" in err.errors[1]
    failed = err.outputs[1].outputs[0]
    assert failed.finish_reason == "error" and len(failed.token_ids) == 2
    assert err.outputs[2].outputs[0].finish_reason == "error"
    assert err.outputs[0].outputs[0].token_ids == before
    assert llm.get_stats().num_running_reqs == 0
    _still_usable(llm, before)


def test_interrupted_generate_leaves_nothing_running(llm):
    """An exception that escapes the step (here KeyboardInterrupt from user code) aborts the
    call's requests, so the next generate neither hangs nor sees them."""
    before = _still_usable(llm)

    def interrupt(output_ids, logits):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate([[5, 6, 7], [8, 9, 10]], [GREEDY4, SamplingParams(
            max_tokens=4, logits_processors=[interrupt])], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    _still_usable(llm, before)


def test_chat_template_argument(tiny_llama, tmp_path, capsys):
    """--chat-template / chat_template=: a file or the template text replaces the tokenizer's
    own; anything else, an empty conversation or an unknown engine argument fails by name."""
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    (tmp_path / "t.jinja").write_text(template)
    for value in (str(tmp_path / "t.jinja"), template):
        llm = LLM(str(tiny_llama), chat_template=value, kv_cache_memory_bytes=4 << 20)
        out = llm.chat([{"role": "user", "content": "hi"}],
                       SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)[0]
        assert llm.get_tokenizer().decode(out.prompt_token_ids).endswith("<user>hi<assistant>")
    with pytest.raises(ValueError, match="conversation 0 is empty"):
        llm.chat([])
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        LLM(str(tiny_llama), chat_template="chatml")
    with pytest.raises(TypeError, match=r"unknown engine arguments \['bogus_arg'\]"):
        LLM(str(tiny_llama), bogus_arg=1)
    code = cli_main(["generate", "--model", str(tiny_llama), "--chat", "--prompt", "hi",
                     "--chat-template", str(tmp_path / "t.jinja"), "--max-tokens", "2",
                     "--kv-cache-memory", str(4 << 20)])
    assert code == 0 and "generated tokens: 2" in capsys.readouterr().out


def test_prompts_of_the_wrong_type_are_named(llm):
    with pytest.raises(TypeError, match="prompts must be a string, .* got int"):
        llm.generate(5)
    out = llm.generate((p for p in ("a", "b")), SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out) == 2
