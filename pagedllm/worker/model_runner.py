"""ModelRunner: turns a SchedulerOutput into one forward pass and the sampled tokens.

This file orchestrates only; the parts live elsewhere: request state (`input_batch.py`), slot
mapping (`block_table.py`), attention metadata (`attention/`), sampling inputs
(`sampling_inputs.py`), the sampler and rejection sampler (`sample/`), draft proposers and
spec-decode metadata (`spec_decode/`), KV allocation (`kv_cache.py`), KV cache groups and tensors
(`kv_cache_runner.py`, a mixin), the step's flat inputs and block tables (`runner_inputs.py`, a
mixin), routed-experts capture of MoE models (`routed_experts.py`: each
step's router choices, sent with its output).

    execute_model(scheduler_output):  update states -> prepare inputs -> attention metadata
                                      -> forward over the flat batch -> logits at logits_indices
                                      (-> the draft model catches up on the same batch)
    sample_tokens(grammar_output):    grammar bitmask -> sampler, or rejection sampler where
                                      drafts were scheduled -> record tokens
                                      (`record_sampled_tokens`) -> propose drafts
                                      -> ModelRunnerOutput

    run_remaining_steps():            a multi-step round's later decode steps (each sampled
                                      token is the next input; no scheduler in between), run by
                                      the composed `MultiStepRound` (worker/multi_step.py)

Rows whose prompt is still partially uncomputed after this step are not sampled at all (no logits,
no RNG use), so seeded outputs do not depend on how a prompt was chunked.

KV cache groups (core/kv_cache_groups.py): layers of one attention type share a block table; with
several groups each gets its own slot mapping and attention metadata (`KVCacheGroupsMetadata`).

CUDA graphs (worker/cuda_graph.py): once the KV cache exists, a `CudaGraphRunner` captures the
forward (up to hidden states) per decode batch size; pure decode steps replay it, padded, and
logits, grammar and sampling stay eager on the real rows. Every other step runs eagerly.

Asynchronous scheduling (worker/async_output.py): `sample_tokens_async` keeps the sampled ids on
the device and counts each as a placeholder token of its request (`num_tokens` + 1); the next
`execute_model` fills those positions of its inputs from the device tensor, and writes earlier
steps' tokens into `token_ids_cpu` once their host copies are done. Requests whose sampling reads
their previous tokens on the host only ever run in synchronous steps (the engine guarantees it),
so `token_ids_cpu` is complete whenever such a step samples. With speculative decoding each step
is finished on the host (`sample_tokens`): worker/async_drafts.py fills the next one's drafts.
"""

from __future__ import annotations

import weakref
from dataclasses import replace

import numpy as np
import torch

from pagedllm.attention.forward_context import set_forward_context
from pagedllm.attention.metadata import CommonAttentionMetadata, KVCacheGroupsMetadata
from pagedllm.config import EngineConfig
from pagedllm.attention.backends.selector import get_attention_backend
from pagedllm.core.kv_cache_groups import STATE_ALIGN_GROUP, KVCacheGroupSpec, is_state_group
from pagedllm.core.sched_output import (GrammarOutput, LogprobsLists, ModelRunnerOutput,
                                        NewRequestData, SchedulerOutput)
from pagedllm.distributed.parallel_state import (ExpertParallelLayout,
                                                 set_expert_parallel_layout)
from pagedllm.layers.batch_invariance import check_batch_invariance
from pagedllm.layers.state_cache import StateCacheMetadata, copy_state_slots
from pagedllm.lora.model_manager import LoRAModelManager
from pagedllm.lora.peft import LoRAModelShapes
from pagedllm.model_loader.loader import load_model
from pagedllm.native.attach import refresh_native_decoder
from pagedllm.native.decode_loop import GreedyDecodeLoop
from pagedllm.sample.logprobs import LogprobsTensors, compute_logprobs
from pagedllm.sample.rejection_sampler import rejection_sample
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import EagleHead, EagleProposer
from pagedllm.spec_decode.metadata import SpecDecodeMetadata
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.suffix import SuffixDecodingProposer
from pagedllm.structured_output.apply import apply_grammar_bitmask
from pagedllm.worker.async_drafts import AsyncDrafts
from pagedllm.worker.async_output import (AsyncModelRunnerOutput, CompletedModelRunnerOutput,
                                          SampledTokens, start_host_copy)
from pagedllm.worker.encoder_runner import EncoderRunner
from pagedllm.worker.cuda_graph import (CudaGraphInputBuffers, CudaGraphRunner,
                                        decode_graph_capture_sizes)
from pagedllm.worker.drafters import Drafter, make_drafter, max_drafts, propose_drafts
from pagedllm.worker.eagle_inputs import propose_eagle
from pagedllm.worker.eplb_state import EplbState
from pagedllm.worker.input_batch import (InputBatch, PendingStep, RequestStates, StepInputs,
                                         record_sampled_tokens, request_logprobs)
from pagedllm.worker.kv_cache import resolve_kv_cache_dtype
from pagedllm.worker.kv_connector.base import KVLayerHooks
from pagedllm.worker.kv_cache_runner import KVCacheRunnerMixin
from pagedllm.worker.runner_inputs import InputPrepMixin
from pagedllm.worker.multi_step import MultiStepRound, RoundSteps, native_decode_loop
from pagedllm.worker.native_verify import NativeGreedyVerify, greedy_accept
from pagedllm.worker.pipeline_sampler import pipeline_stage_sampler
from pagedllm.worker.routed_experts import RoutedExpertsRecorder
from pagedllm.worker.sampling_inputs import build_sampling_metadata


class ModelRunner(KVCacheRunnerMixin, InputPrepMixin):
    """Owns the model, the KV cache tensors and the persistent request states of one worker
    (the later steps of multi-step rounds: `multi_step`, a `MultiStepRound` built by
    `load_model` from the states, the sampler and this runner's step phases).

    Args:
        config: the engine config.
        hf_config: the checkpoint's transformers config.
        device, dtype: where and in what precision the model runs.
    """

    def __init__(self, config: EngineConfig, hf_config, device: torch.device,
                 dtype: torch.dtype) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        # The KV cache tensors' dtype: the model's, or int8 / float8_e4m3fn (kv_cache_dtype).
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache_config.cache_dtype, dtype)
        self.block_size = config.cache_config.block_size
        self.max_num_tokens = config.scheduler_config.max_num_batched_tokens
        self.max_num_reqs = config.scheduler_config.max_num_seqs
        self.states = RequestStates(self.max_num_reqs, config.max_model_len,
                                    config.max_num_blocks_per_req, self.block_size)
        self.sampler = pipeline_stage_sampler(Sampler(device, config.model_config.seed))
        self.logprobs_mode = config.model_config.logprobs_mode
        self.model = None
        self.eplb: EplbState | None = None
        # The adapters' slots and per-step token mapping (set by load_model with enable_lora).
        self.lora_manager: LoRAModelManager | None = None
        # req_id -> why it fails, found while its step's inputs were set up (its adapter could
        # not be read); sent with that step's output, where the scheduler ends the request.
        self._request_errors: dict[str, str] = {}
        # Replays pure decode steps (set once the KV cache exists; None = always eager).
        self.graph_runner: CudaGraphRunner | None = None
        # The KV connector's per-layer seams of the running step (set by the Worker).
        self.kv_hooks: KVLayerHooks | None = None
        self.kv_caches: list[torch.Tensor] = []
        # The state group's tensors (also in kv_caches), [num_slots, ...] each.
        self.state_caches: list[torch.Tensor] = []
        # The KV cache groups' windows (set by load_model; one full-attention group until then).
        self.kv_cache_windows: tuple[int | None, ...] = (None,)
        # Persistent input buffers, sliced per step.
        self.input_ids = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device)
        self.positions = torch.zeros(self.max_num_tokens, dtype=torch.int64, device=device)
        # [num_kv_cache_groups, max_num_tokens]: each group's slot of every token.
        self.slot_mappings = torch.zeros((1, self.max_num_tokens), dtype=torch.int64,
                                         device=device)
        # execute_model's forward, until sample_tokens takes it.
        self._pending: PendingStep | None = None
        # The inputs of execute_model's last forward (a multi-step round starts from them).
        self._last_inputs: StepInputs | None = None
        self.multi_step: MultiStepRound | None = None   # (set by load_model)
        # Image encoding and embeddings of a vision-language model (set by load_model).
        self.encoder_runner: EncoderRunner | None = None
        # Each model's attention backend (`_run_model`), the target's and a drafter's.
        self._attention_backends: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Async scheduling: sampled tokens not yet in token_ids_cpu (oldest first); the last
        # entry's are also the inputs the next step takes from the device.
        self._unwritten_tokens: list[SampledTokens] = []
        self._last_sampled: SampledTokens | None = None
        self.spec_config = config.speculative_config
        self.drafter: Drafter | None = None   # (set by load_model: worker/drafters.py)
        # Greedy verification in the native loop (set by load_model; None where it cannot run).
        self.native_verify: NativeGreedyVerify | None = None
        # The last step's drafts and rejections, for placeholder drafts (async scheduling).
        self.async_drafts = AsyncDrafts()
        # Routed-experts capture (enable_return_routed_experts; set by load_model), and the
        # last forward's rows per request until sample_tokens sends them.
        self.routed_experts: RoutedExpertsRecorder | None = None
        self._routed_experts_rows: dict[str, tuple[int, np.ndarray]] = {}

    # ----------------------------------------------------------------- set-up
    def load_model(self) -> None:
        pc = self.config.parallel_config
        set_expert_parallel_layout(ExpertParallelLayout(
            pc.enable_expert_parallel, pc.eplb_config.num_redundant_experts, pc.enable_eplb))
        self.model = load_model(self.config.model_path, self.hf_config, self.dtype, self.device,
                                self.config.model_config.quantization)
        if self.config.model_config.batch_invariant:
            check_batch_invariance(self.model, self.kv_cache_dtype)
        if pc.enable_eplb:
            self.eplb = EplbState.from_model(self.model, pc.eplb_config)
        if self.config.lora_config is not None:
            self.lora_manager = LoRAModelManager(
                self.model, LoRAModelShapes.from_hf_config(self.hf_config.to_dict()),
                self.config.lora_config, self.device, self.dtype)
        self.drafter = make_drafter(self.config, self.model, self.dtype, self.device,
                                    self._run_model, self.block_size)
        self.encoder_runner = EncoderRunner.for_model(self.model, pc.pipeline_parallel_size)
        self._setup_kv_cache_groups()
        if self.config.model_config.enable_return_routed_experts:
            self.routed_experts = RoutedExpertsRecorder(
                self.model, max(self.max_num_tokens, self.max_num_reqs), self.device,
                self.kv_cache_windows)
        self.multi_step = self._make_multi_step()
        self.native_verify = self._make_native_verify()

    def _make_native_verify(self) -> NativeGreedyVerify | None:
        """Greedy verification in the native decode loop (worker/native_verify.py) for the
        drafters that need nothing from the forward (n-gram, suffix) and for EAGLE / EAGLE-3
        heads (the loop also returns the hidden states they read), where the native loop
        could take the model's decode steps (`_native_loop_allowed`, `native_decode_loop`)."""
        eagle = (isinstance(self.drafter, EagleProposer)
                 and isinstance(self.drafter.model, EagleHead))
        if (not (eagle or isinstance(self.drafter, (NgramProposer, SuffixDecodingProposer)))
                or not self._native_loop_allowed()):
            return None
        loop = native_decode_loop(self.model)
        if loop is None or (eagle and not isinstance(loop, GreedyDecodeLoop)):
            return None
        aux = None
        if eagle and self.drafter.model.eagle3:
            aux = tuple(self.model.model.aux_hidden_state_layers)
            if list(aux) != sorted(aux):   # the loop captures in layer order only
                return None
        return NativeGreedyVerify(loop, self.block_size, head_states=eagle, aux_layers=aux)

    def _native_loop_allowed(self) -> bool:
        """Whether the native loop may run this runner's steps: the CPU, one KV cache group
        (or a full-attention group and a state group: the loop advances the state slots),
        nothing between steps but the sampler (EPLB), no per-request RoPE deltas (M-RoPE)."""
        windows = self.kv_cache_windows
        return (self.device.type == "cpu" and self.eplb is None
                and (len(windows) == 1
                     or len(windows) == 2 and windows[0] is None and is_state_group(windows[1]))
                and not getattr(self.model, "uses_mrope", False))

    def _make_multi_step(self) -> MultiStepRound:
        """The multi-step rounds over this runner's states, sampler and step phases; the native
        loop may take them on the CPU with one KV cache group and nothing between steps (drafts,
        EPLB)."""
        native = self.drafter is None and self._native_loop_allowed()
        steps = RoundSteps(advance=self._advance_decode_inputs,
                           gather=self._gather_decode_inputs, forward=self._forward,
                           sample=self._sample_into,
                           native_ok=None if self.lora_manager is None
                           else lambda: not self.lora_manager.vocab_active)
        state_group = self.kv_cache_windows[-1]
        return MultiStepRound(self.states, steps, self.sampler, self.block_size,
                              self.model if native else None,
                              state_group if is_state_group(state_group) else None)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate every group's KV tensors (`num_blocks` is group 0's), then capture the
        decode CUDA graphs where they apply (`decode_graph_capture_sizes`)."""
        self.graph_runner = None
        groups = self.kv_cache_groups(num_blocks)
        self._allocate_kv_caches(groups)
        if self.routed_experts is not None:
            self.routed_experts.allocate(groups, self.block_size)
        sizes = decode_graph_capture_sizes(
            self.config.cudagraph_config, self.max_num_reqs, self.device,
            self._attention_backend(self.model), self.model,
            self.config.parallel_config.world_size)
        if sizes:
            self.set_graph_runner(CudaGraphRunner(self.new_graph_input_buffers(), sizes,
                                                  self.block_size))

    def new_graph_input_buffers(self) -> CudaGraphInputBuffers:
        """Persistent decode-graph inputs sized for this runner (max_num_seqs requests, every
        KV cache group)."""
        return CudaGraphInputBuffers(self.max_num_reqs, self.config.max_num_blocks_per_req,
                                     self.device, len(self.kv_cache_windows))

    @torch.inference_mode()
    def set_graph_runner(self, graph_runner: CudaGraphRunner) -> None:
        """Capture `graph_runner`'s sizes over the allocated KV cache and replay pure decode
        steps through it from now on (a `replay_eagerly` runner is the CPU test seam)."""
        buffers = graph_runner.buffers

        def forward(size: int, commons: tuple[CommonAttentionMetadata, ...]) -> torch.Tensor:
            return self._run_model(self.model, buffers.input_ids[:size],
                                   buffers.positions[:size], commons[0],
                                   commons if len(commons) > 1 else ())

        graph_runner.capture(forward)
        self.graph_runner = graph_runner

    @torch.inference_mode()
    def profile_run(self, max_tokens: int | None = None) -> None:
        """Run the largest batch once (dummy requests over a temporary KV cache) so the memory
        peak is measured and lazy initialisation happens before serving; with `max_tokens`, a
        batch of at most that many tokens (a warm-up, where the peak does not matter: see
        `Platform.profile_run_at_max_batch`)."""
        num_tokens = min(self.max_num_tokens, self.max_num_reqs * self.config.max_model_len,
                         max_tokens or self.max_num_tokens)
        per_req = min(self.config.max_model_len, num_tokens)
        lens = [per_req] * (num_tokens // per_req) + ([num_tokens % per_req]
                                                     if num_tokens % per_req else [])
        blocks_per_req = -(-per_req // self.block_size)
        num_blocks = 1 + blocks_per_req * len(lens)
        # Every group as large as group 0 here: the dummy requests hold all their blocks (a
        # state group: one slot each).
        self._allocate_kv_caches(tuple(
            KVCacheGroupSpec(None, 1 + len(lens), state=True) if is_state_group(w)
            else KVCacheGroupSpec(w, num_blocks) for w in self.kv_cache_windows))
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=5, max_tokens=1,
                                return_routed_experts=False)
        reqs = [NewRequestData(
            f"_profile_{i}", [0] * n, [], params,
            tuple([0] * ((n - 1) // self.block_size * (w == STATE_ALIGN_GROUP)) + [1 + i]
                  if is_state_group(w)
                  else list(range(1 + i * blocks_per_req, 1 + (i + 1) * blocks_per_req))
                  for w in self.kv_cache_windows), 0) for i, n in enumerate(lens)]
        out = SchedulerOutput.make_empty()
        out.scheduled_new_reqs = reqs
        out.num_scheduled_tokens = {r.req_id: len(r.prompt_token_ids) for r in reqs}
        out.total_num_scheduled_tokens = num_tokens
        self.execute_model(out)
        self.sample_tokens()
        for r in reqs:
            self.states.remove_request(r.req_id)
        if isinstance(self.drafter, SuffixDecodingProposer):
            self.drafter.remove_requests(r.req_id for r in reqs)
        self.release_kv_cache()
        if self.eplb is not None:
            self.eplb.reset()

    def load_fresh_model(self, model_path: str) -> torch.nn.Module:
        """A new model from the checkpoint at `model_path`, built and processed as `load_model`
        builds this runner's (its own config; for weight updates, worker/sleep_mode.py).

        Raises:
            ValueError, FileNotFoundError, OSError: as `load_model` (model_loader/loader.py).
        """
        from transformers import AutoConfig
        hf_config = AutoConfig.from_pretrained(
            model_path, trust_remote_code=self.config.model_config.trust_remote_code)
        return load_model(model_path, hf_config, self.dtype, self.device,
                          self.config.model_config.quantization)

    def weights_changed(self) -> None:
        """The model's weights were replaced or overwritten (sleep mode, weight updates): the
        native structures that point into them or copy parts of them are rebuilt at their next
        use (CUDA graphs are recaptured by `initialize_kv_cache`)."""
        refresh_native_decoder(self.model)
        self.multi_step = self._make_multi_step()
        self.native_verify = self._make_native_verify()

    # ----------------------------------------------------------------- one step
    def _write_sampled_tokens(self, wait: bool = False) -> None:
        """Write the async steps' sampled tokens into `token_ids_cpu`: with `wait` all of them,
        else those whose host copies are done, except the last step's, which the next inputs
        take from the device (on the CPU too, so that path is the one tested everywhere).
        `write_to` skips slots that changed hands."""
        while self._unwritten_tokens and (wait or (
                self._unwritten_tokens[0] is not self._last_sampled
                and self._unwritten_tokens[0].is_ready())):
            self._unwritten_tokens.pop(0).write_to(self.states.token_ids_cpu,
                                                  self.states.req_id_to_index)

    def _update_states(self, so: SchedulerOutput) -> None:
        self._write_sampled_tokens()
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self._remove_request(req_id)
        if isinstance(self.drafter, SuffixDecodingProposer):
            self.drafter.stop_requests(so.finished_req_ids)
        for req in so.scheduled_new_reqs:
            idx = self.states.add_request(req)
            if req.lora_request is not None and self.lora_manager is not None:
                error = self.lora_manager.add_request(req.lora_request)
                if error is not None:
                    # It runs on the base model until the scheduler ends it with this error.
                    self.states.lora_requests[idx] = None
                    self._request_errors[req.req_id] = error
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                    cached.num_computed_tokens):
            idx = self.states.req_id_to_index[req_id]
            for table, group_blocks in zip(self.states.block_tables, new_blocks):
                table.append_row(group_blocks, idx)
            self.states.num_computed_tokens[idx] = num_computed
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            # Drafts sit after the request's tokens (not counted in num_tokens) to be gathered
            # as inputs; accepted ones are written again when appended.
            idx = self.states.req_id_to_index[req_id]
            start = self.states.num_tokens[idx]
            self.states.token_ids_cpu[idx, start:start + len(drafts)] = drafts

    def _remove_request(self, req_id: str) -> None:
        """Free a finished or preempted request's slot (and unpin its adapter)."""
        idx = self.states.req_id_to_index.get(req_id)
        lora_request = None if idx is None else self.states.lora_requests[idx]
        if lora_request is not None and self.lora_manager is not None:
            self.lora_manager.remove_request(lora_request.lora_int_id)
        self._request_errors.pop(req_id, None)
        self.states.remove_request(req_id)

    def _take_request_errors(self) -> dict[str, str]:
        errors, self._request_errors = self._request_errors, {}
        return errors

    def _run_model(self, model: torch.nn.Module, input_ids: torch.Tensor,
                   positions: torch.Tensor, common: CommonAttentionMetadata,
                   group_commons: tuple[CommonAttentionMetadata, ...] = (),
                   inputs_embeds: torch.Tensor | None = None, **inputs):
        """One forward of `model` over a flat batch; the only place the forward context is set.
        With several KV cache groups, `group_commons` holds each group's metadata;
        `inputs_embeds` replaces the token embeddings (image placeholders); `inputs` are
        further model inputs (an EAGLE head's hidden states)."""
        backend = self._attention_backend(model)
        if group_commons:
            attn_metadata = KVCacheGroupsMetadata(
                self.kv_cache_windows,
                tuple(StateCacheMetadata.from_common(c, w == STATE_ALIGN_GROUP)
                      if is_state_group(w) else backend.build_metadata(c)
                      for w, c in zip(self.kv_cache_windows, group_commons)), common)
            if self.state_caches:
                copy_state_slots(self.state_caches, attn_metadata.group_metadata[-1])
        else:
            attn_metadata = backend.build_metadata(common)
        if hasattr(model, "rope_positions"):   # a model whose RoPE rows depend on the step
            positions = model.rope_positions(positions, common.token_seq_lens())
        hooks = self.kv_hooks
        if hooks is not None and model is not self.model:
            hooks.wait_for_all_loads()   # (a drafter's layers: loaded, never saved mid-forward)
            hooks = None
        # The embedding's adapters apply to the target model's own lookups only (a drafter
        # may look tokens up in the same embedding: lora/vocab.py).
        lora_state = self.lora_manager.state \
            if self.lora_manager is not None and model is self.model else None
        if lora_state is not None:
            lora_state.embedding_armed = True
        try:
            with set_forward_context(attn_metadata, hooks):
                if inputs_embeds is not None:
                    return model(input_ids, positions, inputs_embeds, **inputs)
                return model(input_ids, positions, **inputs)
        finally:
            if lora_state is not None:
                lora_state.embedding_armed = False

    def _attention_backend(self, model: torch.nn.Module):
        """The attention backend of `model`'s layers (the platform's for a model without
        attention layers). Looked up once per model: listing the layers every step would be a
        cost of its own (docs/benchmarks.md, "Measurements behind choices in the code")."""
        backend = self._attention_backends.get(model)
        if backend is None:
            layers = model.attention_layers()
            backend = layers[0].backend if layers else get_attention_backend()
            self._attention_backends[model] = backend
        return backend

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward pass of one step; logits are kept for `sample_tokens`."""
        if self.drafter is not None:
            scheduler_output = self.async_drafts.resolve(scheduler_output)
        self._update_states(scheduler_output)
        if self.encoder_runner is not None:
            self.encoder_runner.update(scheduler_output)
        if self.routed_experts is not None:
            self.routed_experts.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            self._pending = self._last_inputs = None
            return
        inputs = StepInputs(*self._prepare_inputs(scheduler_output))
        if self.encoder_runner is not None:
            inputs = self.encoder_runner.prepare_inputs(inputs)
        self._set_active_loras(inputs.batch)
        self._pending = self._forward(inputs)
        self._last_inputs = inputs
        if self.routed_experts is not None:
            self._routed_experts_rows = self.routed_experts.collect(
                inputs.batch, self.slot_mappings, self.states)

    def _set_active_loras(self, batch: InputBatch) -> None:
        """Map the batch's tokens to adapter slots for the next forwards (LoRA engines only).
        A multi-step round's `_advance_decode_inputs` keeps the rows, their order and one
        token each, so the mapping of the round's first step holds for it."""
        if self.lora_manager is not None:
            self.lora_manager.set_active_loras(
                [self.states.lora_requests[i] for i in batch.idx_mapping],
                batch.num_scheduled_tokens)

    def _forward(self, inputs: StepInputs) -> PendingStep:
        """The forward of prepared inputs -> the logits of the sampled rows."""
        batch, common = inputs.batch, inputs.common
        eagle = isinstance(self.drafter, EagleProposer)
        verified = self._native_verify_step(inputs)
        if verified is not None:
            targets, states = verified
            return PendingStep(inputs, None, {}, states, greedy_token_ids=targets)
        positions = batch.positions
        if self.encoder_runner is not None:   # M-RoPE positions of image requests
            positions = self.encoder_runner.rope_positions(batch)
        if (self.graph_runner is not None and batch.spec_decode_metadata is None and not eagle
                and batch.inputs_embeds is None and positions.ndim == 1
                and not (self.lora_manager is not None and self.lora_manager.active)
                and self.graph_runner.can_run(common)):
            if self.kv_hooks is not None:   # (a replay calls no layer's hooks)
                self.kv_hooks.wait_for_all_loads()
            hidden = self.graph_runner.run(batch.input_ids, positions,
                                           batch.group_commons or (common,))
        else:
            hidden = self._run_model(self.model, batch.input_ids, positions, common,
                                     batch.group_commons, batch.inputs_embeds)
        if isinstance(self.drafter, DraftModelProposer):
            self.drafter.catch_up(batch.input_ids, batch.positions, common)
        drafter_hidden = None
        if isinstance(hidden, tuple):   # (last hidden, auxiliary layers' inputs): EAGLE-3
            hidden, drafter_hidden = hidden
        elif eagle:
            drafter_hidden = hidden
        logits = self._compute_logits(hidden, batch.logits_indices)
        pending = PendingStep(inputs, logits, self._compute_prompt_logprobs(batch, hidden),
                              drafter_hidden)
        if self.eplb is not None:
            # Between steps: this step's outputs are computed, the next one sees the new layout.
            self.eplb.step()
        return pending

    def _native_verify_step(self, inputs: StepInputs
                            ) -> tuple[np.ndarray, torch.Tensor | None] | None:
        """(the argmax of every logits row [num_logits] int64, for an EAGLE head the hidden
        states it reads at every token [num_tokens, H'] else None) where the step ran in the
        native loop (`NativeGreedyVerify`: every request decodes, plain greedy, unstructured,
        no adapter, prompt logprobs or connector in play), else None (nothing ran)."""
        nv = self.native_verify
        if nv is None:
            return None
        batch, common = inputs.batch, inputs.common
        rows = batch.idx_mapping
        st = self.states
        spec = batch.spec_decode_metadata
        if (len(batch.sampled_batch_idx) != batch.num_reqs or batch.inputs_embeds is not None
                or self.kv_hooks is not None or self.routed_experts is not None
                or self.lora_manager is not None
                or not bool((st.plain_greedy[rows] & ~st.structured[rows]).all())
                or bool((st.num_prompt_logprobs[rows] >= 0).any())):
            return None
        num_drafts = np.zeros(batch.num_reqs, dtype=np.int64)
        if spec is not None:
            num_drafts[batch.sampled_batch_idx] = spec.num_draft_tokens
        if not nv.applies(batch.num_scheduled_tokens, num_drafts, batch.seq_lens_np, True,
                          common.batch_invariant):
            return None
        n = int(batch.num_scheduled_tokens.sum())
        flat, states = nv.run(batch.input_ids[:n], batch.positions[:n], common.block_table,
                              batch.num_scheduled_tokens)
        index = spec.logits_indices if spec is not None else batch.logits_indices.cpu().numpy()
        return flat[np.asarray(index)], states

    def _compute_logits(self, hidden: torch.Tensor, rows: torch.Tensor | slice) -> torch.Tensor:
        """The logits [m, vocab] float32 of the flat batch's rows `rows` ([m] int64 on the
        device, or a slice) of `hidden` [n, hidden_size], each with its request's LM head
        adapter where LoRA is on."""
        if self.lora_manager is not None:
            return self.lora_manager.compute_logits(self.model, hidden, rows)
        return self.model.compute_logits(hidden[rows])

    def _apply_grammar(self, grammar_output: GrammarOutput | None, batch: InputBatch,
                       logits: torch.Tensor) -> torch.Tensor:
        """Mask tokens the grammar forbids in the logits rows of structured requests."""
        if grammar_output is None:
            return logits
        sampled_pos = {batch.req_ids[b]: i for i, b in enumerate(batch.sampled_batch_idx)}
        spec = batch.spec_decode_metadata
        rows = []
        for req_id in grammar_output.structured_output_request_ids:
            i = sampled_pos[req_id]
            if spec is None:
                rows.append(i)
            else:
                rows.extend(range(int(spec.cu_num_logits[i]), int(spec.cu_num_logits[i + 1])))
        return apply_grammar_bitmask(
            logits, torch.from_numpy(grammar_output.grammar_bitmask).to(self.device),
            torch.tensor(rows, dtype=torch.int64, device=self.device))

    def _compute_prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor
                                 ) -> dict[str, tuple[int, LogprobsLists]]:
        """Logprobs of the prompt tokens that follow this step's positions, for requests that
        asked for prompt logprobs. Position p's hidden state scores prompt token p + 1."""
        st = self.states
        out: dict[str, tuple[int, LogprobsLists]] = {}
        for b in np.nonzero(st.num_prompt_logprobs[batch.idx_mapping] >= 0)[0]:
            row = batch.idx_mapping[b]
            start = int(batch.seq_lens_np[b] - batch.num_scheduled_tokens[b])
            end = min(int(batch.seq_lens_np[b]), int(st.num_prompt_tokens[row]) - 1)
            if end <= start:
                continue
            q0 = int(batch.query_start_loc_np[b])
            logits = self._compute_logits(hidden, slice(q0, q0 + end - start))
            targets = torch.from_numpy(
                st.token_ids_cpu[row, start + 1:end + 1].astype(np.int64)).to(self.device)
            lp = compute_logprobs(logits, targets, int(st.num_prompt_logprobs[row]))
            # Prompt token index start + 1 is the first one covered.
            out[batch.req_ids[b]] = (start + 1, _to_lists(lp))
        return out

    @torch.inference_mode()
    def sample_tokens(self, grammar_output: GrammarOutput | None = None) -> ModelRunnerOutput:
        """Sample (or verify drafts) for the rows of the last `execute_model`, the structured
        requests' rows masked by `grammar_output`; record the tokens and propose the next
        drafts."""
        self._last_sampled = None
        # A synchronous step after asynchronous ones: sampling may read the earlier tokens.
        self._write_sampled_tokens(wait=True)
        pending, self._pending = self._pending, None
        if pending is None:
            return ModelRunnerOutput([], {}, [])
        batch = pending.inputs.batch
        output = ModelRunnerOutput(req_ids=batch.req_ids,
                                   req_id_to_index={r: i for i, r in enumerate(batch.req_ids)},
                                   sampled_token_ids=[[] for _ in batch.req_ids],
                                   prompt_logprobs_dict=pending.prompt_logprobs)
        self._sample_into(pending, output, grammar_output)
        output.request_errors.update(self._take_request_errors())
        output.routed_experts, self._routed_experts_rows = self._routed_experts_rows, {}
        if isinstance(self.drafter, EagleProposer):
            output.draft_token_ids = propose_eagle(self.drafter, self.states, pending, output,
                                                   self._max_drafts)
        elif self.drafter is not None and len(batch.sampled_batch_idx):
            rows = batch.idx_mapping[batch.sampled_batch_idx]
            output.draft_token_ids = propose_drafts(
                self.drafter, self.states, [batch.req_ids[b] for b in batch.sampled_batch_idx],
                rows, self._max_drafts(rows))
        if self.drafter is not None:
            self.async_drafts.record(output)
        output.eplb_stats = None if self.eplb is None else self.eplb.take_stats()
        return output

    def _sample_into(self, pending: PendingStep, output: ModelRunnerOutput,
                     grammar_output: GrammarOutput | None = None) -> None:
        """Sample (or verify drafts) for `pending`'s sampled rows and record their tokens in
        `output` and the request states (`record_sampled_tokens`). A row whose logits
        processor failed records nothing; its message goes to `output.request_errors` (the
        scheduler ends it)."""
        batch = pending.inputs.batch
        sampled_rows = batch.idx_mapping[batch.sampled_batch_idx]
        if not len(sampled_rows):
            return
        if pending.greedy_token_ids is not None:
            # Verified in the native loop: plain greedy rows, no logprobs, no grammar.
            if grammar_output is not None:
                raise RuntimeError("a grammar for a step verified without logits")
            record_sampled_tokens(output, [batch.req_ids[b] for b in batch.sampled_batch_idx],
                                  greedy_accept(pending.greedy_token_ids,
                                                batch.spec_decode_metadata),
                                  [None] * len(sampled_rows), self.states,
                                  sampled_rows.tolist())
            return
        logits = self._apply_grammar(grammar_output, batch, pending.logits)
        if batch.spec_decode_metadata is None:
            tokens, lp_lists, lp_rows, failed = self._sample(sampled_rows, logits)
        else:
            tokens, lp_lists, lp_rows, failed = self._verify(sampled_rows, logits,
                                                             batch.spec_decode_metadata)
        num_logprobs = self.states.num_logprobs[sampled_rows].tolist()
        req_ids, rows, new_tokens, logprobs = [], [], [], []
        for i, (b, row) in enumerate(zip(batch.sampled_batch_idx.tolist(),
                                         sampled_rows.tolist())):
            if i in failed:
                output.request_errors[batch.req_ids[b]] = failed[i]
                continue
            req_ids.append(batch.req_ids[b])
            rows.append(row)
            new_tokens.append(tokens[i])
            logprobs.append(request_logprobs(lp_lists, lp_rows[i], len(tokens[i]),
                                             num_logprobs[i]))
        record_sampled_tokens(output, req_ids, new_tokens, logprobs, self.states, rows)

    @torch.inference_mode()
    def sample_tokens_async(self, grammar_output: GrammarOutput | None = None
                            ) -> AsyncModelRunnerOutput | CompletedModelRunnerOutput:
        """Sample for the rows of the last `execute_model` without reading the tokens on the
        host: each sampled request's `num_tokens` grows by one placeholder, the ids stay on the
        device for the next step's inputs, and the returned object's `get_output()` waits for
        their host copy (and records them: `record_sampled_tokens`). With speculative decoding
        the step is sampled, verified and drafted to the end (`sample_tokens`): the next step's
        placeholder drafts need its drafts and rejections (worker/async_drafts.py).

        Raises:
            RuntimeError: when the step verified drafts without a drafter (a caller bug).
        """
        if self.drafter is not None:
            return CompletedModelRunnerOutput(self.sample_tokens(grammar_output))
        pending, self._pending = self._pending, None
        if pending is None:
            self._last_sampled = None
            return AsyncModelRunnerOutput([], np.zeros(0, dtype=np.int64), None, {}, None,
                                          np.zeros(0, dtype=np.int32), {})
        batch = pending.inputs.batch
        if batch.spec_decode_metadata is not None:
            raise RuntimeError("a step with draft tokens but no drafter")
        sampled_rows = batch.idx_mapping[batch.sampled_batch_idx]
        failed: dict[int, str] = {}
        sampled = lp = None
        if len(sampled_rows):
            logits = self._apply_grammar(grammar_output, batch, pending.logits)
            metadata = build_sampling_metadata(self.states, sampled_rows, logits.shape[-1],
                                               self.device, self.logprobs_mode)
            out = self.sampler(logits, metadata)
            failed, lp = out.failed_rows, out.logprobs
            keep = np.array([i not in failed for i in range(len(sampled_rows))], dtype=bool)
            rows = sampled_rows[keep]
            token_ids = out.sampled_token_ids
            if not keep.all():
                token_ids = token_ids[torch.from_numpy(np.nonzero(keep)[0]).to(self.device)]
            (host,), event = start_host_copy([token_ids])
            sampled = SampledTokens(
                [batch.req_ids[b] for b in batch.sampled_batch_idx[keep].tolist()],
                rows.astype(np.int64), self.states.num_tokens[rows].astype(np.int64),
                token_ids, host, event)
            # One placeholder token each, written into token_ids_cpu by a later step.
            self.states.num_tokens[rows] += 1
            self._unwritten_tokens.append(sampled)
        self._last_sampled = sampled
        return AsyncModelRunnerOutput(batch.req_ids, batch.sampled_batch_idx, sampled, failed,
                                      lp, self.states.num_logprobs[sampled_rows],
                                      pending.prompt_logprobs,
                                      None if self.eplb is None else self.eplb.take_stats(),
                                      self._take_request_errors())

    def _sample(self, rows: np.ndarray, logits: torch.Tensor):
        """One token per row. Returns (tokens per row, logprob lists or None, first logprob row
        of each row, {row index: message} of rows whose logits processor failed)."""
        metadata = build_sampling_metadata(self.states, rows, logits.shape[-1], self.device,
                                           self.logprobs_mode)
        out = self.sampler(logits, metadata)
        tokens = out.sampled_token_ids.tolist()
        lp = None if out.logprobs is None else _to_lists(out.logprobs)
        return [[t] for t in tokens], lp, list(range(len(tokens))), out.failed_rows

    def _verify(self, rows: np.ndarray, logits: torch.Tensor, spec: SpecDecodeMetadata):
        """Rejection-sample the drafts; same returns as `_sample`."""
        num_logits = np.diff(spec.cu_num_logits)
        expanded = np.repeat(rows, num_logits)
        offsets = np.arange(spec.num_logits) - np.repeat(spec.cu_num_logits[:-1], num_logits)
        metadata = build_sampling_metadata(self.states, expanded, logits.shape[-1], self.device,
                                           self.logprobs_mode, position_offsets=offsets)
        tokens, dist, emitted_at_row = rejection_sample(self.sampler, logits, metadata, spec)
        lp = self.sampler.logprobs(dist, emitted_at_row, metadata)
        request_of_row = np.repeat(np.arange(len(rows)), num_logits)
        failed = {int(request_of_row[j]): message for j, message in dist.failed_rows.items()}
        return (tokens, None if lp is None else _to_lists(lp), spec.cu_num_logits[:-1].tolist(),
                failed)

    def _max_drafts(self, rows: np.ndarray) -> np.ndarray:
        """[len(rows)] most drafts each request slot may get next step (`max_drafts`)."""
        return max_drafts(self.states, rows, self.spec_config.num_speculative_tokens,
                          self.config.max_model_len)

    # ----------------------------------------------------------------- multi-step rounds
    @torch.inference_mode()
    def run_remaining_steps(self, num_steps: int, output: ModelRunnerOutput
                            ) -> ModelRunnerOutput:
        """Steps 2..`num_steps` of a multi-step round, after `execute_model` and
        `sample_tokens` ran step 1 and returned `output`, which takes the later tokens too
        (`MultiStepRound.run`)."""
        inputs, self._last_inputs = self._last_inputs, None
        if inputs is None or num_steps < 2:
            return output
        return self.multi_step.run(inputs, num_steps - 1, output)

    def _advance_decode_inputs(self, inputs: StepInputs) -> StepInputs:
        """The next step of a multi-step round for the same requests: each decodes the token it
        sampled last, one position further (what `_prepare_inputs` would build, without the
        per-request gathering)."""
        st = self.states
        batch, common = inputs.batch, inputs.common
        rows = batch.idx_mapping
        n = len(rows)
        st.num_computed_tokens[rows] += 1
        positions = st.num_computed_tokens[rows].astype(np.int64)
        self.input_ids[:n].copy_(torch.from_numpy(st.token_ids_cpu[rows, positions]))
        self.positions[:n].copy_(torch.from_numpy(positions))
        seq_lens = (positions + 1).astype(np.int32)
        seq_lens_fields = dict(seq_lens=torch.from_numpy(seq_lens).to(self.device),
                               seq_lens_cpu=seq_lens, max_seq_len=int(seq_lens.max()))
        if self.kv_cache_windows == (None,):
            # The round's blocks were all in the block table from its first step.
            self.slot_mappings[0, :n].copy_(torch.from_numpy(
                st.block_table.compute_slot_mapping(rows, positions)), non_blocking=True)
            return StepInputs(replace(batch, seq_lens_np=seq_lens),
                              replace(common, **seq_lens_fields))
        block_tables = self._compute_block_tables(rows, rows, positions, positions)
        common = replace(common, block_table=block_tables[0], **seq_lens_fields)
        group_commons = () if len(block_tables) == 1 else tuple(
            replace(common, block_table=table, slot_mapping=self.slot_mappings[g, :n])
            for g, table in enumerate(block_tables))
        return StepInputs(replace(batch, seq_lens_np=seq_lens, group_commons=group_commons),
                          common)

    def _gather_decode_inputs(self, req_ids: list[str]) -> StepInputs:
        """The next step of a multi-step round for `req_ids` (after others left the round): each
        decodes the token it sampled last, one position further, in blocks the scheduler gave
        it for the whole round."""
        st = self.states
        idx_mapping = np.array([st.req_id_to_index[r] for r in req_ids], dtype=np.int64)
        st.num_computed_tokens[idx_mapping] += 1
        inputs = StepInputs(*self._gather_inputs(
            req_ids, idx_mapping, np.ones(len(req_ids), dtype=np.int32), {}))
        self._set_active_loras(inputs.batch)
        return inputs

def _to_lists(t: LogprobsTensors) -> LogprobsLists:
    return LogprobsLists(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist())
