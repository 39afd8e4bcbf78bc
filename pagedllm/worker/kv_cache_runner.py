"""The model runner's KV cache side: which KV cache groups the model's layers form, their bytes
per block, and allocating and releasing their tensors (`KVCacheRunnerMixin`).

A mixin of `ModelRunner` (worker/model_runner.py), as vLLM splits its GPU model runner: it reads
the runner's `model`, `drafter`, `config`, `block_size`, `kv_cache_dtype`, `device`, `states` and
`kv_cache_windows`, and writes `kv_cache_windows`, `states`, `slot_mappings`, `kv_caches`,
`state_caches` and `graph_runner`. KV cache groups: core/kv_cache_groups.py; the state group of
hybrid models: core/state_cache_group_manager.py and worker/state_cache.py.
"""

from __future__ import annotations

import torch

from pagedllm.core.kv_cache_groups import (STATE_ALIGN_GROUP, STATE_GROUP, KVCacheGroupSpec,
                                           is_state_group, kv_cache_group_windows,
                                           make_kv_cache_groups)
from pagedllm.indexer_cache_layout import resolve_indexer_cache_dtype
from pagedllm.layers.sparse_mla_attention import IndexerKCache
from pagedllm.native.attach import refresh_native_decoder
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import EagleProposer
from pagedllm.worker.input_batch import RequestStates
from pagedllm.worker.kv_cache import (allocate_kv_caches, kv_cache_bytes_per_block,
                                      kv_cache_layer_groups)
from pagedllm.worker.state_cache import (allocate_state_caches, model_state_layers,
                                         release_state_caches, state_bytes_per_slot)


class KVCacheRunnerMixin:
    """KV cache groups and tensors of a `ModelRunner` (see the module docstring)."""

    def _setup_kv_cache_groups(self) -> None:
        """One KV cache group per attention type of the layers, or a single group where
        several cannot be used.

        NOTE(kv_cache_groups): a draft model shares the target's block table (its proposer writes
        through group 0's), and pipeline stages hold different layers (their groups would have
        to be agreed across ranks); both keep one group for all layers: no block leaves a
        window, the layers still apply their windows in attention.
        """
        attention = self._attention_layers()
        if (self.config.cache_config.indexer_cache_dtype != "auto"
                and not any(isinstance(a, IndexerKCache) for a in attention)):
            raise ValueError(f"indexer_cache_dtype={self.config.cache_config.indexer_cache_dtype!r}"
                             f" applies to DSA models (DeepSeek-V3.2's lightning indexer); "
                             f"{type(self.model).__name__} has no indexer cache")
        windows = (kv_cache_group_windows(a.sliding_window for a in attention) if attention
                   else (None,))
        if (isinstance(self.drafter, (DraftModelProposer, EagleProposer))
                or self.config.parallel_config.pipeline_parallel_size > 1):
            windows = (None,)
        if model_state_layers(self.model):
            # NOTE(state_cache): a hybrid model's recurrent layers keep one state slot per
            # request (core/state_cache_group_manager.py); a draft would need a state per
            # draft position, rolled back to the accepted one, which is not implemented.
            if self.drafter is not None:
                raise ValueError(f"speculative decoding ({self.spec_config.method}) is not "
                                 f"supported for {type(self.model).__name__}: its recurrent "
                                 "layers keep one state per request, which cannot be rolled "
                                 "back to the accepted draft token")
            windows = windows + (STATE_ALIGN_GROUP
                                 if self.config.cache_config.align_state_checkpoints
                                 else STATE_GROUP,)
        self.kv_cache_windows = windows
        if len(windows) != len(self.states.block_tables):
            self.states = RequestStates(self.max_num_reqs, self.config.max_model_len,
                                        self.config.max_num_blocks_per_req, self.block_size,
                                        len(windows))
            self.slot_mappings = torch.zeros((len(windows), self.max_num_tokens),
                                             dtype=torch.int64, device=self.device)

    @property
    def slot_mapping(self) -> torch.Tensor:
        """[max_num_tokens] int64, group 0's slot mapping buffer."""
        return self.slot_mappings[0]

    def kv_cache_groups(self, num_blocks: int) -> tuple[KVCacheGroupSpec, ...]:
        """The groups of a cache whose group 0 has `num_blocks` blocks (the scheduler makes the
        same ones from the same numbers)."""
        sc = self.config.scheduler_config
        return make_kv_cache_groups(num_blocks, self.kv_cache_windows, self.block_size,
                                    sc.max_num_seqs, sc.max_num_batched_tokens,
                                    self.config.num_lookahead_tokens)

    def _attention_layers(self) -> list:
        layers = self.model.attention_layers()
        if isinstance(self.drafter, (DraftModelProposer, EagleProposer)):
            layers = layers + self.drafter.model.attention_layers()
        return layers

    @property
    def indexer_cache_dtype(self) -> torch.dtype:
        """The DSA indexer caches' dtype (`indexer_cache_dtype`; "auto": the KV cache's)."""
        return resolve_indexer_cache_dtype(self.config.cache_config.indexer_cache_dtype,
                                           self.kv_cache_dtype)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one block over every layer (the draft model's included)."""
        return kv_cache_bytes_per_block(self._attention_layers(), self.block_size,
                                        self.kv_cache_dtype, self.indexer_cache_dtype)

    @property
    def _attention_windows(self) -> tuple[int | None, ...]:
        """The attention groups' windows (the state group, if any, is last)."""
        return tuple(w for w in self.kv_cache_windows if not is_state_group(w))

    def kv_cache_group_bytes_per_block(self) -> list[int]:
        """[num_kv_cache_groups] bytes of one block over each group's layers (a state group:
        one request's states)."""
        sizes = [kv_cache_bytes_per_block(layers, self.block_size, self.kv_cache_dtype,
                                          self.indexer_cache_dtype)
                 for layers in kv_cache_layer_groups(self._attention_layers(),
                                                     self._attention_windows)]
        if is_state_group(self.kv_cache_windows[-1]):
            sizes.append(state_bytes_per_slot(model_state_layers(self.model)))
        return sizes

    def _allocate_kv_caches(self, groups: tuple[KVCacheGroupSpec, ...]) -> None:
        layer_groups = kv_cache_layer_groups(self._attention_layers(), self._attention_windows)
        self.kv_caches = [cache for spec, layers in zip(groups, layer_groups)
                          for cache in allocate_kv_caches(layers, spec.num_blocks,
                                                          self.block_size, self.kv_cache_dtype,
                                                          self.device, self.indexer_cache_dtype)]
        self.state_caches = []
        for spec in groups:
            if spec.state:
                self.state_caches = allocate_state_caches(model_state_layers(self.model),
                                                          spec.num_blocks, self.device)
                self.kv_caches += self.state_caches

    def kv_caches_by_layer(self) -> dict[str, torch.Tensor]:
        """Each attention layer's KV tensor by layer name (a draft model's included)."""
        return {a.layer_name: a.kv_cache for a in self._attention_layers()}

    def release_kv_cache(self) -> None:
        """Drop the KV tensors (and the CUDA graphs that point into them); the memory is freed
        once nothing else holds them. `initialize_kv_cache` allocates them again."""
        self.graph_runner = None
        self.kv_caches = []
        self.state_caches = []
        for layer in self._attention_layers():
            layer.kv_cache = torch.empty(0)
        release_state_caches(model_state_layers(self.model))
        refresh_native_decoder(self.model)   # (its structures hold the caches)
