"""Greedy verification of drafts in the native decode loop (CPU; n-gram, suffix and EAGLE
drafters).

A speculative step verifies each request's last token and its k drafts: k + 1 query rows whose
logits are only ever argmax-ed when every request is plain greedy. The module path runs that
step as ~25 Python/torch calls around the fused decoder (embedding lookup, final norm, LM head
over every row, the sampler's metadata, the rejection sampler), each native call one more
OpenMP fork/join, which on a contended CPU is where a step loses its time slice. The native
decode loop (`native/decode_loop.py`, `decode_greedy_steps`) already computes embedding ->
fused decoder -> final norm -> LM head -> argmax in one call for rows of one token each; a
verification step is such rows: token j of a request at position p + j attends causally to
positions 0 .. p + j, which is what a one-token row with sequence length p + j + 1 over the
request's block table computes (the loop writes every row's K/V before any row attends, a
barrier apart, `cpu_decoder.cpp`). So the step runs as one call of one step with one row per
token, each row given its request's block table, and returns the argmax of every row.

Greedy acceptance (`greedy_accept`) is the rejection sampler's greedy rule (Leviathan et al.
2023; `sample/rejection_sampler.py`): accept drafts while each equals the target's argmax at its
position, then emit the argmax at the first mismatch (the bonus token after the last draft when
all match). The single-row arithmetic is the plain engine's native decode steps', so greedy
outputs equal those without speculation (tests/spec_decode/test_native_verify.py).

EAGLE heads also read the target's hidden states at every verified token: the final norm's
output (EAGLE), or the streams entering three auxiliary layers (EAGLE-3). `run` returns
them from the same call (the loop splits its layer call at those layers and copies the
stream there, `cpu_decode_loop.cpp`), so an EAGLE-3 step verifies in one native call instead
of the module path's split stack, separate LM head over every row and rejection sampler.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.native.decode_loop import GreedyDecodeLoop
from pagedllm.spec_decode.metadata import SpecDecodeMetadata


def greedy_accept(targets: np.ndarray, spec: SpecDecodeMetadata | None) -> list[list[int]]:
    """Tokens each request emits from the argmax of its logits rows.

    Args:
        targets: [num_logits] int64, the argmax of every logits row (request b's rows are
            [cu_num_logits[b], cu_num_logits[b + 1]) with spec; one row each without).
        spec: where the drafts are (None: a step without drafts, one token per request).

    Returns:
        Per request, its accepted drafts followed by one target token (1 .. k + 1 tokens).
    """
    if spec is None:
        return [[t] for t in targets.tolist()]
    cu = spec.cu_num_logits
    drafts = spec.draft_token_ids
    out: list[list[int]] = []
    draft_start = 0
    for b in range(len(cu) - 1):
        lo, hi = int(cu[b]), int(cu[b + 1])
        k = hi - lo - 1
        row_targets = targets[lo:hi]
        mismatch = np.flatnonzero(row_targets[:k] != drafts[draft_start:draft_start + k])
        n = int(mismatch[0]) if len(mismatch) else k
        out.append(row_targets[:n + 1].tolist())
        draft_start += k
    return out


class NativeGreedyVerify:
    """Runs a step whose requests all decode (one token, or one plus drafts) and are all plain
    greedy through `loop` with one row per token; see the module docstring.

    Args:
        loop: the model's native greedy decode loop (`GreedyDecodeLoop.for_model`).
        block_size: tokens per KV block.
        head_states: the drafter is an EAGLE head, which reads the target's hidden states at
            every verified token: `run` returns them too.
        aux_layers: with `head_states`, EAGLE-3's auxiliary layers (non-decreasing indices:
            the states are the streams entering them), or None (EAGLE: the final norm's
            output).
    """

    def __init__(self, loop: GreedyDecodeLoop, block_size: int, head_states: bool = False,
                 aux_layers: tuple[int, ...] | None = None) -> None:
        self.loop = loop
        self.block_size = block_size
        self.head_states = head_states
        self.aux_layers = aux_layers
        self.num_steps_run = 0   # steps it took (tests and benchmarks read it)

    def applies(self, num_scheduled_tokens: np.ndarray, num_draft_tokens: np.ndarray,
                seq_lens: np.ndarray, greedy_only: bool, batch_invariant: bool) -> bool:
        """Whether a step can run here: every request decodes (its last token plus its
        drafts, no prompt rows, whose logits nobody reads), all plain greedy, and the fused
        decoder takes one row per token.

        Args:
            num_scheduled_tokens: [num_reqs] tokens each request computes this step.
            num_draft_tokens: [num_reqs] drafts each request verifies this step.
            seq_lens: [num_reqs] each request's sequence length after the step.
            greedy_only: every request plain greedy (`RequestStates.plain_greedy`) and
                unstructured.
            batch_invariant: the engine's batch-invariant mode (the fused decoder must take
                every step then, `FusedDecoder.takes`).
        """
        return (greedy_only and bool((num_scheduled_tokens == 1 + num_draft_tokens).all())
                and self.loop.applies(int(num_scheduled_tokens.sum()), int(seq_lens.max()),
                                      batch_invariant))

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, block_table: torch.Tensor,
            num_scheduled_tokens: np.ndarray) -> tuple[np.ndarray, torch.Tensor | None]:
        """The forward of the step (KV written for every token) and the argmax of every row.

        Args:
            input_ids: [num_tokens] int64, the flat batch's tokens (CPU).
            positions: [num_tokens] int64, their positions.
            block_table: [num_reqs, max_blocks] int32, the step's block table rows.
            num_scheduled_tokens: [num_reqs] int32, tokens per request (consecutive in the
                flat batch).

        Returns:
            ([num_tokens] int64, the argmax of the logits at every token; with `head_states`
            the hidden states the head reads at every token (`GreedyDecodeLoop.run_with_states`):
            [num_tokens, hidden_size] (EAGLE) or [num_tokens, len(aux_layers) * hidden_size]
            (EAGLE-3) in the model dtype, else None).

        Raises:
            ValueError: as `GreedyDecodeLoop.run` (a token id outside the embedding).
        """
        ids, pos = input_ids.numpy(), positions.numpy() - 1
        tables = self._token_tables(block_table, num_scheduled_tokens)
        self.num_steps_run += 1
        if self.head_states:
            return self.loop.run_with_states(ids, pos, tables, self.block_size, self.aux_layers)
        tokens = self.loop.run(ids, pos, tables, self.block_size, 1,
                               [[] for _ in range(len(ids))])
        return tokens[0], None

    @staticmethod
    def _token_tables(block_table: torch.Tensor, num_scheduled_tokens: np.ndarray
                      ) -> torch.Tensor:
        """[num_tokens, max_blocks] int32: each token's request's block table row."""
        req_of_token = np.repeat(np.arange(len(num_scheduled_tokens)), num_scheduled_tokens)
        return block_table.index_select(0, torch.from_numpy(req_of_token)).contiguous()
