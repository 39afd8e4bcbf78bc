"""Images through `LLM.chat` (OpenAI content parts) and the OpenAI server (`image_url` parts
with base64 data URLs), driven by the official `openai` client over the in-process app: the
same tokens as `LLM.chat`, which equal HF transformers'; streamed equals non-streamed; bad
images and over-limit requests get a 400 naming the problem while the engine goes on."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import threading

import openai
import pytest
from fastapi.testclient import TestClient

from pagedllm import LLM, SamplingParams
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.entrypoints.openai.api_server import build_app
from pagedllm.multimodal.fetch import MediaFetcher
from tests.fixtures.vlm import draw_image

MAX_TOKENS = 6
IMAGE = draw_image(56, 40, 21)


def png_data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def messages(url: str, text: str = "What is in") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text},
                                          {"type": "image_url", "image_url": {"url": url}}]}]


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    """A local HTTP server of one PNG (`/cat.png`); yields its base URL."""
    root = tmp_path_factory.mktemp("images")
    IMAGE.save(root / "cat.png")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def client(tiny_idefics3):
    # 3000 pixels per image at most: a 64x64 image is "too large" (refused from its header).
    async_llm = AsyncLLM.from_engine_args(str(tiny_idefics3), dtype="float32",
                                          kv_cache_memory_bytes=1 << 22, max_model_len=256,
                                          limit_mm_per_prompt={"image": 1},
                                          max_image_pixels=3000)
    app = build_app(async_llm, ["vlm"], model_root=str(tiny_idefics3),
                    media_fetcher=MediaFetcher(("127.0.0.1",)))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                            max_retries=0)


@pytest.fixture(scope="module")
def chat_tokens(tiny_idefics3) -> list[int]:
    """`LLM.chat`'s greedy tokens for `messages(...)`, checked against HF transformers."""
    import torch
    from transformers import AutoProcessor, Idefics3ForConditionalGeneration

    llm = LLM(str(tiny_idefics3), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=1 << 22)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    [by_url] = llm.chat(messages(png_data_url(IMAGE)), params, use_tqdm=False)
    [by_pil] = llm.chat([{"role": "user", "content": [
        {"type": "text", "text": "What is in"}, {"type": "image_pil", "image_pil": IMAGE}]}],
        params, use_tqdm=False)
    processor = AutoProcessor.from_pretrained(tiny_idefics3)
    model = Idefics3ForConditionalGeneration.from_pretrained(tiny_idefics3,
                                                             dtype=torch.float32).eval()
    inputs = processor.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "What is in"},
                                      {"type": "image", "image": IMAGE}]}],
        add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
    with torch.no_grad():
        ids = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    assert by_url.prompt_token_ids == inputs["input_ids"][0].tolist()
    assert by_url.outputs[0].token_ids == ids[0, inputs["input_ids"].shape[1]:].tolist()
    assert by_pil.outputs[0].token_ids == by_url.outputs[0].token_ids
    return by_url.outputs[0].token_ids


def test_openai_client_equals_llm_chat(client, chat_tokens, tiny_idefics3):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_idefics3)
    kwargs = dict(model="vlm", messages=messages(png_data_url(IMAGE)), temperature=0,
                  max_tokens=MAX_TOKENS, extra_body={"ignore_eos": True})
    response = client.chat.completions.create(**kwargs)
    text = response.choices[0].message.content
    assert text == tokenizer.decode(chat_tokens, skip_special_tokens=True)
    streamed = "".join(chunk.choices[0].delta.content or ""
                       for chunk in client.chat.completions.create(**kwargs, stream=True)
                       if chunk.choices)
    assert streamed == text


@pytest.mark.parametrize("url, problem", [
    ("data:image/png;base64,AAAAAAAA", "cannot decode"),
    ("data:image/png;base64,@@not base64@@", "base64"),
    ("data:text/plain;base64,aGVsbG8=", "not an image"),
    ("https://example.com/cat.png", "not in --allowed-media-domains"),
    ("file:///etc/passwd", "not read by this server"),
    (png_data_url(draw_image(64, 64, 3)), "more than the limit"),
])
def test_bad_images_are_400_and_the_engine_goes_on(client, url, problem):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="vlm", messages=messages(url), max_tokens=2)
    assert problem in str(e.value)
    ok = client.chat.completions.create(model="vlm", messages=messages(png_data_url(IMAGE)),
                                        max_tokens=2)
    assert ok.choices[0].finish_reason is not None


def test_too_many_images_is_400(client):
    url = png_data_url(IMAGE)
    two = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    with pytest.raises(openai.BadRequestError, match="limit of 1 per prompt"):
        client.chat.completions.create(model="vlm", messages=two, max_tokens=2)


def test_images_for_a_text_only_model_are_refused(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=128,
              kv_cache_memory_bytes=1 << 21)
    with pytest.raises(ValueError, match="takes text only"):
        llm.chat(messages(png_data_url(IMAGE)), SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="takes text only"):
        llm.generate([{"prompt": "hi <image>", "multi_modal_data": {"image": IMAGE}}],
                     SamplingParams(max_tokens=2), use_tqdm=False)
    [out] = llm.generate(["hi"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_fetched_url_equals_data_url(client, image_server):
    kwargs = dict(model="vlm", temperature=0, max_tokens=MAX_TOKENS,
                  extra_body={"ignore_eos": True})
    by_url = client.chat.completions.create(messages=messages(image_server + "/cat.png"),
                                            **kwargs)
    by_data = client.chat.completions.create(messages=messages(png_data_url(IMAGE)), **kwargs)
    assert by_url.choices[0].message.content == by_data.choices[0].message.content
