"""The worker's adapter slots (`LoRAModelManager`) on a loaded tiny Llama: the step's token
mapping, slot reuse and eviction (least recently used, never an adapter the step needs), the
host LRU, and a wrapped int8 layer: the base stays int8, the adapter adds x A^T B^T."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoConfig

from pagedllm.lora.config import LoRAConfig
from pagedllm.lora.layers import LoRALinear
from pagedllm.lora.model_manager import LoRAModelManager
from pagedllm.lora.peft import LoRAModelShapes, load_peft_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.model_loader.loader import load_model
from tests.lora.adapters import ALL_LINEAR, ATTENTION, make_peft_adapter


@pytest.fixture(scope="module")
def loras(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("manager_loras")
    specs = [(4, ALL_LINEAR), (8, ATTENTION), (8, ALL_LINEAR)]
    return [LoRARequest(f"l{i}", i + 1, str(make_peft_adapter(
        tiny_llama, folder / f"l{i}", rank, targets, 8, False, seed=i)))
        for i, (rank, targets) in enumerate(specs)]


def _manager(tiny_llama, quantization=None) -> tuple[LoRAModelManager, object]:
    config = AutoConfig.from_pretrained(tiny_llama)
    model = load_model(str(tiny_llama), config, torch.float32, torch.device("cpu"),
                       quantization)
    return LoRAModelManager(model, LoRAModelShapes.from_hf_config(config.to_dict()),
                            LoRAConfig(max_loras=2, max_lora_rank=8, max_cpu_loras=2),
                            torch.device("cpu"), torch.float32), model


def test_slots_mapping_and_eviction(tiny_llama, loras):
    a, b, c = loras
    manager, _ = _manager(tiny_llama)
    manager.set_active_loras([a, None, b], np.array([2, 3, 1], dtype=np.int32))
    assert manager.slot_ids == [1, 2]
    mapping = manager.state.mapping
    assert mapping.token_indices.tolist() == [0, 1, 5]
    assert mapping.segments == ((0, 0, 2), (1, 2, 3))
    manager.set_active_loras([b], np.array([4], dtype=np.int32))
    assert manager.state.mapping.token_indices is None            # one slot, every token
    assert manager.state.mapping.segments == ((1, 0, 4),)
    # c needs a slot: a's (unused since the first step) goes, b's (needed now) stays.
    manager.set_active_loras([c, b], np.array([1, 1], dtype=np.int32))
    assert manager.slot_ids == [3, 2]
    assert list(manager.cpu_cache) == [2, 3]                      # host LRU of 2: a dropped
    manager.set_active_loras([None, None], np.array([1, 1], dtype=np.int32))
    assert manager.state.mapping is None and not manager.active
    with pytest.raises(RuntimeError, match="more than max_loras"):
        manager.set_active_loras([a, b, c], np.array([1, 1, 1], dtype=np.int32))


def test_int8_base_stays_quantized(tiny_llama, loras):
    manager, model = _manager(tiny_llama, "int8")
    wrapper = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(wrapper, LoRALinear)
    assert wrapper.base_layer.weight.dtype == torch.int8
    manager.set_active_loras([loras[0]], np.array([3], dtype=np.int32))
    x = torch.randn(3, wrapper.base_layer.input_size_per_partition)
    adapter = load_peft_adapter(loras[0], manager.shapes, 8)
    delta = torch.cat([x @ adapter.weights[(0, m)][0].t() @ adapter.weights[(0, m)][1].t()
                       for m in ("q_proj", "k_proj", "v_proj")], dim=-1)
    torch.testing.assert_close(wrapper(x), wrapper.base_layer(x) + delta)
