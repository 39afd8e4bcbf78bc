"""LoRAModelManager: the worker's adapters: a host LRU of loaded adapters (`max_cpu_loras`),
`max_loras` device slots in every wrapped layer, and the per-step mapping of tokens to slots.

Every live request pins its adapter in the host LRU (`add_request`, when the request reaches
the worker; `remove_request` when it leaves): a pinned adapter is never evicted, so after a
request's arrival its adapter is never read from disk again, and an adapter file that changes or
disappears while its requests run cannot fail a step (`add_request` reports a failed read for
that request alone). Between steps (`set_active_loras`, called by the runner before each
forward) the adapters of the step's requests are made resident: an adapter already in a slot
stays there; another takes a free slot or the least recently used slot no request of this step
needs (the scheduler never schedules more than `max_loras` distinct adapters in one step, so one
always exists).

Under tensor or pipeline parallelism every rank runs its own manager. Each request, with its
adapter, reaches every rank in the SchedulerOutput, so an adapter first named at run time is read
by every rank when its first request arrives, and each keeps its own shard of its own stage's
layers (lora/layers.py). Every rank sees the same steps and applies the same rules, so the ranks
fill the same slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LoRAStepState, wrap_lora_layers
from pagedllm.lora.moe import LoRAFusedMoE
from pagedllm.lora.ops import LoRAMapping
from pagedllm.lora.peft import VOCAB_LAYER, LoRAAdapter, LoRAModelShapes, load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.lora.vocab import LoRAEmbedding, LoRALogits
from pagedllm.native.kernels.lora import NativeLoRAStep


class LoRAModelManager:
    """Adapters of one model on one worker.

    Args:
        model: the loaded model (its layers are wrapped here; see lora/layers.py).
        shapes: the model's projection shapes (adapters are checked against them).
        lora_config: slot count, slot width, host LRU size.
        device, dtype: where and in what dtype the slots live (the model's).
    """

    def __init__(self, model: nn.Module, shapes: LoRAModelShapes, lora_config: LoRAConfig,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = lora_config
        self.shapes = shapes
        self.device = device
        self.state = LoRAStepState()
        self.model_name = type(model).__name__
        self.targets = wrap_lora_layers(model, self.state, lora_config.max_loras,
                                        lora_config.max_lora_rank, device, dtype)
        self.embedding, self.logits = self._wrap_vocab(model, lora_config, device, dtype)
        if self.embedding is not None:
            self.targets[(VOCAB_LAYER, "embed_tokens")] = (self.embedding, 0)
        if self.logits is not None:
            self.targets[(VOCAB_LAYER, "lm_head")] = (self.logits, 0)
        self.wrappers = list({id(w): w for w, _ in self.targets.values()}.values())
        self.has_experts = any(isinstance(w, LoRAFusedMoE) for w in self.wrappers)
        # The embedding, the LM head and the experts read every batch token's slot.
        self._need_batch_slots = self.has_experts or self.embedding is not None \
            or self.logits is not None
        # lora_int_id -> adapter on the host, least recently used first.
        self.cpu_cache: OrderedDict[int, LoRAAdapter] = OrderedDict()
        # lora_int_id -> live requests under it (their adapters stay in cpu_cache).
        self.pins: dict[int, int] = {}
        # slot -> lora_int_id resident there (None: free); slot_last_used: step counter.
        self.slot_ids: list[int | None] = [None] * lora_config.max_loras
        self.slot_ranks = [0] * lora_config.max_loras   # the resident adapter's rank
        self.slot_last_used = [0] * lora_config.max_loras
        self._step = 0

    def _wrap_vocab(self, model: nn.Module, lora_config: LoRAConfig, device: torch.device,
                    dtype: torch.dtype) -> tuple[LoRAEmbedding | None, LoRALogits | None]:
        """The embedding and LM head slots (lora/vocab.py) of the stage holding them (whole on
        every tensor-parallel rank)."""
        from pagedllm.layers.vocab_embedding import VocabEmbedding
        inner = getattr(model, "model", None)
        embed = getattr(inner, "embed_tokens", None)
        head = getattr(model, "lm_head", None)
        args = (lora_config.max_loras, lora_config.max_lora_rank, device)
        from pagedllm.layers.pipeline import PPMissingLayer
        embedding = None
        if isinstance(embed, VocabEmbedding):
            embedding = LoRAEmbedding(embed, self.state, *args, dtype)
        logits = None
        if isinstance(head, VocabEmbedding):
            logits = LoRALogits(head, *args)
        # Modules this model has (not another pipeline stage's) but takes no adapter on, as
        # a vision-language model's embedding (looked up outside the runner's forward).
        self.vocab_unsupported = {name for name, module, wrapper in (
            ("embed_tokens", embed, embedding), ("lm_head", head, logits))
            if wrapper is None and not isinstance(module, PPMissingLayer)}
        return embedding, logits

    @property
    def active(self) -> bool:
        """Whether the current step has tokens under an adapter."""
        return self.state.mapping is not None

    @property
    def vocab_active(self) -> bool:
        """Whether the current step's adapters include one on the embedding or the LM head
        (which the native multi-step decode loop does not apply)."""
        mapping = self.state.mapping
        return mapping is not None and any(
            w is not None and w.active(mapping.segments) for w in (self.embedding, self.logits))

    def compute_logits(self, model: nn.Module, hidden: torch.Tensor,
                       rows: torch.Tensor | slice) -> torch.Tensor:
        """The logits [m, vocab_size] float32 of the step's batch rows `rows` ([m] int64 on
        the device, or a slice: positions in the flat batch) from `hidden` [n, hidden_size]:
        the model's LM head, plus each row's LM head adapter (lora/vocab.py)."""
        picked = hidden[rows]
        logits = model.compute_logits(picked)
        mapping = self.state.mapping
        if self.logits is not None and mapping is not None \
                and self.logits.active(mapping.segments):
            self.logits.add_lora(picked, mapping.batch_slots[rows], logits)
        return logits

    def add_request(self, lora_request: LoRARequest) -> str | None:
        """Pin a new live request's adapter on the host, reading it on a miss.

        Returns:
            None, or the reason the adapter cannot be read (its file changed or went away since
            the front end checked it) or applied (an embedding / LM head target on a model
            that takes none there): that request then fails alone, unpinned.
        """
        try:
            adapter = self._get_adapter(lora_request)
        except (ValueError, OSError) as e:
            return f"LoRA adapter {lora_request.lora_name!r} could not be loaded: {e}"
        unsupported = sorted(m for layer, m in adapter.weights
                             if layer == VOCAB_LAYER and m in self.vocab_unsupported)
        if unsupported:
            return (f"LoRA adapter {lora_request.lora_name!r} targets {unsupported[0]}, which "
                    f"this model ({self.model_name}) takes no adapter on (only the Llama-family "
                    f"and MoE text models' embedding and LM head)")
        lora_id = lora_request.lora_int_id
        self.pins[lora_id] = self.pins.get(lora_id, 0) + 1
        return None

    def remove_request(self, lora_int_id: int) -> None:
        """Unpin the adapter of a request that left the worker (finished or preempted)."""
        count = self.pins.get(lora_int_id, 0) - 1
        if count > 0:
            self.pins[lora_int_id] = count
        else:
            self.pins.pop(lora_int_id, None)
            self._evict_unpinned()

    def set_active_loras(self, lora_requests: Sequence[LoRARequest | None],
                         num_scheduled_tokens: np.ndarray) -> None:
        """Make this step's adapters resident and map its tokens to slots.

        Args:
            lora_requests: [num_reqs] each batch row's adapter (None: the base model).
            num_scheduled_tokens: [num_reqs] int32, the rows' tokens in the flat batch.

        Raises:
            ValueError: an adapter that fails to load (the front end checked it at admission;
                only a file changed since can fail here).
            RuntimeError: more distinct adapters than slots (a scheduler bug).
        """
        self._step += 1
        ids = np.fromiter((0 if r is None else r.lora_int_id for r in lora_requests),
                          dtype=np.int64, count=len(lora_requests))
        wanted, first_row = np.unique(ids[ids > 0], return_index=True)
        if not len(wanted):
            self.state.mapping = None
            return
        if len(wanted) > len(self.slot_ids):
            raise RuntimeError(f"{len(wanted)} adapters in one step, more than max_loras="
                               f"{len(self.slot_ids)}")
        positive_rows = np.nonzero(ids > 0)[0]
        slot_of = {int(i): self._ensure_resident(lora_requests[positive_rows[j]],
                                                 set(wanted.tolist()))
                   for i, j in zip(wanted, first_row)}
        row_slots = np.array([slot_of.get(int(i), -1) for i in ids], dtype=np.int64)
        token_slots = np.repeat(row_slots, num_scheduled_tokens)
        counts = np.bincount(token_slots + 1, minlength=len(self.slot_ids) + 1)[1:]
        ends = np.cumsum(counts)
        segments = tuple((slot, int(ends[slot] - counts[slot]), int(ends[slot]))
                         for slot in np.nonzero(counts)[0].tolist())
        # Adapter tokens sorted by slot (stable); base tokens (-1) sort first and are cut.
        order = np.argsort(token_slots, kind="stable")[len(token_slots) - int(ends[-1]):]
        native = None
        if self.device.type == "cpu":
            native = NativeLoRAStep(order, np.array(
                [(*seg, self.slot_ranks[seg[0]]) for seg in segments], dtype=np.int64),
                len(token_slots))
        token_slots_dev = None
        if self.device.type == "cuda":
            token_slots_dev = torch.from_numpy(token_slots[order].astype(np.int32)).to(
                self.device)
        whole = len(segments) == 1 and counts[segments[0][0]] == len(token_slots)
        batch_slots = torch.from_numpy(token_slots).to(self.device) \
            if self._need_batch_slots else None
        self.state.mapping = LoRAMapping(
            None if whole else torch.from_numpy(order).to(self.device), segments, native,
            token_slots_dev, batch_slots)

    def _ensure_resident(self, lora_request: LoRARequest, needed: set[int]) -> int:
        """The slot holding `lora_request`'s adapter, loading it into one if absent (never
        evicting one of `needed`)."""
        lora_id = lora_request.lora_int_id
        if lora_id in self.slot_ids:
            slot = self.slot_ids.index(lora_id)
        else:
            free = [s for s, i in enumerate(self.slot_ids) if i is None]
            slot = free[0] if free else min(
                (s for s, i in enumerate(self.slot_ids) if i not in needed),
                key=lambda s: self.slot_last_used[s])
            self._load_slot(slot, self._get_adapter(lora_request))
        self.slot_last_used[slot] = self._step
        return slot

    def _get_adapter(self, lora_request: LoRARequest) -> LoRAAdapter:
        """The adapter from the host LRU, read from disk on a miss (evicting the least recently
        used unpinned ones beyond max_cpu_loras)."""
        adapter = self.cpu_cache.get(lora_request.lora_int_id)
        if adapter is None or adapter.lora_request != lora_request:
            adapter = load_peft_adapter(lora_request, self.shapes, self.config.max_lora_rank)
            self.cpu_cache[lora_request.lora_int_id] = adapter
        self.cpu_cache.move_to_end(lora_request.lora_int_id)
        self._evict_unpinned()
        return adapter

    def _evict_unpinned(self) -> None:
        """Drop least recently used adapters no live request pins while the host LRU holds more
        than max_cpu_loras (pinned ones may keep it above: at most max_num_seqs of them)."""
        excess = len(self.cpu_cache) - self.config.max_cpu_loras
        for lora_id in [i for i in self.cpu_cache if i not in self.pins][:max(excess, 0)]:
            del self.cpu_cache[lora_id]

    def _load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        self.slot_ids[slot] = None
        for wrapper in self.wrappers:
            wrapper.reset_lora(slot)
        for key, (lora_a, lora_b) in adapter.weights.items():
            target = self.targets.get(key)
            if target is None:
                # Another pipeline stage's layer (adapters are checked against the whole
                # model when read; each stage wraps only its own layers).
                continue
            wrapper, slice_index = target
            wrapper.set_lora(slot, slice_index, lora_a, lora_b)
        self.slot_ids[slot] = adapter.lora_request.lora_int_id
        self.slot_ranks[slot] = adapter.rank

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (host copy and slot); True if it was held."""
        held = self.cpu_cache.pop(lora_int_id, None) is not None
        if lora_int_id in self.slot_ids:
            self.slot_ids[self.slot_ids.index(lora_int_id)] = None
            held = True
        return held

    def list_loras(self) -> set[int]:
        """Ids of the adapters held on the host or in a slot."""
        return set(self.cpu_cache) | {i for i in self.slot_ids if i is not None}
