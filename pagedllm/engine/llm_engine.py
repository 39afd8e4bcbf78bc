"""LLMEngine: the synchronous front end: tokenizer + InputProcessor + EngineCore + OutputProcessor.

    add_request(prompt, params) -> step() -> [RequestOutput, ...] until no request is left.
"""

from __future__ import annotations

import atexit
import copy
import gc
import itertools
import logging
import time
from typing import Any

from transformers import AutoTokenizer

from pagedllm.config import EngineConfig, create_engine_config
from pagedllm.hf_config import hf_model_info
from pagedllm.core.sched_output import EngineCoreOutput, EplbStats
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine.core_client import CoreLauncher, make_engine_core_client
from pagedllm.engine.engine_core import EngineCoreRequest
from pagedllm.engine.input_processor import InputProcessor, PromptType
from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.logger import init_logger
from pagedllm.lora.admission import LoRAAdmission
from pagedllm.lora.peft import LoRAModelShapes
from pagedllm.lora.request import LoRARequest
from pagedllm.models.registry import resolve_model_class
from pagedllm.multimodal.processing import MultiModalProcessor
from pagedllm.outputs import RequestOutput
from pagedllm.platforms import current_platform
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_tokenizer(path: str, trust_remote_code: bool = False,
                   chat_template: str | None = None):
    """The checkpoint's tokenizer via transformers, with `chat_template` (a template's text)
    replacing its own where given (raises FileNotFoundError naming the folder)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise FileNotFoundError(f"could not load a tokenizer from {path}: {e}") from e
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


class LLMEngine:
    """Synchronous engine.

    Args:
        config: a validated `EngineConfig` (see `from_engine_args` for flat arguments).
        multiprocess_mode: run the engine core (scheduler, executor, KV cache) in its own
            process behind `MPEngineCoreClient` (engine/core_client.py) instead of in this one;
            a `CoreLauncher` says where (e.g. a Ray actor, engine/core_ray.py).
    """

    def __init__(self, config: EngineConfig,
                 multiprocess_mode: bool | CoreLauncher = False) -> None:
        start = time.perf_counter()
        init_logger()
        # Every PAGEDLLM_* variable, read and validated once for this engine (pagedllm/envs.py).
        current_platform.configure_options()
        info = hf_model_info(config.model_path)
        resolve_model_class(info.architectures)  # unsupported architecture: fail before loading
        self.config = config
        self.tokenizer = load_tokenizer(config.tokenizer_path,
                                        config.model_config.trust_remote_code,
                                        config.model_config.chat_template)
        eos_ids = info.eos_token_ids or ((self.tokenizer.eos_token_id,)
                                         if self.tokenizer.eos_token_id is not None else ())
        if any(not 0 <= t < info.vocab_size for t in eos_ids):
            # (HF warns the same way: such a model never ends a sequence by EOS)
            logger.warning("eos_token_id %s lies outside the vocabulary (vocab_size %d): "
                           "sequences end only at max_tokens, stop strings or stop ids",
                           list(eos_ids), info.vocab_size)
        self.engine_core = make_engine_core_client(config, multiprocess_mode)
        self.input_processor = InputProcessor(
            self.tokenizer, config.max_model_len, info.vocab_size, tuple(eos_ids),
            config.request_limits,
            kv_cache_capacity=self.engine_core.kv_cache_capacity,
            scheduling_policy=config.scheduler_config.scheduling_policy,
            mm_processor=MultiModalProcessor.from_pretrained(
                config.model_path, info.raw, config.multimodal_config,
                config.model_config.trust_remote_code),
            kv_transfer_config=config.kv_transfer_config)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.lora_admission = LoRAAdmission(
            config.lora_config,
            LoRAModelShapes.from_hf_config(info.raw) if config.lora_config else None)
        self._ids = itertools.count()
        # Parent request id -> child request ids (n > 1).
        self._parents: dict[str, list[str]] = {}
        # The objects made so far (model, tokenizer, torch and transformers state) live as long
        # as the engine: move them out of the cyclic collector's view, whose full passes over
        # them otherwise took a measurable share of a batch-1 decode's CPU time (vLLM freezes
        # likewise; docs/benchmarks.md, "Measurements behind choices in the code").
        gc.collect()
        gc.freeze()
        # NOTE(exit): the collector never visits frozen objects, not even at interpreter exit,
        # so extension objects freed only by it outlive their modules: triton's (loaded by
        # transformers' model code through torch._dynamo, e.g. when a benchmark preset is
        # built first) made nanobind print a screen of "leaked" lines after every command's
        # output. Hand them back at exit (registered once, however many engines are made).
        atexit.unregister(gc.unfreeze)
        atexit.register(gc.unfreeze)
        # The model as the user named it (a .gguf file, not its derived checkpoint view).
        logger.info("engine ready in %.2f s: model %s, max_model_len %d, %d KV blocks of %d "
                    "tokens", time.perf_counter() - start, config.model_config.model,
                    config.max_model_len, self.engine_core.num_blocks - 1,
                    config.cache_config.block_size)

    @classmethod
    def from_engine_args(cls, model: str, multiprocess_mode: bool | CoreLauncher = False,
                         **kwargs: Any) -> LLMEngine:
        return cls(create_engine_config(model, **kwargs), multiprocess_mode)

    def next_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams, lora_request: LoRARequest | None = None,
                    priority: int = 0) -> None:
        """Validate, tokenize and queue one request (under `lora_request`'s adapter, if given:
        checked by `lora_admission`; `priority`: lower first under the priority scheduling
        policy, must be 0 under fcfs).

        With `params.n > 1` the request becomes n child requests ("{i}_{request_id}", seed
        `seed + i`) that share the prompt's full KV blocks through the prefix cache; their outputs
        are gathered into one RequestOutput under `request_id`.

        Raises:
            ValueError: for an invalid request (it is not queued; others are unaffected).
            EngineSleepingError: the engine is asleep (engine/sleep_mode.py).
        """
        self.engine_core.check_awake()
        lora_request = self.lora_admission.check(lora_request)
        core_req, prompt_text = self.input_processor.process(request_id, prompt, params,
                                                             priority)
        core_req.lora_request = lora_request
        self.add_processed_request(core_req, prompt_text)

    def add_processed_request(self, core_req: EngineCoreRequest,
                              prompt_text: str | None) -> None:
        """Queue a request that passed `input_processor.process` (as `add_request` does).

        Raises:
            ValueError: if its id is in use (it is not queued; others are unaffected).
        """
        request_id, params = core_req.request_id, core_req.sampling_params
        if request_id in self.output_processor.request_states or request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n == 1:
            self.engine_core.add_request(core_req)
            self.output_processor.add_request(request_id, prompt_text,
                                              core_req.prompt_token_ids, params)
            return
        parent = ParentRequest(request_id, prompt_text, core_req.prompt_token_ids, params.n,
                               params.output_kind)
        child_ids: list[str] = []
        try:
            for i in range(params.n):
                child_id = f"{i}_{request_id}"
                child_params = copy.copy(params)
                child_params.n = 1
                if params.seed is not None:
                    # seed + i, wrapped into the int64 range the seed was validated in.
                    child_params.seed = (params.seed + i + 2**63) % 2**64 - 2**63
                child = copy.copy(core_req)
                child.request_id, child.sampling_params = child_id, child_params
                self.engine_core.add_request(child)
                child_ids.append(child_id)
                self.output_processor.add_request(child_id, prompt_text,
                                                  core_req.prompt_token_ids, child_params,
                                                  parent, i)
        except BaseException:
            self.engine_core.abort_requests(child_ids)  # all children or none
            self.output_processor.abort_requests(child_ids)
            raise
        self._parents[request_id] = child_ids

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [c for r in ids for c in self._parents.pop(r, [r])]
        self.engine_core.abort_requests(ids)
        self.output_processor.abort_requests(ids)

    def abort_with_outputs(self, request_ids: list[str]) -> list[RequestOutput]:
        """Abort requests as `abort_request` does, and return their final outputs (finish
        reason "abort"), as a step would have (a pause that aborts them tells their callers)."""
        ids = [c for r in request_ids for c in self._parents.get(r, [r])]
        self.engine_core.abort_requests(ids)
        outputs, _ = self.output_processor.process_outputs(
            [EngineCoreOutput(req_id, [], finish_reason="abort") for req_id in ids])
        for out in outputs:
            if out.finished:
                self._parents.pop(out.request_id, None)
        return outputs

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        request_outputs, to_abort = self.output_processor.process_outputs(outputs)
        if to_abort:
            self.engine_core.abort_requests(to_abort)
        for out in request_outputs:
            if out.finished:
                self._parents.pop(out.request_id, None)
        return request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.engine_core.get_num_unfinished_requests()

    def check_health(self) -> None:
        """Raises EngineDeadError if the engine core's process died (multiprocess mode)."""
        self.engine_core.check_health()

    def wake(self) -> None:
        """End a `step()` that another thread runs and that waits for the engine core's outputs
        (multiprocess mode; a no-op in-process). Thread-safe."""
        self.engine_core.wake()

    def reset_prefix_cache(self) -> int:
        return self.engine_core.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def get_eplb_stats(self) -> EplbStats | None:
        """The MoE layers' load imbalance at the last EPLB rebalance (None: none yet)."""
        return self.engine_core.eplb_stats

    # Sleep mode and weight updates: EngineCore's (engine/sleep_mode.py, docs/sleep_mode.md).
    def sleep(self, level: int = 1) -> None:
        self.engine_core.sleep(level)

    def wake_up(self) -> None:
        self.engine_core.wake_up()

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def update_weights(self, model_path: str) -> None:
        self.engine_core.update_weights(model_path)

    def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        return self.engine_core.collective_rpc(method, args)
