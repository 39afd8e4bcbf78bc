"""Gemma 3 with images: greedy tokens and chosen-token logprobs (fp32) equal HF transformers'
for prompts with 0, 1 and 2 images, also with chunked prefill (an image's soft tokens are never
split: they attend to each other bidirectionally) and prefix caching; the logprobs tell the
bidirectional mask from a causal one (they differ by ~1e-2 on this checkpoint). Both CPU
backends take the mask; `cpu_paged` in its native kernel, never falling back to torch_sdpa
(triton_paged: tests/attention/test_triton_paged.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from tests.fixtures.vlm import build_tiny_gemma3_vision, draw_image

MAX_TOKENS = 5
WIDE, TALL = draw_image(56, 40, 1), draw_image(64, 16, 2)
PROMPTS = [("The cat <start_of_image> sees", [WIDE]),
           ("A <start_of_image> and <start_of_image> too", [WIDE, TALL]),
           ("Just some text here", [])]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_gemma3_vision(tmp_path_factory.mktemp("tiny_gemma3_vision"))


@pytest.fixture(scope="module")
def hf_gemma3(tiny_gemma3: Path):
    """(HF processor, HF model in fp32) of the checkpoint."""
    import torch
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    return (AutoProcessor.from_pretrained(tiny_gemma3),
            Gemma3ForConditionalGeneration.from_pretrained(tiny_gemma3,
                                                           dtype=torch.float32).eval())


@pytest.fixture(scope="module")
def hf_outputs(hf_gemma3) -> list[tuple[list[int], list[float]]]:
    import torch

    processor, model = hf_gemma3
    out = []
    for text, images in PROMPTS:
        inputs = processor(text=[text], images=[images] if images else None,
                           return_tensors="pt")
        with torch.no_grad():
            g = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False,
                               output_scores=True, return_dict_in_generate=True)
        tokens = g.sequences[0, inputs["input_ids"].shape[1]:].tolist()
        out.append((tokens, [torch.log_softmax(s[0].float(), -1)[t].item()
                             for s, t in zip(g.scores, tokens)]))
    return out


def _engine(path: Path, backend: str = "torch_sdpa", **kwargs) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_ATTENTION_BACKEND", backend)
        return LLM(str(path), dtype="float32", max_model_len=256,
                   kv_cache_memory_bytes=1 << 22, **kwargs)


def _paged_backend() -> str:
    """cpu_paged (the CPU default) where its native kernel builds, else torch_sdpa."""
    from pagedllm.native.kernels import cpu_kernels

    return "cpu_paged" if cpu_kernels() is not None else "torch_sdpa"


@pytest.mark.parametrize("kwargs", [{}, {"backend": None},
                                    {"max_num_batched_tokens": 8, "enable_prefix_caching": False,
                                     "backend": None}])
def test_equals_hf_tokens_and_logprobs(tiny_gemma3, hf_outputs, kwargs, monkeypatch):
    if "backend" in kwargs:
        kwargs = {**kwargs, "backend": _paged_backend()}
        if kwargs["backend"] == "cpu_paged":
            from pagedllm.attention.backends.torch_sdpa import TorchSDPABackend

            def no_fallback(*args, **kwargs):
                raise AssertionError("cpu_paged fell back to torch_sdpa")
            monkeypatch.setattr(TorchSDPABackend, "forward", no_fallback)
    llm = _engine(tiny_gemma3, **kwargs)
    prompts = [{"prompt": t, "multi_modal_data": {"image": ims}} if ims else t
               for t, ims in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=0)
    for _ in range(2):     # the second round hits the prefix cache (when on)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for out, (tokens, logprobs) in zip(outputs, hf_outputs):
            completion = out.outputs[0]
            assert completion.token_ids == tokens
            ours = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
            assert ours == pytest.approx(logprobs, abs=1e-4)
    assert llm.get_stats().num_encoder_runs == 2


def test_an_image_longer_than_a_step_is_refused(tiny_gemma3):
    # 3 tokens a step for an image of 4 soft tokens that must be computed in one step.
    llm = _engine(tiny_gemma3, max_num_batched_tokens=3, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="one step"):
        llm.generate([{"prompt": "x <start_of_image>", "multi_modal_data": {"image": TALL}}],
                     SamplingParams(max_tokens=1), use_tqdm=False)


def test_chat_equals_hf(tiny_gemma3, hf_gemma3):
    import torch

    processor, model = hf_gemma3
    llm = _engine(tiny_gemma3)
    [out] = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "What is"}, {"type": "image_pil", "image_pil": WIDE}]}],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
        use_tqdm=False)
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is"},
                                      {"type": "image", "image": WIDE}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert out.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert out.outputs[0].token_ids == ids[0, inputs["input_ids"].shape[1]:].tolist()
