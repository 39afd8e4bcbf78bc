"""Allocate the state cache of a hybrid model's recurrent layers and bind it to them.

    states (per recurrent layer, per state tensor): [num_slots, *shape]; slot 0 is the null slot

`num_slots` is the state group's block count (core/kv_cache_groups.py: 1 + max_num_seqs). The
tensors are zeroed once; a request's slot is never cleared when it changes hands: the layers
read a slot only where the request continues a computed prefix (`has_initial_state`).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.layers.state_cache import StateCache


def model_state_layers(model: nn.Module) -> list[StateCache]:
    """The model's recurrent layers' state caches ([] for a model without any)."""
    layers = getattr(model, "state_layers", None)
    return list(layers()) if layers is not None else []


def state_bytes_per_slot(layers: list[StateCache]) -> int:
    """Bytes of one request's states over all `layers`."""
    return sum(layer.bytes_per_slot() for layer in layers)


def allocate_state_caches(layers: list[StateCache], num_slots: int,
                          device: torch.device) -> list[torch.Tensor]:
    """Zeroed state tensors of `num_slots` slots for every layer, bound to it; returns them."""
    tensors = []
    for layer in layers:
        layer.states = [torch.zeros((num_slots, *shape), dtype=dtype, device=device)
                        for shape, dtype in zip(layer.state_shapes, layer.state_dtypes)]
        tensors.extend(layer.states)
    return tensors


def release_state_caches(layers: list[StateCache]) -> None:
    for layer in layers:
        layer.states = []
