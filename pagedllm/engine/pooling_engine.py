"""PoolingEngine: the embedding front end: tokenizer -> length-sorted batches -> PoolingRunner.

    encode(prompts, params) -> tokenize (truncate or reject over-long prompts)
                            -> sort by length, pack batches under max_num_batched_tokens and
                               max_num_seqs -> one forward per batch -> outputs in input order

Embedding requests are finished in one forward and keep no KV state, so this engine has no
scheduler, no EngineCore and no executor: it runs the worker-side `PoolingRunner` in-process
(single process, tensor_parallel_size=1). It shares with the decoder path the config
(`create_engine_config`), the tokenizer loading, the platform, the model registry and loader,
the layers, the `Attention` layer and the attention backend. See docs/embeddings.md.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import AutoConfig

from pagedllm.config import EngineConfig, create_engine_config
from pagedllm.hf_config import hf_model_info
from pagedllm.engine.input_processor import check_prompt_token_ids
from pagedllm.engine.llm_engine import load_tokenizer
from pagedllm.logger import init_logger
from pagedllm.model_loader.hub import resolve_model_path
from pagedllm.models.registry import resolve_model_class
from pagedllm.platforms import current_platform
from pagedllm.pooling.outputs import EmbeddingOutput, EmbeddingRequestOutput
from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.st_config import PoolerConfig, read_st_pooler_config
from pagedllm.worker.pooling_runner import PoolingRequestData, PoolingRunner

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or a dict {"prompt": text} / {"prompt_token_ids": ids}.
EmbedPrompt = str | list[int] | dict[str, Any]


def is_pooling_model(model: str, revision: str | None = None) -> bool:
    """Whether `model`'s architecture can only embed (no LM head), e.g. BertModel."""
    info = hf_model_info(resolve_model_path(model, revision))
    return not hasattr(resolve_model_class(info.architectures), "compute_logits")


def default_pooler_config(model_path: str, causal: bool) -> PoolerConfig:
    """sentence-transformers' config when the folder has one; else LAST (decoders) or CLS
    (encoders), normalised, as vLLM defaults embedding models."""
    st = read_st_pooler_config(model_path)
    if st is not None:
        return st
    return PoolerConfig("LAST" if causal else "CLS", True)


@dataclass(frozen=True)
class _Tokenized:
    prompt: str | None
    token_ids: list[int]


def _refuse_generation_only_features(config: EngineConfig) -> None:
    """Raises ValueError naming the first set feature the pooling runner would leave unused
    (LoRA adapters, speculative decoding, a KV connector, sleep mode): one forward per prompt
    has no adapters, no decode steps and no KV cache to keep, offload or free."""
    for name, value in (("enable_lora", config.lora_config),
                        ("speculative_config", config.speculative_config),
                        ("kv_transfer_config", config.kv_transfer_config),
                        ("enable_sleep_mode", config.model_config.enable_sleep_mode)):
        if value:
            raise ValueError(f"{name} is not supported with runner='pooling' (embeddings); "
                             f"leave it unset or use runner='generate'")


class PoolingEngine:
    """Synchronous embedding engine.

    Args:
        config: a validated `EngineConfig` (KV-cache and scheduling-policy fields are unused;
            `max_num_batched_tokens` and `max_num_seqs` bound one forward).
        pooler_config: the model's pooling defaults (see `default_pooler_config`).
    """

    def __init__(self, config: EngineConfig, pooler_config: PoolerConfig) -> None:
        init_logger()
        current_platform.configure_options()    # every PAGEDLLM_* variable (pagedllm/envs.py)
        info = hf_model_info(config.model_path)
        resolve_model_class(info.architectures)
        self.config = config
        self.pooler_config = pooler_config
        self.max_model_len = config.max_model_len
        self.vocab_size = info.vocab_size
        self.tokenizer = load_tokenizer(config.tokenizer_path,
                                        config.model_config.trust_remote_code)
        _refuse_generation_only_features(config)
        pc = config.parallel_config
        if pc.tensor_parallel_size != 1 or pc.pipeline_parallel_size != 1:
            raise ValueError("the pooling runner is single-process: use tensor_parallel_size=1 "
                             "and pipeline_parallel_size=1")
        sc = config.scheduler_config
        if sc.max_num_batched_tokens < config.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({sc.max_num_batched_tokens}) must be >= "
                             f"max_model_len ({config.max_model_len}) for pooling: prompts are "
                             "never chunked")
        platform = current_platform
        platform.init_device(threads_bind=pc.cpu_threads_bind,
                             reserved_cores=pc.cpu_reserved_cores)
        platform.seed_everything(config.model_config.seed)
        hf_config = AutoConfig.from_pretrained(
            config.model_path, trust_remote_code=config.model_config.trust_remote_code)
        self.runner = PoolingRunner(config.model_path, hf_config, platform.device,
                                    platform.resolve_dtype(config.model_config.dtype),
                                    sc.max_num_batched_tokens, sc.max_num_seqs,
                                    config.cache_config.block_size)
        self.hidden_size = int(hf_config.hidden_size)
        self._ids = itertools.count()
        logger.info("pooling engine ready: model %s, max_model_len %d, pooling %s%s",
                    config.model_path, config.max_model_len, pooler_config.pooling_type,
                    " + normalize" if pooler_config.normalize else "")

    @classmethod
    def from_engine_args(cls, model: str, *, pooling_type: str | None = None,
                         normalize: bool | None = None, **kwargs: Any) -> PoolingEngine:
        """Build from flat engine arguments (as `LLMEngine.from_engine_args`), plus the model's
        default `pooling_type` / `normalize` overrides.

        max_model_len defaults to min(max_position_embeddings, sentence-transformers'
        max_seq_length); max_num_batched_tokens to max(2048, max_model_len).

        Raises:
            ValueError, FileNotFoundError: as `create_engine_config`, and for a bad pooling_type.
        """
        model_path = resolve_model_path(model, kwargs.get("revision"))
        info = hf_model_info(model_path)
        causal = bool(getattr(resolve_model_class(info.architectures), "causal", True))
        pooler = default_pooler_config(model_path, causal)
        override = PoolingParams(pooling_type=pooling_type, normalize=normalize)
        pooler = PoolerConfig(override.pooling_type or pooler.pooling_type,
                              pooler.normalize if normalize is None else normalize,
                              pooler.max_seq_length)
        if kwargs.get("max_model_len") is None and pooler.max_seq_length:
            kwargs["max_model_len"] = min(pooler.max_seq_length, info.max_position_embeddings)
        if kwargs.get("max_num_batched_tokens") is None:
            kwargs["max_num_batched_tokens"] = max(
                2048, kwargs.get("max_model_len") or info.max_position_embeddings)
        return cls(create_engine_config(model, **kwargs), pooler)

    # ------------------------------------------------------------------ requests
    def _tokenize(self, prompt: EmbedPrompt, truncate: int | None) -> _Tokenized:
        limit = self.max_model_len if truncate == -1 else truncate
        if limit is not None and limit > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({limit}) exceeds max_model_len "
                             f"({self.max_model_len})")
        text: str | None = None
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = prompt["prompt_token_ids"]
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            text = prompt
            if limit is None:
                ids = list(self.tokenizer(prompt).input_ids)
            else:
                ids = list(self.tokenizer(prompt, truncation=True, max_length=limit).input_ids)
        elif isinstance(prompt, (list, tuple)):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ValueError("prompt token ids must be ints")
            ids = list(prompt)[:limit] if limit is not None else list(prompt)
        else:
            raise ValueError(f"a prompt must be a string, a list of token ids or a dict, "
                             f"got {type(prompt).__name__}")
        check_prompt_token_ids(ids, self.vocab_size)
        if len(ids) > self.max_model_len:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than this model's maximum "
                             f"length (max_model_len) of {self.max_model_len}; shorten it or "
                             "pass truncate_prompt_tokens")
        return _Tokenized(text, ids)

    def _resolve(self, params: PoolingParams) -> tuple[str, bool]:
        return (params.pooling_type or self.pooler_config.pooling_type,
                self.pooler_config.normalize if params.normalize is None else params.normalize)

    def _batches(self, lens: list[int]) -> list[list[int]]:
        """Indices into `lens` packed into batches, longest first, under the budgets."""
        sc = self.config.scheduler_config
        batches: list[list[int]] = []
        tokens = 0
        for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
            if not batches or tokens + lens[i] > sc.max_num_batched_tokens \
                    or len(batches[-1]) >= sc.max_num_seqs:
                batches.append([])
                tokens = 0
            batches[-1].append(i)
            tokens += lens[i]
        return batches

    def encode(self, prompts: Sequence[EmbedPrompt],
               params: PoolingParams | Sequence[PoolingParams] | None = None
               ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt; outputs come back in input order.

        Args:
            prompts: a list of prompts (text, token ids, or a dict).
            params: one PoolingParams for all, or one per prompt (default PoolingParams()).

        Raises:
            ValueError: for an invalid prompt (naming its index), or a params count mismatch;
                nothing is run then.
        """
        prompts = list(prompts)
        params_list = ([params or PoolingParams()] * len(prompts)
                       if params is None or isinstance(params, PoolingParams) else list(params))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} pooling params for {len(prompts)} prompts; "
                             "give one, or one per prompt")
        tokenized = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            try:
                tokenized.append(self._tokenize(prompt, p.truncate_prompt_tokens))
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        req_ids = [str(next(self._ids)) for _ in prompts]
        requests = [PoolingRequestData(r, t.token_ids, *self._resolve(p))
                    for r, t, p in zip(req_ids, tokenized, params_list)]
        vectors: list[np.ndarray | None] = [None] * len(prompts)
        for batch in self._batches([len(t.token_ids) for t in tokenized]):
            pooled = self.runner.execute([requests[i] for i in batch])
            for row, i in enumerate(batch):
                vectors[i] = pooled[row]
        return [EmbeddingRequestOutput(r, t.prompt, t.token_ids, EmbeddingOutput(v.tolist()))
                for r, t, v in zip(req_ids, tokenized, vectors)]
