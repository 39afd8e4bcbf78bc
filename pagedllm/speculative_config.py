"""Speculative decoding config: `SpeculativeConfig` (vLLM's `speculative_config`) and the
methods it accepts.

Split out of `pagedllm.config` (which re-exports it); see docs/spec_decode.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any


SPEC_METHODS = ("ngram", "draft_model", "suffix", "eagle", "eagle3", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `speculative_config`).

    Attributes:
        method: "ngram" (prompt lookup: propose the tokens that followed the last n-gram's
            previous occurrence), "draft_model" (a small model with the same tokenizer) or
            "suffix" (suffix decoding over the request's tokens and earlier outputs:
            spec_decode/suffix.py), "eagle" / "eagle3" (an EAGLE head fed with the target's
            hidden states: spec_decode/eagle.py), "mtp" (the target checkpoint's own
            DeepSeek-V3 multi-token-prediction layer: spec_decode/mtp.py).
        num_speculative_tokens: draft tokens proposed per step (k).
        prompt_lookup_min / prompt_lookup_max: n-gram sizes tried, longest first (ngram).
        model: the draft model's (or EAGLE head's) checkpoint folder or hub id.
        suffix_decoding_max_tree_depth: longest context suffix matched (suffix).
        suffix_decoding_max_cached_requests: finished requests kept in the global suffix tree,
            FIFO; 0 disables it (suffix).
        suffix_decoding_max_spec_factor: drafts per matched token (suffix).
        suffix_decoding_min_token_prob: lowest path probability proposed (suffix).
        suffix_decoding_min_match_len: shortest context match that proposes (suffix; a
            pagedllm option, not vLLM's: 1, the default, is vLLM's behaviour).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    model: str | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    suffix_decoding_min_match_len: int = 1

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, "
                             f"got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"speculative_config.{name} must be an int >= 1, got {value!r}")
        if not self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
        if self.method in ("draft_model", "eagle", "eagle3") and not self.model:
            raise ValueError("speculative_config.model (the draft checkpoint) is required for "
                             f"method '{self.method}'")
        self._check_suffix_options()

    def _check_suffix_options(self) -> None:
        for name, low in (("suffix_decoding_max_tree_depth", 1),
                          ("suffix_decoding_max_cached_requests", 0),
                          ("suffix_decoding_min_match_len", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"speculative_config.{name} must be an int >= {low}, "
                                 f"got {value!r}")
        factor, prob = self.suffix_decoding_max_spec_factor, self.suffix_decoding_min_token_prob
        if (isinstance(factor, bool) or not isinstance(factor, (int, float))
                or not math.isfinite(factor) or factor <= 0):
            raise ValueError("speculative_config.suffix_decoding_max_spec_factor must be a "
                             f"finite number > 0, got {factor!r}")
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError("speculative_config.suffix_decoding_min_token_prob must be in "
                             f"[0, 1], got {prob!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpeculativeConfig:
        """Build from vLLM-style JSON keys.

        Raises:
            ValueError: `d` is not a dict (e.g. a bare method name), a key is unknown (named),
                or a value is out of range.
        """
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a dict (JSON object) such as "
                             '{"method": "suffix", "num_speculative_tokens": 8}, '
                             f"got {type(d).__name__} {d!r}")
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown speculative_config keys {sorted(unknown)}; known: "
                             f"{sorted(known)}")
        if d.get("method") not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {SPEC_METHODS}, "
                             f"got {d.get('method')!r}")
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs 'num_speculative_tokens'")
        return cls(**d)
