"""Read a sentence-transformers model folder's pooling facts (no sentence-transformers import).

    modules.json                -> which modules follow the transformer (Pooling, Normalize)
    1_Pooling/config.json       -> pooling_mode_{cls_token,mean_tokens,lasttoken,...}
    sentence_bert_config.json   -> max_seq_length

Unsupported pooling modes (max, mean_sqrt_len, weighted mean) and extra modules (Dense) are errors
naming the file, never silently ignored: the vectors would differ from sentence-transformers'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_MODE_TO_TYPE = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                 "pooling_mode_lasttoken": "LAST"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")
_KNOWN_MODULES = ("sentence_transformers.models.Transformer",
                  "sentence_transformers.models.Pooling", "sentence_transformers.models.Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    """A model's pooling defaults.

    Attributes:
        pooling_type: "MEAN", "CLS" or "LAST".
        normalize: L2-normalise pooled vectors.
        max_seq_length: the tokens sentence-transformers keeps per input (None = not set).
    """

    pooling_type: str
    normalize: bool
    max_seq_length: int | None = None


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"corrupt sentence-transformers config {path}: {e}") from e


def read_st_pooler_config(model_path: str) -> PoolerConfig | None:
    """The pooling config of a sentence-transformers folder, or None if it has no modules.json.

    Raises:
        ValueError: for a corrupt file, or a pooling mode / module we do not implement (naming it).
    """
    folder = Path(model_path)
    modules_path = folder / "modules.json"
    if not modules_path.is_file():
        return None
    modules = _read_json(modules_path)
    pooling_type, normalize = None, False
    for module in modules:
        kind = module.get("type", "")
        if kind not in _KNOWN_MODULES:
            raise ValueError(f"{modules_path}: module {kind!r} is not supported "
                             f"(supported: {list(_KNOWN_MODULES)})")
        if kind.endswith(".Normalize"):
            normalize = True
        elif kind.endswith(".Pooling"):
            cfg = _read_json(folder / module.get("path", "") / "config.json")
            used = [k for k in (*_MODE_TO_TYPE, *_UNSUPPORTED_MODES) if cfg.get(k)]
            if len(used) != 1 or used[0] in _UNSUPPORTED_MODES:
                raise ValueError(f"{folder / module.get('path', '')}/config.json: pooling modes "
                                 f"{used} are not supported; exactly one of "
                                 f"{list(_MODE_TO_TYPE)} must be true")
            pooling_type = _MODE_TO_TYPE[used[0]]
    if pooling_type is None:
        return None
    max_seq_length = None
    sbert = folder / "sentence_bert_config.json"
    if sbert.is_file():
        max_seq_length = _read_json(sbert).get("max_seq_length")
    return PoolerConfig(pooling_type, normalize, max_seq_length)
