"""POST /tokenize (text or conversation -> token ids) and POST /detokenize (ids -> text), as vLLM.

Both are bounded before any tokenizer work, with the admission gate's own limits: a text longer
than `InputProcessor.max_prompt_chars(max_model_len)` characters (it surely cannot fit the
context) and more than `max_model_len` ids to decode are refused with 400. The tokenizer then runs
in a worker thread, so the event loop keeps answering other requests meanwhile. A text that passes
may still have more than `max_model_len` tokens: the count is reported, as vLLM does, so a client
can see by how much a prompt is too long.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from pagedllm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse,
                                                  TokenizeRequest, TokenizeResponse)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServingError

# A chat-form request -> its prompt token ids; raises OpenAIServingError.
ChatRenderer = Callable[[TokenizeRequest], list[int]]


class ServingTokenization:
    """Answers /tokenize and /detokenize with the served model's tokenizer.

    Args:
        tokenizer: the model's transformers tokenizer; it must not be one that another thread
            reconfigures (truncation, padding) while requests run.
        vocab_size: the model's vocabulary size (ids to decode must be below it).
        max_model_len: context length in tokens (reported, and the most ids one request may
            decode).
        max_prompt_chars: the longest text accepted (the admission gate's bound for
            max_model_len tokens).
        check_model: request `model` -> reported name; raises OpenAIServingError 404.
        render_chat: the chat endpoint's own rendering of a conversation to token ids, so the
            chat form counts exactly the prompt /v1/chat/completions would run; None: the chat
            form is refused with 400 (a server without chat).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int,
                 max_prompt_chars: int, check_model: Callable[[str | None], str],
                 render_chat: ChatRenderer | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_prompt_chars = max_prompt_chars
        self.check_model = check_model
        self.render_chat = render_chat

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of `request.prompt`, or of `request.messages` rendered by the chat template.

        Raises:
            OpenAIServingError: 404 unknown model; 400 naming the field for a text that cannot
                fit max_model_len, a chat form this server cannot render, or a chat template
                that fails on the messages.
        """
        self.check_model(request.model)
        if request.messages is not None:
            self._check_chat_form(request)
            token_ids = await asyncio.to_thread(self.render_chat, request)
        else:
            if len(request.prompt) > self.max_prompt_chars:
                raise OpenAIServingError(
                    f"prompt: {len(request.prompt)} characters cannot fit max_model_len "
                    f"({self.max_model_len}) tokens", 400, param="prompt")
            token_ids = await asyncio.to_thread(self._encode, request.prompt,
                                                request.add_special_tokens is not False)
        token_strs = None
        if request.return_token_strs:
            token_strs = await asyncio.to_thread(self.tokenizer.convert_ids_to_tokens, token_ids)
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len,
                                tokens=token_ids, token_strs=token_strs)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of `request.tokens` (special tokens included, as vLLM decodes them).

        Raises:
            OpenAIServingError: 404 unknown model; 400 naming `tokens` for more ids than
                max_model_len or ids outside [0, vocab_size).
        """
        self.check_model(request.model)
        tokens = request.tokens
        if len(tokens) > self.max_model_len:
            raise OpenAIServingError(
                f"tokens: {len(tokens)} ids are more than max_model_len ({self.max_model_len}); "
                f"no prompt or completion of this model is longer", 400, param="tokens")
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise OpenAIServingError(f"tokens: ids {bad[:5]} are outside the vocabulary "
                                     f"[0, {self.vocab_size})", 400, param="tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, tokens)
        return DetokenizeResponse(prompt=text)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def _check_chat_form(self, request: TokenizeRequest) -> None:
        if self.render_chat is None:
            raise OpenAIServingError("messages: this server has no chat template rendering (an "
                                     "embedding server); send `prompt` instead", 400,
                                     param="messages")
        if request.add_special_tokens:
            raise OpenAIServingError("add_special_tokens: true is not supported with messages "
                                     "(the chat template places the special tokens)", 400,
                                     param="add_special_tokens")


def add_tokenization_routes(app: FastAPI, tokenization: ServingTokenization) -> None:
    """Register POST /tokenize and POST /detokenize on `app` (vLLM's paths, outside /v1)."""

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.tokenize(body)).model_dump())

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.detokenize(body)).model_dump())
