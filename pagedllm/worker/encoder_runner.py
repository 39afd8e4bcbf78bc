"""EncoderRunner: the worker's side of image inputs - runs the vision encoder for the images
the scheduler asked for, keeps their embeddings (the encoder cache, keyed by image identifier)
and scatters them over each step's image placeholder positions.

    SchedulerOutput.scheduled_encoder_inputs  -> model.embed_multimodal (one batch) -> cache
    SchedulerOutput.free_encoder_mm_hashes    -> dropped from the cache
    step's tokens [num_computed, + num_scheduled) of each request
        x its features' ranges (`MultiModalFeature.embed_range`) -> inputs_embeds rows

Images a model attends bidirectionally (Gemma 3) also set the step's `attend_until` (each
query's last visible key position: the image's last token for the image's own tokens).

A model with M-RoPE (Qwen2.5-VL: `get_mrope_input_positions`) gets each request's three-row
prompt positions and decode delta computed once, when the request reaches the worker (again
after a preemption), and `rope_positions` turns a step's token indices into its RoPE positions:
[3, n] when a step holds image tokens, else [n] shifted by each request's delta.

The scheduler owns the policy (what is cached, budgets: core/encoder_cache_manager.py); this
object only follows it. A step without image tokens gets no `inputs_embeds` (the plain token
path, fused decoder included).
"""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import torch

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.multimodal.inputs import MultiModalFeature
from pagedllm.worker.input_batch import InputBatch, StepInputs


class EncoderRunner:
    """Args:
        model: a model with `embed_multimodal` and `embed_input_ids`.
    """

    def __init__(self, model) -> None:
        self.model = model
        # Image identifier -> its embeddings [num_embeds, hidden] on the model's device.
        self.cache: dict[str, torch.Tensor] = {}
        # Live requests' images (sent with NewRequestData).
        self.features: dict[str, list[MultiModalFeature]] = {}
        # M-RoPE models: live image requests' (prompt positions int64 [3, num_prompt_tokens],
        # mrope_position_delta); requests without images use plain positions.
        self.mrope: dict[str, tuple[np.ndarray, int]] = {}
        self.uses_mrope = hasattr(model, "get_mrope_input_positions")
        # Counters since start-up (`stats()`): encoder batches run, images encoded, seconds.
        self.num_encoder_batches = 0
        self.num_encoded_images = 0
        self.encoder_time_s = 0.0

    @classmethod
    def for_model(cls, model, pipeline_parallel_size: int) -> EncoderRunner | None:
        """The encoder runner of a vision-language model (None for a text-only one).

        Raises:
            ValueError: pipeline parallelism (later stages would need the step's image
                positions for their bidirectional masks), or a model that attends image tokens
                bidirectionally on a backend without `supports_attend_until`.
        """
        if not getattr(model, "supports_multimodal", False):
            return None
        if pipeline_parallel_size > 1:
            raise ValueError(f"{type(model).__name__}: pipeline parallelism is not supported "
                             "for vision-language models yet")
        backend = model.attention_layers()[0].backend
        if (getattr(model, "mm_bidirectional", False)
                and not getattr(backend, "supports_attend_until", False)):
            raise ValueError(
                f"{type(model).__name__} attends image tokens bidirectionally, which the "
                f"{backend.name} attention backend does not support; use torch_sdpa "
                "(PAGEDLLM_ATTENTION_BACKEND=torch_sdpa)")
        return cls(model)

    def update(self, so: SchedulerOutput) -> None:
        """Follow the scheduler: forget dropped requests and evicted images, learn new
        requests' images, then encode this step's scheduled images in one batch.

        Raises:
            RuntimeError: an encoder output whose row count differs from the image's
                placeholders (a processor / model mismatch).
        """
        for mm_hash in so.free_encoder_mm_hashes:
            self.cache.pop(mm_hash, None)
        for req_id in so.finished_req_ids | so.preempted_req_ids:
            self.features.pop(req_id, None)
            self.mrope.pop(req_id, None)
        for req in so.scheduled_new_reqs:
            if req.mm_features:
                self.features[req.req_id] = req.mm_features
                if self.uses_mrope:
                    self.mrope[req.req_id] = self.model.get_mrope_input_positions(
                        len(req.prompt_token_ids), req.mm_features)
        todo: dict[str, MultiModalFeature] = {}
        for req_id, indices in so.scheduled_encoder_inputs.items():
            for i in indices:
                feature = self.features[req_id][i]
                if feature.identifier not in self.cache:
                    todo.setdefault(feature.identifier, feature)
        if not todo:
            return
        start = time.perf_counter()
        outputs = self.model.embed_multimodal([f.data for f in todo.values()])
        if outputs and outputs[0].is_cuda:   # the timer must see the kernels finish
            torch.cuda.synchronize(outputs[0].device)
        self.encoder_time_s += time.perf_counter() - start
        self.num_encoder_batches += 1
        self.num_encoded_images += len(todo)
        for (mm_hash, feature), embeds in zip(todo.items(), outputs):
            if embeds.shape[0] != feature.num_embeds:
                raise RuntimeError(f"the encoder gave {embeds.shape[0]} embeddings for an "
                                   f"image with {feature.num_embeds} placeholders")
            self.cache[mm_hash] = embeds

    def stats(self) -> dict[str, float]:
        """Counters since start-up: `num_encoder_batches` (calls of the vision encoder, one per
        step that encoded anything), `num_encoded_images` and `encoder_time_s` (wall seconds
        inside `embed_multimodal`, the tower and connector; on CUDA up to a synchronize)."""
        return {"num_encoder_batches": self.num_encoder_batches,
                "num_encoded_images": self.num_encoded_images,
                "encoder_time_s": self.encoder_time_s}

    def prepare_inputs(self, inputs: StepInputs) -> StepInputs:
        """`inputs` with `inputs_embeds` [num_tokens, hidden] when any of its tokens is an image
        placeholder (token embeddings elsewhere) and, for bidirectional images, `attend_until`
        in the attention metadata; else `inputs` itself."""
        batch = inputs.batch
        dst, src, spans = [], [], []
        for b, req_id in enumerate(batch.req_ids):
            features = self.features.get(req_id)
            if not features:
                continue
            end = int(batch.seq_lens_np[b])
            start = end - int(batch.num_scheduled_tokens[b])
            q0 = int(batch.query_start_loc_np[b])
            for f in features:
                positions, lo, hi = f.embed_range(start, end)
                if len(positions):
                    dst.append(positions + q0)
                    src.append(self.cache[f.identifier][lo:hi])
                if f.bidirectional and f.offset < end and f.offset + f.length > start:
                    first, last = max(start, f.offset), min(end, f.offset + f.length)
                    spans.append((q0 + first - start, q0 + last - start, f.offset + f.length - 1))
        if not dst:
            return inputs
        embeds = self.model.embed_input_ids(batch.input_ids).clone()
        index = torch.from_numpy(np.concatenate(dst)).to(embeds.device)
        embeds[index] = torch.cat(src).to(embeds.dtype)
        batch, common = replace(batch, inputs_embeds=embeds), inputs.common
        if spans:
            attend_until = batch.positions.clone()
            for lo, hi, last in spans:
                attend_until[lo:hi] = last
            common = replace(common, attend_until=attend_until)
            batch = replace(batch, group_commons=tuple(
                replace(c, attend_until=attend_until) for c in batch.group_commons))
        return StepInputs(batch, common)

    def rope_positions(self, batch: InputBatch) -> torch.Tensor:
        """The RoPE positions of `batch`'s tokens: `batch.positions` (token indices, [n] int64)
        unless an M-RoPE request is in it; then its prompt tokens take their rows of the
        request's positions and later tokens index + delta: [3, n] when some token's rows
        differ (an image token), else [n]."""
        if not self.mrope or not any(r in self.mrope for r in batch.req_ids):
            return batch.positions
        num_scheduled = batch.num_scheduled_tokens
        starts = batch.seq_lens_np - num_scheduled
        qsl = batch.query_start_loc_np
        n = int(qsl[-1])
        index = (np.repeat(starts - qsl[:-1], num_scheduled) + np.arange(n)).astype(np.int64)
        positions = np.broadcast_to(index, (3, n)).copy()
        for b, req_id in enumerate(batch.req_ids):
            state = self.mrope.get(req_id)
            if state is None:
                continue
            table, delta = state
            lo, hi = int(qsl[b]), int(qsl[b + 1])
            p = index[lo:hi]
            in_prompt = p < table.shape[1]
            rows = positions[:, lo:hi]
            rows[:, in_prompt] = table[:, p[in_prompt]]
            rows[:, ~in_prompt] += delta
        if (positions[0] == positions[1]).all() and (positions[0] == positions[2]).all():
            positions = positions[0]
        return torch.from_numpy(np.ascontiguousarray(positions)).to(batch.positions.device)
