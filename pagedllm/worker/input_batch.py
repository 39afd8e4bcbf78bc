"""Persistent per-request state in fixed slots, the per-step InputBatch gathered from it, and
the recording of sampled tokens.

Requests keep the slot (`req_index`) they got when they arrived until they finish or are
preempted; a step lists its requests in `idx_mapping` (batch_idx -> req_index), as vLLM's
runner v2 does, so nothing is condensed or reordered when requests come and go.
`record_sampled_tokens` is the one place a sampled token is recorded, for every sampling path
(a step, a multi-step round's later steps, the native decode loop, an async step's output).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedllm.attention.metadata import CommonAttentionMetadata
from pagedllm.core.sched_output import LogprobsLists, ModelRunnerOutput, NewRequestData
from pagedllm.spec_decode.metadata import SpecDecodeMetadata
from pagedllm.worker.block_table import BlockTable

_INT32_MAX = 2**31 - 1


class RequestStates:
    """Token ids, progress and sampling parameters of every live request, by slot.

    Arrays (all numpy, CPU):
        token_ids_cpu: [max_num_reqs, max_model_len + 1] int32, prompt then output tokens (one
            spare column: a request that reaches max_model_len still gets its last token).
        num_tokens, num_prompt_tokens, num_computed_tokens: [max_num_reqs] int32.
        temperature, top_p, min_p, presence/frequency/repetition penalties: [max_num_reqs] float32.
        top_k, min_tokens: [max_num_reqs] int32; seeds: [max_num_reqs] int64 (valid where
        has_seed).
        block_tables: one BlockTable per KV cache group (`block_table` is group 0's).
        lora_requests: [max_num_reqs] each slot's LoRA adapter (None: the base model).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_num_blocks_per_req: int,
                 block_size: int, num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.req_id_to_index: dict[str, int] = {}
        self.free_indices = list(range(max_num_reqs - 1, -1, -1))
        self.token_ids_cpu = np.zeros((max_num_reqs, max_model_len + 1), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_reqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_reqs, dtype=np.float32)
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.seeds = np.zeros(max_num_reqs, dtype=np.int64)
        self.has_seed = np.zeros(max_num_reqs, dtype=bool)
        self.stop_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.num_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)          # -1 = off
        self.num_prompt_logprobs = np.full(max_num_reqs, -1, dtype=np.int32)   # -1 = off
        # Rarely used per-request settings, kept as Python objects by slot.
        self.logit_bias: list[dict[int, float] | None] = [None] * max_num_reqs
        self.allowed_token_ids: list[list[int] | None] = [None] * max_num_reqs
        self.bad_words_token_ids: list[list[list[int]]] = [[] for _ in range(max_num_reqs)]
        self.logits_processors: list[list | None] = [None] * max_num_reqs
        self.lora_requests: list = [None] * max_num_reqs
        # `SamplingParams.reads_previous_tokens`: penalties, bad words, logits processors.
        self.reads_previous_tokens = np.zeros(max_num_reqs, dtype=bool)
        # Greedy with nothing that edits the logits or asks for logprobs: the sampler's argmax
        # alone (`build_sampling_metadata`'s fast path).
        self.plain_greedy = np.zeros(max_num_reqs, dtype=bool)
        # Requests with structured output (a grammar masks their logits).
        self.structured = np.zeros(max_num_reqs, dtype=bool)
        self.block_tables = [BlockTable(max_num_reqs, max_num_blocks_per_req, block_size)
                             for _ in range(num_kv_cache_groups)]

    @property
    def block_table(self) -> BlockTable:
        """Group 0's block table (the only one for a model with one attention type)."""
        return self.block_tables[0]

    def add_request(self, req: NewRequestData) -> int:
        """Give `req` a free slot and fill it; returns the slot.

        Raises:
            RuntimeError: when every slot is taken.
            ValueError: when `req.block_ids` has not one list per KV cache group.
        """
        if len(req.block_ids) != len(self.block_tables):
            raise ValueError(f"request {req.req_id!r} has block ids for {len(req.block_ids)} KV "
                             f"cache groups, the model has {len(self.block_tables)}")
        if not self.free_indices:
            raise RuntimeError(f"more than max_num_reqs={self.max_num_reqs} live requests")
        idx = self.free_indices.pop()
        self.req_id_to_index[req.req_id] = idx
        tokens = req.prompt_token_ids + req.output_token_ids
        self.token_ids_cpu[idx, :len(tokens)] = tokens
        self.num_tokens[idx] = len(tokens)
        self.num_prompt_tokens[idx] = len(req.prompt_token_ids)
        self.num_computed_tokens[idx] = req.num_computed_tokens
        sp = req.sampling_params
        self.temperature[idx] = sp.temperature
        self.top_p[idx] = sp.top_p
        # int32 slots: a top_k beyond any vocabulary means "all tokens" just as well; min_tokens
        # beyond max_model_len can never be reached either way.
        self.top_k[idx] = min(sp.top_k, _INT32_MAX)
        self.min_p[idx] = sp.min_p
        self.presence_penalty[idx] = sp.presence_penalty
        self.frequency_penalty[idx] = sp.frequency_penalty
        self.repetition_penalty[idx] = sp.repetition_penalty
        self.min_tokens[idx] = min(sp.min_tokens, _INT32_MAX)
        self.has_seed[idx] = sp.seed is not None
        self.seeds[idx] = sp.seed or 0
        self.stop_token_ids[idx] = sorted(sp.all_stop_token_ids)
        self.num_logprobs[idx] = -1 if sp.logprobs is None else sp.logprobs
        self.num_prompt_logprobs[idx] = -1 if sp.prompt_logprobs is None else sp.prompt_logprobs
        self.logit_bias[idx] = sp.logit_bias
        self.allowed_token_ids[idx] = sp.allowed_token_ids
        self.bad_words_token_ids[idx] = sp._bad_words_token_ids
        self.logits_processors[idx] = sp.logits_processors
        self.lora_requests[idx] = req.lora_request
        self.reads_previous_tokens[idx] = sp.reads_previous_tokens
        self.plain_greedy[idx] = (
            sp.temperature == 0.0 and not sp.reads_previous_tokens and sp.min_tokens == 0
            and sp.logprobs is None and not sp.logit_bias and sp.allowed_token_ids is None)
        self.structured[idx] = sp.structured_outputs is not None
        for table, block_ids in zip(self.block_tables, req.block_ids):
            table.add_row(block_ids, idx)
        return idx

    def remove_request(self, req_id: str) -> None:
        idx = self.req_id_to_index.pop(req_id, None)
        if idx is not None:
            self.free_indices.append(idx)

    def append_tokens(self, idx: int, token_ids: list[int]) -> None:
        """Append sampled tokens to slot `idx` (never past the spare last column)."""
        start = self.num_tokens[idx]
        end = min(start + len(token_ids), self.max_model_len + 1)
        self.token_ids_cpu[idx, start:end] = token_ids[:end - start]
        self.num_tokens[idx] = end


@dataclass(frozen=True)
class InputBatch:
    """One step's flattened inputs (built by the runner from the SchedulerOutput).

    Attributes:
        req_ids: [num_reqs] request ids in batch order.
        idx_mapping: [num_reqs] int64 numpy, batch_idx -> req_index (slot).
        num_scheduled_tokens: [num_reqs] int32 numpy.
        query_start_loc_np: [num_reqs + 1] int32 numpy.
        seq_lens_np: [num_reqs] int32 numpy.
        input_ids: [num_tokens] int64 (device).
        positions: [num_tokens] int64 (device).
        logits_indices: [num_sampled] int64 (device), last token of each sampled request.
        sampled_batch_idx: [num_sampled] int64 numpy, batch rows that sample this step (rows
            whose prompt is still partially uncomputed do not).
        spec_decode_metadata: where drafts are verified, when any were scheduled (then
            logits_indices holds k+1 rows per sampled request with k drafts).
        group_commons: [num_kv_cache_groups] each group's attention inputs (its block table and
            slot mapping) when the model has several KV cache groups; empty with one.
        inputs_embeds: [num_tokens, hidden] (device) the decoder's input embeddings when some
            tokens are image placeholders (worker/encoder_runner.py); None: embed input_ids.
    """

    req_ids: list[str]
    idx_mapping: np.ndarray
    num_scheduled_tokens: np.ndarray
    query_start_loc_np: np.ndarray
    seq_lens_np: np.ndarray
    input_ids: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    sampled_batch_idx: np.ndarray
    spec_decode_metadata: SpecDecodeMetadata | None = None
    group_commons: tuple[CommonAttentionMetadata, ...] = ()
    inputs_embeds: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


@dataclass(frozen=True)
class StepInputs:
    """A forward's inputs: the batch and its attention metadata (group 0's, or the only
    group's; the others' are in `batch.group_commons`)."""

    batch: InputBatch
    common: CommonAttentionMetadata


@dataclass(frozen=True)
class PendingStep:
    """A forward whose logits wait for sampling (`ModelRunner.execute_model` ->
    `sample_tokens`, or one step of a multi-step round).

    Attributes:
        inputs: what the forward ran on.
        logits: [num_logits, vocab] float32 (device), the rows at `batch.logits_indices`;
            None where the step ran in the native loop (`greedy_token_ids` instead).
        prompt_logprobs: req_id -> (first prompt token index covered, its logprobs).
        hidden_states: [num_tokens, H'] the hidden states a drafter reads (EAGLE: the
            target's output, EAGLE-3: its auxiliary layers' inputs), else None.
        greedy_token_ids: [num_logits] int64 numpy, the argmax of every logits row, where the
            step ran in the native loop (worker/native_verify.py) and `logits` is None.
    """

    inputs: StepInputs
    logits: torch.Tensor
    prompt_logprobs: dict[str, tuple[int, LogprobsLists]]
    hidden_states: torch.Tensor | None = None
    greedy_token_ids: np.ndarray | None = None


def request_logprobs(lists: LogprobsLists | None, first_row: int, num_tokens: int,
                     num_logprobs: int) -> LogprobsLists | None:
    """One request's part of a step's logprobs: rows `first_row` .. + `num_tokens` of
    `lists`, each with the sampled token and its top `num_logprobs` alternatives; None where
    there are none or the request asked for none (`num_logprobs` -1)."""
    if lists is None or num_logprobs < 0:
        return None
    end, k = first_row + num_tokens, num_logprobs + 1
    return LogprobsLists([ids[:k] for ids in lists.token_ids[first_row:end]],
                         [lps[:k] for lps in lists.logprobs[first_row:end]],
                         lists.ranks[first_row:end])


def record_sampled_tokens(output: ModelRunnerOutput, req_ids: Sequence[str],
                          tokens: Sequence[list[int]],
                          logprobs: Sequence[LogprobsLists | None] | None = None,
                          states: RequestStates | None = None,
                          rows: Sequence[int] | None = None) -> None:
    """Record new sampled tokens of requests: `tokens[i]` (one token, accepted drafts + one, or
    a multi-step round's later tokens) go after `req_ids[i]`'s tokens in `output`'s
    `sampled_token_ids` and, where given, `logprobs[i]` after its logprobs; with `states`, they
    are appended to its slot `rows[i]` too (the runner's states; an async step's output, built
    in the engine thread, has none: its tokens reach them through `SampledTokens.write_to`).
    """
    index = output.req_id_to_index
    for i, (req_id, new) in enumerate(zip(req_ids, tokens)):
        output.sampled_token_ids[index[req_id]].extend(new)
        if states is not None:
            states.append_tokens(rows[i], new)
        lp = None if logprobs is None else logprobs[i]
        if lp is not None:
            earlier = output.logprobs.get(req_id)
            if earlier is None:
                output.logprobs[req_id] = lp
            else:
                earlier.extend(lp)
