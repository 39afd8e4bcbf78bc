"""vLLM's chat and completion extras on a real server (issue #41): continue_final_message, a
request's own chat_template (behind --trust-request-chat-template), documents, reasoning_effort,
return_tokens_as_token_ids, prompt_logprobs on chat, beam search on the server, request_id,
thinking_token_budget, mm_processor_kwargs, vllm_xargs; and `priority` (issue #43).

Two servers: the tool-calling tiny Llama (a `<think>` tokenizer, `--reasoning-parser
deepseek_r1`, request templates trusted, fcfs) and the shipped model (request templates refused,
no reasoning parser, `--scheduling-policy priority`), whose beam search is compared with
`LLM.beam_search`.
"""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

import httpx
import pytest
import transformers

from pagedllm import LLM
from pagedllm.beam_search import BeamSearchParams
from tests.entrypoints.openai.server_process import running_server

ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "16000000", "--seed", "0",
                "--uvicorn-log-level", "warning"]
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
# A request template that shows what reached it: the roles, the documents and the effort.
REQUEST_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}\n{% endfor %}"
    "{% for d in documents or [] %}<doc {{ d['title'] }}>{{ d['text'] }}</doc>\n{% endfor %}"
    "effort={{ reasoning_effort }}\n{% if add_generation_prompt %}[assistant]{% endif %}")


@pytest.fixture(scope="module")
def tool_server(tool_model: Path):
    args = ["--model", str(tool_model), "--served-model-name", "tools",
            "--reasoning-parser", "deepseek_r1", "--trust-request-chat-template", *ENGINE_FLAGS]
    with running_server(args) as (_, url):
        yield url


@pytest.fixture(scope="module")
def shipped_server():
    with running_server(["--served-model-name", "shakespeare", "--scheduling-policy", "priority",
                         *ENGINE_FLAGS]) as (_, url):
        yield url


@pytest.fixture(scope="module")
def tokenizer(tool_model: Path):
    return transformers.AutoTokenizer.from_pretrained(tool_model)


def _post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def _chat(url: str, **body) -> dict:
    response = _post(url, "/v1/chat/completions", {"temperature": 0, "max_tokens": 8, **body})
    assert response.status_code == 200, response.text
    return response.json()


def _token_ids(choice: dict) -> list[int]:
    """The generated ids of a chat choice asked with return_tokens_as_token_ids."""
    tokens = [entry["token"] for entry in choice["logprobs"]["content"]]
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":")[1]) for t in tokens]


def _prompt_ids(response: dict) -> list[int]:
    """The prompt's ids from prompt_logprobs=0 (each position holds its own token)."""
    first, *rest = response["prompt_logprobs"]
    assert first is None
    return [None] + [int(next(iter(entry))) for entry in rest]


def test_continue_final_message_continues_the_assistant_text(tool_server, tokenizer) -> None:
    messages = [*MESSAGES, {"role": "assistant", "content": "The sea is"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False,
                                             continue_final_message=True)
    assert rendered.endswith("The sea is")       # open-ended: no end of turn after it
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    chat = _chat(tool_server, messages=messages, add_generation_prompt=False,
                 continue_final_message=True, logprobs=True, return_tokens_as_token_ids=True,
                 prompt_logprobs=0)
    assert _prompt_ids(chat)[1:] == ids[1:] and chat["usage"]["prompt_tokens"] == len(ids)
    completion = _post(tool_server, "/v1/completions", {"prompt": ids, "max_tokens": 8,
                                                        "temperature": 0, "logprobs": 0,
                                                        "return_tokens_as_token_ids": True})
    tokens = completion.json()["choices"][0]["logprobs"]["tokens"]
    assert _token_ids(chat["choices"][0]) == [int(t.split(":")[1]) for t in tokens]
    # /tokenize renders the same prompt.
    tokenized = _post(tool_server, "/tokenize", {"messages": messages,
                                                 "add_generation_prompt": False,
                                                 "continue_final_message": True})
    assert tokenized.json()["tokens"] == ids


def test_request_template_gets_documents_and_reasoning_effort(tool_server, tokenizer) -> None:
    documents = [{"title": "tides", "text": "The moon pulls the sea."}]
    chat = _chat(tool_server, messages=MESSAGES, chat_template=REQUEST_TEMPLATE,
                 documents=documents, reasoning_effort="low", prompt_logprobs=0)
    expected = ("[user]Tell me about the sea.\n<doc tides>The moon pulls the sea.</doc>\n"
                "effort=low\n[assistant]")
    ids = tokenizer.encode(expected, add_special_tokens=False)
    assert _prompt_ids(chat)[1:] == ids[1:] and chat["usage"]["prompt_tokens"] == len(ids)


def test_prompt_logprobs_equal_completion_echo_logprobs(tool_server, tokenizer) -> None:
    chat = _chat(tool_server, messages=MESSAGES, prompt_logprobs=2)
    ids = tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True,
                                        return_dict=False)
    echo = _post(tool_server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True,
                                                  "logprobs": 2, "temperature": 0}).json()
    expected = echo["choices"][0]["logprobs"]["token_logprobs"][:len(ids)]
    prompt_logprobs = chat["prompt_logprobs"]
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for token_id, entry, logprob in zip(ids[1:], prompt_logprobs[1:], expected[1:]):
        assert 1 <= len(entry) <= 3 and str(token_id) in entry
        assert entry[str(token_id)]["logprob"] == pytest.approx(logprob, abs=1e-5)
        assert entry[str(token_id)]["decoded_token"] is not None


def test_return_tokens_as_token_ids_keeps_values_and_offsets(tool_server) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 2,
            "echo": True}
    plain = _post(tool_server, "/v1/completions", body).json()["choices"][0]
    as_ids = _post(tool_server, "/v1/completions",
                   {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
    assert as_ids["text"] == plain["text"]
    assert as_ids["logprobs"]["text_offset"] == plain["logprobs"]["text_offset"]
    assert as_ids["logprobs"]["token_logprobs"] == plain["logprobs"]["token_logprobs"]
    assert all(t.startswith("token_id:") for t in as_ids["logprobs"]["tokens"])
    for top in as_ids["logprobs"]["top_logprobs"][1:]:
        assert all(key.startswith("token_id:") for key in top)
    chat = _chat(tool_server, messages=MESSAGES, logprobs=True, top_logprobs=2,
                 return_tokens_as_token_ids=True)["choices"][0]["logprobs"]["content"]
    assert all(alt["token"].startswith("token_id:") for entry in chat
               for alt in entry["top_logprobs"])


def test_request_id_is_echoed(tool_server) -> None:
    response = _post(tool_server, "/v1/chat/completions",
                     {"messages": MESSAGES, "max_tokens": 2, "request_id": "my-id-1"})
    assert response.json()["id"] == "chatcmpl-my-id-1"
    assert response.headers["x-request-id"] == "my-id-1"
    with httpx.stream("POST", tool_server + "/v1/completions", timeout=60, json={
            "prompt": "Hi", "max_tokens": 2, "stream": True, "request_id": "s-1"}) as stream:
        assert stream.headers["x-request-id"] == "s-1"
        assert '"id":"cmpl-s-1"' in stream.read().decode()
    # The same id twice at once: both are served (the engine ids stay unique).
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: _post(tool_server, "/v1/completions", {
            "prompt": "Hi", "max_tokens": 4, "request_id": "twice"}), range(4)))
    assert all(a.status_code == 200 and a.json()["id"] == "cmpl-twice" for a in answers)


def test_thinking_token_budget_ends_the_reasoning(tool_server, tokenizer) -> None:
    end = tokenizer.convert_tokens_to_ids("</think>")
    # </think> banned: without a budget the random model reasons to the end of max_tokens.
    banned = {"logit_bias": {str(end): -100}, "max_tokens": 12, "ignore_eos": True,
              "logprobs": True, "return_tokens_as_token_ids": True}
    free = _chat(tool_server, messages=MESSAGES, **banned)
    assert free["usage"]["completion_tokens_details"]["reasoning_tokens"] == 12
    for budget in (0, 3):
        capped = _chat(tool_server, messages=MESSAGES, thinking_token_budget=budget, **banned)
        ids = _token_ids(capped["choices"][0])
        assert ids.index(end) == budget        # `budget` reasoning tokens, then the end marker
        assert capped["usage"]["completion_tokens_details"]["reasoning_tokens"] == budget + 1
        # Up to the budget the reasoning is the one the model gives without it.
        assert ids[:budget] == _token_ids(free["choices"][0])[:budget]


def test_mm_processor_kwargs_without_images_change_nothing(tool_server) -> None:
    plain = _chat(tool_server, messages=MESSAGES)
    with_kwargs = _chat(tool_server, messages=MESSAGES, mm_processor_kwargs={"do_resize": True})
    assert with_kwargs["choices"][0]["message"] == plain["choices"][0]["message"]


@pytest.mark.parametrize("path,body,param,message", [
    ("/v1/chat/completions", {"messages": MESSAGES, "continue_final_message": True},
     "continue_final_message", "add_generation_prompt: false"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs", "stream"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt_logprobs": 21},
     "prompt_logprobs", "prompt_logprobs must be in"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "low",
                              "chat_template_kwargs": {"reasoning_effort": "high"}},
     "reasoning_effort", "not both"),
    ("/v1/chat/completions", {"messages": MESSAGES, "reasoning_effort": "max"},
     "reasoning_effort", ""),
    ("/v1/chat/completions", {"messages": MESSAGES, "thinking_token_budget": -1},
     "thinking_token_budget", ""),
    ("/v1/chat/completions", {"messages": MESSAGES, "request_id": "a\r\nX-Evil: 1"},
     "request_id", ""),
    ("/v1/chat/completions", {"messages": MESSAGES, "request_id": ""}, "request_id", ""),
    ("/v1/chat/completions", {"messages": MESSAGES, "vllm_xargs": {"my_knob": 1}},
     "vllm_xargs", "'my_knob'"),
    ("/v1/completions", {"prompt": "Hi", "length_penalty": 0.5}, "length_penalty",
     "use_beam_search"),
    ("/v1/completions", {"prompt": "Hi", "priority": 1}, "priority",
     "needs the priority scheduling policy"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2, "top_p": 0.5},
     "top_p", "use_beam_search"),
    ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True, "n": 2,
                              "logprobs": True}, "top_logprobs", "use_beam_search"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 11}, "n",
     "max_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "use_beam_search": True, "n": 2,
                         "length_penalty": 400.0}, "length_penalty", "[-10, 10]"),
    ("/v1/chat/completions", {"messages": MESSAGES, "use_beam_search": True, "n": 2,
                              "stream": True, "length_penalty": -300.0}, "length_penalty",
     "[-10, 10]"),
    ("/v1/chat/completions", {"messages": [*MESSAGES, {"role": "user", "content": "x"}],
                              "chat_template": "{{ raise_exception('no') }}"},
     "messages", "could not render"),
])
def test_bad_extras_are_refused(tool_server, path, body, param, message) -> None:
    response = _post(tool_server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error
    assert _post(tool_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2}).status_code \
        == 200


def test_vllm_xargs_empty_is_accepted(tool_server) -> None:
    assert _chat(tool_server, messages=MESSAGES, vllm_xargs={})["choices"]


@pytest.mark.slow   # a second server; priority scheduling is checked in tests/core
def test_priority_on_a_priority_server(shipped_server) -> None:
    body = {"prompt": "ROMEO:", "max_tokens": 4, "temperature": 0}
    plain = _post(shipped_server, "/v1/completions", body).json()["choices"][0]["text"]
    for priority in (-3, 7):
        answer = _post(shipped_server, "/v1/completions", {**body, "priority": priority})
        assert answer.json()["choices"][0]["text"] == plain
    too_big = _post(shipped_server, "/v1/completions", {**body, "priority": 1 << 63})
    assert too_big.status_code == 400 and too_big.json()["error"]["param"] == "priority"


def test_untrusted_server_refuses_request_templates(shipped_server) -> None:
    response = _post(shipped_server, "/v1/chat/completions",
                     {"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in response.json()["error"]["message"]
    response = _post(shipped_server, "/v1/chat/completions",
                     {"messages": MESSAGES, "thinking_token_budget": 4})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "thinking_token_budget"


def test_server_beam_search_equals_llm_beam_search(shipped_server) -> None:
    prompt = "ROMEO:\nBut soft, what light"
    llm = LLM(dtype="float32", kv_cache_memory_bytes=16_000_000, seed=0)
    try:
        [expected] = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=8,
                                                                length_penalty=0.5))
        ids = llm.get_tokenizer().encode(prompt)
    finally:
        del llm
    body = {"prompt": prompt, "max_tokens": 8, "n": 3, "use_beam_search": True,
            "length_penalty": 0.5, "temperature": 0}
    answer = _post(shipped_server, "/v1/completions", body).json()
    assert [c["text"] for c in answer["choices"]] == [b.text for b in expected.sequences]
    assert answer["usage"]["completion_tokens"] == sum(
        len(b.tokens) - len(ids) for b in expected.sequences)
    with httpx.stream("POST", shipped_server + "/v1/completions", timeout=120,
                      json={**body, "stream": True}) as stream:
        lines = [line[len("data: "):] for line in stream.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    streamed = [""] * 3
    for line in lines[:-1]:
        for choice in json.loads(line)["choices"]:
            streamed[choice["index"]] += choice["text"]
    assert streamed == [b.text for b in expected.sequences]
    chat = _post(shipped_server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 6, "n": 2, "use_beam_search": True,
        "temperature": 0}).json()
    assert len(chat["choices"]) == 2 and all(c["finish_reason"] for c in chat["choices"])
