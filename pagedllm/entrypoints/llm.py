"""LLM: offline batch generation (vLLM's `LLM` class).

    llm = LLM("path/to/checkpoint")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=16))

`generate` / `chat` without sampling params use `get_default_sampling_params()`: the model's
recommended defaults (its generation config, see `generation_config.get_diff_sampling_param`) over
SamplingParams' own, as vLLM does. A SamplingParams that is passed is used as it is.
"""

from __future__ import annotations

import copy
import inspect
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from tqdm import tqdm

from pagedllm.config import create_engine_config
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.beam_search import BeamSearchOutput, BeamSearchParams, run_beam_search
from pagedllm.engine.input_processor import PromptType
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.pooling_engine import EmbedPrompt, PoolingEngine, is_pooling_model
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling.outputs import EmbeddingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class GenerateError(ValueError):
    """Some requests of a `generate` call were invalid; the valid ones still ran.

    Attributes:
        errors: {input index: message} of the rejected requests.
        outputs: one entry per input: the RequestOutput, or None for a rejected request.
    """

    def __init__(self, errors: dict[int, str], outputs: list[RequestOutput | None]) -> None:
        details = "; ".join(f"request {i}: {msg}" for i, msg in sorted(errors.items()))
        super().__init__(f"{len(errors)} of {len(outputs)} requests were rejected ({details})")
        self.errors = errors
        self.outputs = outputs


def chat_prompt_token_ids(tokenizer, conversation: list[dict[str, str]],
                          add_generation_prompt: bool = True,
                          chat_template: str | None = None) -> list[int]:
    """One conversation ([{"role": ..., "content": ...}, ...]) rendered with the chat template
    (`chat_template`, else the tokenizer's own) and tokenized.

    Raises:
        ValueError: the tokenizer has no chat template and none is given.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; pass chat_template=... (or "
                         "LLM(..., chat_template=...), --chat-template on the command line)")
    return list(tokenizer.apply_chat_template(
        conversation, tokenize=True, add_generation_prompt=add_generation_prompt,
        chat_template=chat_template, return_dict=False))


def has_content_parts(conversation: list[dict[str, Any]], non_text: bool = False) -> bool:
    """Whether some message's content is a list of content parts (not a plain string); with
    `non_text`, a list holding a part whose type is not "text" (an image)."""
    return any(isinstance(m.get("content"), list) and (not non_text or any(
        not isinstance(p, dict) or p.get("type") != "text" for p in m["content"]))
        for m in conversation if isinstance(m, dict))


def _per_prompt(value: Any, one: type | tuple[type, ...], num_prompts: int, what: str) -> list:
    """`value` for every prompt: one `one` (or None) for all, or a sequence of one per prompt.

    Raises:
        ValueError: a sequence whose length is not the number of prompts.
    """
    if value is None or isinstance(value, one):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(f"got {len(values)} {what} for {num_prompts} prompts; give one, or one "
                         "per prompt")
    return values


class LLM:
    """Offline generation over the paged-KV engine.

    Args:
        model: checkpoint folder, hub id or .gguf file (tokenizer, chat template and special
            tokens from its metadata unless `tokenizer=` is given); None = the shipped default
            model.
        **engine_args: engine arguments by vLLM's names (dtype, max_model_len, block_size,
            max_num_seqs, max_num_batched_tokens, enable_prefix_caching, kv_cache_memory_bytes,
            gpu_memory_utilization, seed, generation_config ("auto" | "vllm" | a folder),
            override_generation_config, ...). With runner="pooling" also `pooling_type`
            ("MEAN" | "CLS" | "LAST") and `normalize`, the model's pooling defaults.
        runner: "generate", "pooling" (embeddings, `embed`; docs/embeddings.md) or "auto"
            (pooling for architectures without an LM head, e.g. BertModel).
        multiprocess_mode: run the engine core in its own process (engine/core_client.py;
            default False: in this process, as vLLM's LLM). Not with runner="pooling".
    """

    def __init__(self, model: str | None = None, runner: str = "auto",
                 multiprocess_mode: bool = False, **engine_args: Any) -> None:
        if model is None:
            from pagedllm.assets import default_model_path
            model = default_model_path()
        if runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be 'auto', 'generate' or 'pooling', got {runner!r}")
        if runner == "auto":
            runner = "pooling" if is_pooling_model(model, engine_args.get("revision")) \
                else "generate"
        self.runner = runner
        if runner == "pooling" and multiprocess_mode:
            raise ValueError("multiprocess_mode is not supported with runner='pooling'")
        if runner == "pooling":
            self.llm_engine = PoolingEngine.from_engine_args(model, **engine_args)
        else:
            known = inspect.signature(create_engine_config).parameters
            unknown = sorted(set(engine_args) - set(known))
            if unknown:
                raise TypeError(f"LLM() got unknown engine arguments {unknown}; the engine "
                                f"arguments are those of pagedllm.config.create_engine_config")
            self.llm_engine = LLMEngine.from_engine_args(model, multiprocess_mode,
                                                         **engine_args)
            defaults = self.llm_engine.config.default_sampling_params
            if defaults:
                logger.info("Using default sampling params from model generation config: %s "
                            "(generation_config='vllm' ignores them)", defaults)

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The SamplingParams of a `generate` / `chat` call that passes none: the model's
        default sampling parameters (`EngineConfig.default_sampling_params`), the built-in
        defaults for the other fields. A new object on each call."""
        self._require_runner("generate")
        return SamplingParams(**self.llm_engine.config.default_sampling_params)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        Args:
            prompts: a string, a list of token ids, a dict {"prompt"| "prompt_token_ids"}, or a
                list of any of these.
            sampling_params: one for all prompts, or one per prompt; None =
                `get_default_sampling_params()` (the model's defaults). A SamplingParams given
                is used as it is: its fields are never replaced by the model's defaults.
            use_tqdm: show a progress bar.
            lora_request: the LoRA adapter of every prompt, or one per prompt (None: the base
                model); needs an engine started with enable_lora=True (docs/lora.md).
            priority: one for all prompts or one per prompt (lower first), with
                scheduling_policy="priority" (vLLM's).

        Raises:
            GenerateError (a ValueError): after the valid requests have finished, if any request
                was invalid or failed alone inside a step (e.g. its logits processor raised; its
                output then has finish_reason "error"); it carries the outputs of the others.
            ValueError: if the number of sampling params, LoRA requests or priorities does not
                match the prompts.
            Any exception of the engine itself (e.g. the model forward): the requests of this
                call are aborted first, so the `LLM` stays usable for the next call.
        """
        self._require_runner("generate")
        prompts = self._as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _per_prompt(sampling_params, SamplingParams, len(prompts),
                                  "sampling params")
        lora_list = _per_prompt(lora_request, LoRARequest, len(prompts), "LoRA requests")
        priorities = _per_prompt(0 if priority is None else priority, int, len(prompts),
                                 "priorities")
        engine = self.llm_engine
        index_of: dict[str, int] = {}
        errors: dict[int, str] = {}
        for i, (prompt, params, lora, prio) in enumerate(zip(prompts, params_list, lora_list,
                                                              priorities)):
            req_id = engine.next_request_id()
            try:
                if not isinstance(params, SamplingParams):
                    raise ValueError(f"sampling params must be a SamplingParams, got "
                                     f"{type(params).__name__}")
                if params.output_kind != RequestOutputKind.FINAL_ONLY:
                    # generate returns whole outputs: only the final one is needed (as vLLM).
                    params = copy.copy(params)
                    params.output_kind = RequestOutputKind.FINAL_ONLY
                engine.add_request(req_id, prompt, params, lora_request=lora, priority=prio)
            except ValueError as e:
                errors[i] = str(e)
                continue
            index_of[req_id] = i
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        try:
            with tqdm(total=len(index_of), disable=not use_tqdm, desc="Processed prompts",
                      dynamic_ncols=True) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            outputs[index_of[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            # An engine fault or KeyboardInterrupt: free this call's requests before raising.
            engine.abort_request([r for r, i in index_of.items() if outputs[i] is None])
            raise
        for i in index_of.values():
            error = outputs[i].error
            if error is not None:
                errors[i] = error
        if errors:
            raise GenerateError(errors, outputs)
        return outputs  # type: ignore[return-value]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template: str | None = None,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
             ) -> list[RequestOutput]:
        """Render conversation(s) with the tokenizer's chat template, then `generate` (under
        `lora_request`: one for all conversations or one each).

        A message's content may be a list of OpenAI content parts: {"type": "text", "text"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}} and
        {"type": "image_pil", "image_pil": PIL image}; such conversations (vision-language
        models only) are rendered by the model's processor (docs/multimodal.md).

        Raises:
            ValueError: an empty conversation, or the tokenizer has no chat template and none
                is given.
        """
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        for i, conv in enumerate(conversations):
            if not conv:
                raise ValueError(f"conversation {i} is empty (no messages)")
        tokenizer = self.get_tokenizer()
        mm = self.llm_engine.input_processor.mm_processor
        prompts: list[PromptType] = []
        for conv in conversations:
            if mm is None and has_content_parts(conv, non_text=True):
                raise ValueError("messages: this model takes text only; image content parts "
                                 "need a vision-language model")
            if mm is not None and has_content_parts(conv):
                text, images = mm.render_chat(conv, add_generation_prompt, chat_template)
                prompts.append({"prompt": text, "multi_modal_data": {"image": images}})
            else:
                prompts.append({"prompt_token_ids": chat_prompt_token_ids(
                    tokenizer, conv, add_generation_prompt, chat_template)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm,
                             lora_request=lora_request)

    def beam_search(self, prompts: Sequence[PromptType],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search per prompt (see pagedllm/beam_search.py for the algorithm and score).

        Raises:
            ValueError: for an invalid prompt, or one with images.
        """
        ids = []
        for prompt in self._as_prompt_list(prompts):
            core_req, _ = self.llm_engine.input_processor.process("beam", prompt,
                                                                   SamplingParams(max_tokens=1))
            if core_req.mm_features:
                raise ValueError("beam search does not take prompts with images yet")
            ids.append(core_req.prompt_token_ids)
        return run_beam_search(self, ids, params)

    def embed(self, prompts: EmbedPrompt | Sequence[EmbedPrompt],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              use_tqdm: bool = False) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (needs runner="pooling"); outputs come back in input order.

        Args:
            prompts: a string, a list of token ids, a dict, or a list of any of these.
            pooling_params: one for all prompts or one per prompt; overrides pooling_type,
                normalize and sets truncate_prompt_tokens.
            use_tqdm: accepted for vLLM compatibility; no progress bar is shown.

        Raises:
            ValueError: for an engine not started with runner="pooling", or an invalid prompt
                (over-long without truncate_prompt_tokens, empty, ids outside the vocabulary).
        """
        self._require_runner("pooling")
        return self.llm_engine.encode(self._as_prompt_list(prompts), pooling_params)

    def _require_runner(self, runner: str) -> None:
        if self.runner != runner:
            raise ValueError(f"this LLM was started with runner={self.runner!r}; this call "
                             f"needs runner={runner!r}")

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry; returns how many blocks were uncached."""
        return self.llm_engine.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.llm_engine.get_stats()

    def sleep(self, level: int = 1) -> None:
        """Put the engine to sleep (vLLM's `LLM.sleep`; needs enable_sleep_mode=True): level 1
        frees the KV cache and moves the weights to host memory (on the CPU they stay), level
        2 frees both (`wake_up` reloads the weights from the checkpoint last loaded). The
        prefix cache is dropped; `generate` raises EngineSleepingError until `wake_up`.
        docs/sleep_mode.md.

        Raises:
            ValueError: sleep mode not enabled, a bad level, or level 2 where weights cannot
                be reloaded (GGUF, LoRA, EPLB, a draft model).
        """
        self._require_runner("generate")
        self.llm_engine.sleep(level)

    def wake_up(self) -> None:
        """Weights back and an empty KV cache again (a no-op when awake).

        Raises:
            ValueError, FileNotFoundError: after level 2, the checkpoint cannot be reloaded.
        """
        self._require_runner("generate")
        self.llm_engine.wake_up()

    def is_sleeping(self) -> bool:
        self._require_runner("generate")
        return self.llm_engine.is_sleeping()

    def update_weights(self, model_path: str) -> None:
        """Load the weights of the checkpoint folder `model_path` in place on every rank,
        without a restart (same architecture and tensor shapes; the engine's config stays).
        The prefix cache is dropped.

        Raises:
            ValueError: weights that do not fit (the old weights keep serving), naming the
                first mismatching tensors.
        """
        self._require_runner("generate")
        self.llm_engine.update_weights(model_path)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        """Call the public Worker method `method(*args)` on every rank (vLLM's
        `collective_rpc`; a method name only, never a callable); the results by rank. E.g.
        `collective_rpc("stage_weights", (path,))`, then `"commit_weights"` (or
        `"discard_weights"` where a rank refused) is `update_weights` without its prefix-cache
        reset (call `reset_prefix_cache()` after).

        Raises:
            ValueError: `method` is not a public Worker method, or one whose state the engine
                keeps (sleep, wake_up, execute_model, ...: use the engine's own methods).
        """
        self._require_runner("generate")
        return self.llm_engine.collective_rpc(method, args)

    @staticmethod
    def _as_prompt_list(prompts) -> list[PromptType]:
        if isinstance(prompts, (str, dict)):
            return [prompts]
        if not isinstance(prompts, Iterable):
            raise TypeError(f"prompts must be a string, a list of token ids, a dict or a list of "
                            f"these, got {type(prompts).__name__}")
        prompts = list(prompts)
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        return prompts
