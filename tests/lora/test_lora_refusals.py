"""Bad adapters are refused at admission with an error naming the problem, while the other
requests of the same call run to completion; and the grouped shrink/expand op against a dense
per-token reference."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pagedllm import LLM, GenerateError, LoRARequest, SamplingParams
from pagedllm.lora.ops import LoRAMapping, lora_expand, lora_shrink
from tests.lora.adapters import ALL_LINEAR, make_peft_adapter


@pytest.fixture(scope="module")
def base(tiny_checkpoints):
    return tiny_checkpoints["llama"]


@pytest.fixture(scope="module")
def good(base, tmp_path_factory):
    return make_peft_adapter(base, tmp_path_factory.mktemp("good") / "a", 8, ALL_LINEAR, 16,
                             False, seed=0)


def _variant(good, tmp_path, name, edit_config=None, edit_files=None):
    folder = tmp_path / name
    shutil.copytree(good, folder)
    if edit_config is not None:
        path = folder / "adapter_config.json"
        config = json.loads(path.read_text())
        edit_config(config)
        path.write_text(json.dumps(config))
    if edit_files is not None:
        edit_files(folder)
    return str(folder)


def _bad_adapters(good, tmp_path, base):
    rank_16 = make_peft_adapter(base, tmp_path / "r16", 16, ALL_LINEAR, 16, False, seed=1)
    return {
        "exceeds max_lora_rank": str(rank_16),
        "use_dora": _variant(good, tmp_path, "dora", lambda c: c.update(use_dora=True)),
        "modules_to_save": _variant(good, tmp_path, "mts",
                                    lambda c: c.update(modules_to_save=["lm_head"])),
        "target modules ['input_layernorm']": _variant(
            good, tmp_path, "norm",
            lambda c: c.update(target_modules=["q_proj", "input_layernorm"])),
        "adapter_config.json not found": _variant(
            good, tmp_path, "noconf", edit_files=lambda f: (f / "adapter_config.json").unlink()),
        "adapter_model.safetensors cannot be read": _variant(
            good, tmp_path, "corrupt", edit_files=lambda f: (
                f / "adapter_model.safetensors").write_bytes(b"\x00" * 64)),
        "is not a folder": str(tmp_path / "missing"),
    }


def test_bad_adapters_refused_others_go_on(base, good, tmp_path):
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=4 << 20, enable_lora=True,
              max_loras=2, max_lora_rank=8)
    bad = _bad_adapters(good, tmp_path, base)
    loras = [LoRARequest("good", 1, str(good))] + [
        LoRARequest(f"bad{i}", i + 2, path) for i, path in enumerate(bad.values())]
    # A second adapter under the good one's id.
    loras.append(LoRARequest("impostor", 1, bad["use_dora"]))
    loras.append(None)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with pytest.raises(GenerateError) as info:
        llm.generate([[5, 6, 7, 8]] * len(loras), params, use_tqdm=False, lora_request=loras)
    errors, outputs = info.value.errors, info.value.outputs
    assert set(errors) == set(range(1, len(loras) - 1))
    for i, expected in enumerate(bad, start=1):
        assert "lora_request" in errors[i] and expected in errors[i], errors[i]
    assert "lora_int_id 1 is already used by adapter 'good'" in errors[len(loras) - 2]
    assert len(outputs[0].outputs[0].token_ids) == 4
    assert len(outputs[-1].outputs[0].token_ids) == 4


def test_lora_off_refuses_adapters_and_bad_engine_args(base, good):
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=4 << 20)
    with pytest.raises(GenerateError, match="LoRA is not enabled"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=1), use_tqdm=False,
                     lora_request=LoRARequest("a", 1, str(good)))
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        LLM(str(base), enable_lora=True, max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("a", 0, str(good))


def test_grouped_shrink_expand_matches_dense_reference():
    torch.manual_seed(0)
    n, d_in, d_out, width, slots = 11, 6, 5, 4, 3
    x = torch.randn(n, d_in)
    lora_a = torch.randn(slots, width, d_in)
    lora_b = torch.randn(slots, width, d_out)   # B^T per slot
    token_slots = [2, -1, 0, 0, 2, -1, 1, 2, 0, -1, 1]
    order = [t for s in range(slots) for t in range(n) if token_slots[t] == s]
    counts = [token_slots.count(s) for s in range(slots)]
    starts = [sum(counts[:s]) for s in range(slots)]
    mapping = LoRAMapping(torch.tensor(order),
                          tuple((s, starts[s], starts[s] + counts[s]) for s in range(slots)))
    y = torch.randn(n, d_out)
    want = y.clone()
    for t, s in enumerate(token_slots):
        if s >= 0:
            want[t] += lora_b[s].t() @ (lora_a[s] @ x[t])
    lora_expand(y, lora_shrink(x, lora_a, mapping), lora_b, mapping)
    torch.testing.assert_close(y, want)
    whole = LoRAMapping(None, ((1, 0, n),))
    y = torch.zeros(n, d_out)
    lora_expand(y, lora_shrink(x, lora_a, whole), lora_b, whole)
    torch.testing.assert_close(y, x @ lora_a[1].t() @ lora_b[1])


def test_chat_takes_the_adapter(base, good):
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=4 << 20, enable_lora=True,
              max_lora_rank=8)
    lora = LoRARequest("good", 1, str(good))
    messages = [{"role": "user", "content": "hello there"}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = llm.get_tokenizer().apply_chat_template(messages, tokenize=True,
                                                     add_generation_prompt=True,
                                                     return_dict=False)
    want = llm.generate({"prompt_token_ids": list(prompt)}, params, use_tqdm=False,
                        lora_request=lora)[0].outputs[0].token_ids
    chat = llm.chat(messages, params, use_tqdm=False, lora_request=lora)[0]
    assert chat.outputs[0].token_ids == want
    plain = llm.chat(messages, params, use_tqdm=False)[0]
    assert plain.outputs[0].token_ids != want


def _run_to_end(engine):
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def test_adapter_file_changed_after_admission_fails_that_request_alone(base, good, tmp_path):
    """The front end checked the adapter; its file breaks before the worker reads it: that
    request ends with an error, the others go on. Once a request runs, its adapter is pinned
    on the host: breaking the file then, and crowding the host LRU with other adapters, changes
    nothing for it."""
    llm = LLM(str(base), dtype="float32", kv_cache_memory_bytes=4 << 20, enable_lora=True,
              max_loras=1, max_lora_rank=8, max_cpu_loras=1)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=6)
    doomed = _variant(good, tmp_path, "doomed")
    pinned = _variant(good, tmp_path, "pinned")
    other = _variant(good, tmp_path, "other")
    expected = llm.generate([[5, 6, 7, 8]], params, use_tqdm=False,
                            lora_request=LoRARequest("pinned", 2, pinned))[0]
    engine.add_request("doomed", [5, 6, 7, 8], params, LoRARequest("doomed", 1, doomed))
    engine.add_request("base", [5, 6, 7, 8], params)
    (tmp_path / "doomed" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    outputs = _run_to_end(engine)
    assert outputs["doomed"].outputs[0].finish_reason == "error"
    assert "could not be loaded" in outputs["doomed"].error
    assert len(outputs["base"].outputs[0].token_ids) == 6

    engine.add_request("pinned", [5, 6, 7, 8], params, LoRARequest("pinned", 2, pinned))
    engine.step()    # it reached the worker: its adapter is pinned
    (tmp_path / "pinned" / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    engine.add_request("other", [5, 6, 7, 8], params, LoRARequest("other", 3, other))
    outputs = _run_to_end(engine)
    assert outputs["pinned"].outputs[0].token_ids == expected.outputs[0].token_ids
    assert len(outputs["other"].outputs[0].token_ids) == 6
