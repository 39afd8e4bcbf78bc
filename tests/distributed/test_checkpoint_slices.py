"""Lazy checkpoint tensors: a rank narrows a tensor to its shard and reads only that slice."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from pagedllm.model_loader.loader import iterate_checkpoint_tensors


def test_narrowed_checkpoint_tensor_reads_the_slice(tmp_path):
    full = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    save_file({"w": full}, str(tmp_path / "model.safetensors"))
    (name, lazy), = list(iterate_checkpoint_tensors(str(tmp_path), torch.bfloat16))
    assert name == "w" and lazy.shape == full.shape
    part = lazy.narrow(0, 2, 3).narrow(1, 4, 4)
    assert part.shape == (3, 4)
    got = part.materialize()
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, full[2:5, 4:8].to(torch.bfloat16))
    torch.testing.assert_close(lazy.materialize(), full.to(torch.bfloat16))
    with pytest.raises(ValueError, match="outside dimension 0"):
        lazy.narrow(0, 4, 3)
