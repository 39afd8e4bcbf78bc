"""Per-request logit edits: allowed-token masks, banned tokens (bad words, min_tokens), logit bias,
and user logits processors."""

from __future__ import annotations

import torch


def apply_allowed_token_mask(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """allowed [B, V] bool (rows without a restriction are all True)."""
    return logits.masked_fill(~allowed, float("-inf"))


def apply_banned_tokens(logits: torch.Tensor, rows: torch.Tensor,
                        token_ids: torch.Tensor) -> torch.Tensor:
    """Set logits[rows[i], token_ids[i]] = -inf (rows/token_ids [k] int64)."""
    return logits.index_put((rows, token_ids), torch.tensor(float("-inf"), device=logits.device))


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    """logits[rows[i], token_ids[i]] += bias[i]."""
    return logits.index_put((rows, token_ids), bias, accumulate=True)


def apply_logits_processors(logits: torch.Tensor, processors: list[tuple[int, list, list[int]]]
                            ) -> tuple[torch.Tensor, dict[int, str]]:
    """processors: (row, [callable], output token ids) -> each callable maps
    (output_token_ids, logits[row] [V]) to new logits for that row.

    Returns (new logits [B, V], {row: message} of the rows whose processor raised or returned
    something that does not fit a [V] row). A failed row fails alone: the caller ends that
    request; the other rows are unaffected.
    """
    logits = logits.clone()
    failed: dict[int, str] = {}
    for row, fns, output_ids in processors:
        row_logits = logits[row]
        fn = None
        try:
            for fn in fns:
                row_logits = fn(list(output_ids), row_logits)
            logits[row] = row_logits
        except Exception as e:  # noqa: BLE001 - user code: its request fails alone
            name = getattr(fn, "__name__", type(fn).__name__)
            failed[row] = f"logits processor {name} failed: {type(e).__name__}: {e}"
    return logits, failed
