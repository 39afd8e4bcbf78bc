"""Pooling over a flat batch against a per-request reference; sentence-transformers config parsing;
PoolingParams validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedllm.pooling.params import PoolingParams
from pagedllm.pooling.pooler import pool
from pagedllm.pooling.st_config import read_st_pooler_config


def test_pool_matches_per_request_reference() -> None:
    torch.manual_seed(0)
    lens = [5, 1, 3, 7]
    hidden = torch.randn(sum(lens), 8)
    qsl = torch.tensor([0, 5, 6, 9, 16], dtype=torch.int32)
    kinds, norms = ["MEAN", "CLS", "LAST", "MEAN"], [False, True, False, True]
    got = pool(hidden.to(torch.bfloat16), qsl, kinds, norms)
    assert got.dtype == torch.float32 and got.shape == (4, 8)
    for r, (kind, norm) in enumerate(zip(kinds, norms)):
        rows = hidden.to(torch.bfloat16).float()[qsl[r]:qsl[r + 1]]
        want = {"MEAN": rows.mean(0), "CLS": rows[0], "LAST": rows[-1]}[kind]
        if norm:
            want = want / want.norm()
        torch.testing.assert_close(got[r], want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown pooling type"):
        pool(hidden, qsl, ["MAX"] * 4, [False] * 4)
    with pytest.raises(ValueError, match="for 4 requests"):
        pool(hidden, qsl, ["MEAN"], [False])


def _write_st(folder: Path, modes: dict, normalize: bool, max_seq_length: int | None) -> None:
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(modes))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(
            json.dumps({"max_seq_length": max_seq_length}))


def test_st_config(tmp_path: Path) -> None:
    assert read_st_pooler_config(str(tmp_path)) is None
    a = tmp_path / "a"
    a.mkdir()
    _write_st(a, {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": False}, False, None)
    cfg = read_st_pooler_config(str(a))
    assert (cfg.pooling_type, cfg.normalize, cfg.max_seq_length) == ("LAST", False, None)
    b = tmp_path / "b"
    b.mkdir()
    _write_st(b, {"pooling_mode_max_tokens": True}, True, 128)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        read_st_pooler_config(str(b))
    (b / "modules.json").write_text(json.dumps([{"type": "sentence_transformers.models.Dense",
                                                 "path": "2_Dense"}]))
    with pytest.raises(ValueError, match="Dense"):
        read_st_pooler_config(str(b))


def test_pooling_params_validation() -> None:
    assert PoolingParams(pooling_type="mean").pooling_type == "MEAN"
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams(pooling_type="max")
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        PoolingParams(truncate_prompt_tokens=0)
