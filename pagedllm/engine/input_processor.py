"""InputProcessor: prompt (text, token ids or a dict of either) -> validated EngineCoreRequest.

Everything that can be wrong with one request is found here and raised as a ValueError whose
message starts with the offending field's name where there is one, before the request touches the
engine (the server maps that name to the error's `param`).
"""

from __future__ import annotations

import functools
import time
from typing import Any

from pagedllm.config import KVTransferConfig, RequestLimits
from pagedllm.core.kv_cache_groups import KVCacheCapacity
from pagedllm.core.kv_connector.p2p_shm import check_remote_prefill_params
from pagedllm.core.request_queue import check_priority
from pagedllm.engine.engine_core import EngineCoreRequest
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.sampling_params import SamplingParams, check_text
from pagedllm.structured_output.manager import build_grammar

PromptType = str | list[int] | dict[str, Any]


def check_prompt_token_ids(token_ids: list[int], vocab_size: int) -> None:
    """Raises ValueError for an empty prompt or ids outside [0, vocab_size)."""
    if not token_ids:
        raise ValueError("the prompt is empty (no tokens)")
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary "
                         f"[0, {vocab_size})")


def context_length_error(max_model_len: int, num_prompt_tokens: int,
                         max_tokens: int | None) -> str | None:
    """The refusal of a prompt of `num_prompt_tokens` tokens asking for `max_tokens` output
    tokens (None: no explicit cap) under a context of `max_model_len` tokens, or None when it
    fits. One wording for the server (HTTP 400) and the command line; the message follows
    the OpenAI API's context-length error, as vLLM's does."""
    if num_prompt_tokens < max_model_len and (
            max_tokens is None or num_prompt_tokens + max_tokens <= max_model_len):
        return None
    requested = num_prompt_tokens + (max_tokens or 0)
    return (f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {requested} tokens ({num_prompt_tokens} in the prompt, "
            f"{max_tokens or 0} for the completion). Please reduce the length of the prompt "
            f"or the completion.")


class InputProcessor:
    """Tokenize and validate prompts: the engine's one admission gate.

    Every request, offline (`LLM.generate`) and served, passes `process` once, before it is
    queued and before any byte of a response is sent. A request that passes cannot fail inside
    a step because of its own parameters (what still can - a user logits processor - fails that
    request alone).

    Args:
        tokenizer: transformers tokenizer of the model.
        max_model_len: context length in tokens.
        vocab_size: the model's vocabulary size (token ids must be below it).
        eos_token_ids: the model's EOS ids (added to each request's stop ids unless ignore_eos).
        limits: caps on n, logprobs and logit_bias entries.
        kv_cache_capacity: what one request can hold in the KV cache, per KV cache group (the
            scheduler's own `kv_cache_capacity`: a request it would refuse is refused here);
            None = unchecked.
        scheduling_policy: the scheduler's ("fcfs" refuses a non-zero priority).
        mm_processor: the image processing of a vision-language model
            (`multimodal.processing.MultiModalProcessor`); None = a text-only model, whose
            prompts may carry no images.
    """

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: tuple[int, ...], limits: RequestLimits = RequestLimits(),
                 kv_cache_capacity: KVCacheCapacity | None = None,
                 scheduling_policy: str = "fcfs", mm_processor=None,
                 kv_transfer_config: KVTransferConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.kv_transfer_config = kv_transfer_config
        self.mm_processor = mm_processor
        self.scheduling_policy = scheduling_policy
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self.kv_cache_capacity = kv_cache_capacity

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams,
                priority: int = 0) -> tuple[EngineCoreRequest, str | None]:
        """Returns the core request and the prompt text (None for token-id prompts).

        `priority` orders the request under the priority scheduling policy (lower first).

        Raises:
            ValueError: naming the problem: an empty prompt, token ids outside the vocabulary
                (prompt, stop_token_ids, logit_bias, allowed_token_ids), a prompt longer than
                max_model_len, a request the KV cache can never hold, a parameter over its cap
                (n, logprobs, prompt_logprobs, logit_bias), a structured-output spec that does
                not parse, a malformed prompt object, or a non-zero priority under fcfs.
        """
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params)}")
        check_priority(priority, self.scheduling_policy)
        mm_features: list[MultiModalFeature] = []
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") is not None:
            prompt_text, token_ids, mm_features = self._process_multimodal(prompt, params)
        else:
            prompt_text, token_ids = self._tokenize(prompt, params.truncate_prompt_tokens)
            if isinstance(prompt, dict) and prompt.get("mm_features"):
                # Token ids with their images already processed (the server's chat path).
                mm_features = self._check_features(prompt["mm_features"], params)
        if params.truncate_prompt_tokens is not None:
            token_ids = token_ids[-params.truncate_prompt_tokens:]
        check_prompt_token_ids(token_ids, self.vocab_size)
        self._check_params(params)
        self._check_kv_transfer_params(params)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens, more than max_model_len "
                             f"({self.max_model_len})")
        room = max(1, self.max_model_len - len(token_ids))
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if self.kv_cache_capacity is not None:
            try:
                self.kv_cache_capacity.check(len(token_ids), max_tokens)
            except ValueError as e:
                raise ValueError(f"max_tokens: {e}") from None
        params.update_from_generation_config(self.eos_token_ids)
        return (EngineCoreRequest(request_id, token_ids, params, max_tokens, time.monotonic(),
                                  priority, mm_features=mm_features or None), prompt_text)

    def _check_kv_transfer_params(self, params: SamplingParams) -> None:
        """A remote-prefill request to a P2pShmConnector consumer names its configured peer
        (`check_remote_prefill_params`); ValueError otherwise."""
        kv = (params.extra_args or {}).get("kv_transfer_params")
        config = self.kv_transfer_config
        if (kv and kv.get("do_remote_prefill") and config is not None
                and config.kv_connector == "P2pShmConnector" and config.kv_role == "kv_consumer"):
            check_remote_prefill_params(kv, config.kv_ip, config.kv_port, params.prompt_logprobs)

    def _process_multimodal(self, prompt: dict[str, Any], params: SamplingParams
                            ) -> tuple[str, list[int], list[MultiModalFeature]]:
        """A {"prompt": text with image placeholders, "multi_modal_data": {"image": one or a
        list}} prompt through the model's processor.

        Raises:
            ValueError: naming the problem: a text-only model, an unknown modality, truncation
                asked for, a bad or oversized image, too many images, an image whose
                embeddings cannot fit the encoder's budget or cache.
        """
        data = prompt["multi_modal_data"]
        if self.mm_processor is None:
            raise ValueError("multi_modal_data: this model takes text only (no images)")
        if not isinstance(data, dict) or set(data) - {"image"}:
            raise ValueError("multi_modal_data must be a dict {'image': image or list of "
                             "images}")
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        text = prompt.get("prompt")
        if not isinstance(text, str):
            raise ValueError("prompt: a prompt with multi_modal_data needs the text 'prompt'")
        check_text("prompt", text)
        if len(text) > self.max_prompt_chars(self.max_model_len):
            raise ValueError(f"prompt: {len(text)} characters cannot fit max_model_len "
                             f"({self.max_model_len}) tokens")
        token_ids, features = self.mm_processor.process(text, data.get("image", []))
        return text, token_ids, self._check_features(features, params)

    def _check_features(self, features: list, params: SamplingParams
                        ) -> list[MultiModalFeature]:
        """Processed images checked against the encoder's budget and cache.

        Raises:
            ValueError: a text-only model, truncation asked for, a malformed feature, or an
                image with more embeddings than max_num_encoder_input_tokens or
                encoder_cache_size (it could never be scheduled).
        """
        if self.mm_processor is None:
            raise ValueError("multi_modal_data: this model takes text only (no images)")
        if params.truncate_prompt_tokens is not None:
            raise ValueError("truncate_prompt_tokens cannot cut a prompt with images")
        config = self.mm_processor.config
        cap = min(config.encoder_cache_size, config.max_num_encoder_input_tokens)
        for i, f in enumerate(features):
            if not isinstance(f, MultiModalFeature):
                raise ValueError("mm_features must be MultiModalFeature objects")
            if f.num_embeds > cap:
                raise ValueError(f"multi_modal_data: image {i} needs {f.num_embeds} embeddings, "
                                 f"more than the encoder's budget of {cap} "
                                 "(max_num_encoder_input_tokens, encoder_cache_size)")
            step = (None if self.kv_cache_capacity is None
                    else self.kv_cache_capacity.max_num_scheduled_tokens)
            if f.bidirectional and step is not None and f.length > step:
                raise ValueError(f"multi_modal_data: image {i} spans {f.length} tokens, which "
                                 f"this model computes in one step; more than the "
                                 f"{step} tokens a step takes (max_num_batched_tokens)")
        return list(features)

    def _check_params(self, params: SamplingParams) -> None:
        """Checks that need the model, the tokenizer or the engine's caps; fills the bad words'
        token ids."""
        limits = self.limits
        if params.n > limits.max_n:
            raise ValueError(f"n must be <= {limits.max_n} (the engine's max_n), got {params.n}")
        max_logprobs = self.vocab_size if limits.max_logprobs < 0 else limits.max_logprobs
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise ValueError(f"{name} must be <= {max_logprobs} (the engine's max_logprobs), "
                                 f"got {value}")
        if params.logit_bias is not None and len(params.logit_bias) > limits.max_logit_bias:
            raise ValueError(f"logit_bias may have at most {limits.max_logit_bias} entries, got "
                             f"{len(params.logit_bias)}")
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = [t for t in getattr(params, name) or () if t >= self.vocab_size]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if not params.detokenize and params.stop:
            raise ValueError("stop strings need detokenize=True")
        if params.structured_outputs is not None:
            build_grammar(params.structured_outputs)
        params._bad_words_token_ids = []
        if params.bad_words:
            # As vLLM: ban each word both as is and with a leading space (one batched call).
            variants = [v for w in params.bad_words for v in (w.strip(), " " + w.strip())]
            seen: set[tuple[int, ...]] = set()
            for seq in self.tokenizer(variants, add_special_tokens=False).input_ids:
                if seq and tuple(seq) not in seen:
                    seen.add(tuple(seq))
                    params._bad_words_token_ids.append(list(seq))

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's text in characters (an upper bound of what one token covers)."""
        tokens = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
        return max((len(t) for t in tokens if t), default=1)

    def max_prompt_chars(self, num_tokens: int) -> int:
        """Characters beyond which a text surely has more than `num_tokens` tokens (with a 4x
        margin for normalizers that merge characters)."""
        return num_tokens * self.max_token_chars * 4

    def tokenize(self, text: str, truncate_prompt_tokens: int | None = None) -> list[int]:
        """Token ids of a text prompt, refusing a text too long to fit max_model_len before
        tokenizing it (a multi-megabyte prompt would otherwise cost seconds and memory first).
        With `truncate_prompt_tokens`, only the text's tail that can hold that many tokens is
        tokenized.

        Raises:
            ValueError: (naming `prompt`) the text cannot fit max_model_len tokens.
        """
        check_text("prompt", text)
        limit = self.max_prompt_chars(truncate_prompt_tokens or self.max_model_len)
        if truncate_prompt_tokens is not None:
            text = text[-limit:]
        elif len(text) > limit:
            raise ValueError(f"prompt: {len(text)} characters cannot fit max_model_len "
                             f"({self.max_model_len}) tokens")
        return list(self.tokenizer(text).input_ids)

    def _tokenize(self, prompt: PromptType, truncate_prompt_tokens: int | None = None
                  ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenize(prompt, truncate_prompt_tokens)
        if isinstance(prompt, (list, tuple)):
            return None, self._check_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, "
                         f"got {type(prompt).__name__}")

    @staticmethod
    def _check_ids(ids) -> list[int]:
        if not isinstance(ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt token ids must be a list of ints")
        return list(ids)
