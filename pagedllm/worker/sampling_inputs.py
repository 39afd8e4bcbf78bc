"""Build SamplingMetadata for the rows sampled this step from the persistent request states."""

from __future__ import annotations

import numpy as np
import torch

from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.worker.input_batch import RequestStates


def _padded_ids(states: RequestStates, rows: np.ndarray, start: np.ndarray, end: np.ndarray,
                pad: int, device: torch.device) -> torch.Tensor:
    """[B, max(end - start)] int64 of token_ids_cpu[row, start:end], padded with `pad`."""
    width = max(int((end - start).max()), 1)
    cols = start[:, None] + np.arange(width)[None, :]
    valid = cols < end[:, None]
    ids = states.token_ids_cpu[rows[:, None], np.minimum(cols, states.max_model_len)]
    return torch.from_numpy(np.where(valid, ids, pad).astype(np.int64)).to(device)


def _output_ids(states: RequestStates, row: int) -> list[int]:
    return states.token_ids_cpu[row, states.num_prompt_tokens[row]:states.num_tokens[row]].tolist()


def _banned_pairs(states: RequestStates, rows: np.ndarray,
                  num_output: np.ndarray) -> tuple[list[int], list[int]]:
    """(row, token) pairs to mask: stop tokens below min_tokens; bad words about to complete."""
    out_rows, out_ids = [], []
    for b in np.nonzero(num_output < states.min_tokens[rows])[0]:
        stop_ids = states.stop_token_ids[rows[b]]
        out_rows += [int(b)] * len(stop_ids)
        out_ids += stop_ids
    for b, row in enumerate(rows):
        bad_words = states.bad_words_token_ids[row]
        if not bad_words:
            continue
        past = _output_ids(states, row)
        for word in bad_words:
            prefix = word[:-1]
            if len(prefix) <= len(past) and (not prefix or past[-len(prefix):] == prefix):
                out_rows.append(b)
                out_ids.append(word[-1])
    return out_rows, out_ids


def build_sampling_metadata(states: RequestStates, rows: np.ndarray, vocab_size: int,
                            device: torch.device, logprobs_mode: str = "raw_logprobs",
                            position_offsets: np.ndarray | None = None) -> SamplingMetadata:
    """rows: [B] slots (req_index) of the logits rows, in order (a slot repeats when its drafts
    are verified); position_offsets: [B] how far past the request's next output position each
    logits row is (0 without speculative decoding)."""
    if position_offsets is None and bool(states.plain_greedy[rows].all()):
        # Every row is a plain argmax (`RequestStates.plain_greedy`): the general path below
        # would find exactly this, after per-row array work every step (docs/benchmarks.md,
        # "Measurements behind choices in the code").
        return SamplingMetadata(
            temperature=torch.zeros(len(rows), dtype=torch.float32, device=device),
            all_greedy=True, all_random=False, top_p=None, top_k=None, min_p=None,
            seeded_rows=[], seeds=[], output_positions=[], presence_penalties=None,
            frequency_penalties=None, repetition_penalties=None, prompt_token_ids=None,
            output_token_ids=None, banned_rows=None, banned_token_ids=None,
            logprobs_mode=logprobs_mode)
    temperature = states.temperature[rows]
    greedy = temperature == 0.0

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    top_p = states.top_p[rows]
    top_k = states.top_k[rows].astype(np.int64)
    min_p = states.min_p[rows]
    num_output = states.num_tokens[rows] - states.num_prompt_tokens[rows]
    if position_offsets is not None:
        num_output = num_output + position_offsets
    seeded = np.nonzero(states.has_seed[rows] & ~greedy)[0]

    presence = states.presence_penalty[rows]
    frequency = states.frequency_penalty[rows]
    repetition = states.repetition_penalty[rows]
    use_penalties = bool(np.any(presence != 0) or np.any(frequency != 0)
                         or np.any(repetition != 1))
    prompt_ids = output_ids = None
    if use_penalties:
        zeros = np.zeros_like(rows)
        prompt_ids = _padded_ids(states, rows, zeros, states.num_prompt_tokens[rows], vocab_size,
                                 device)
        output_ids = _padded_ids(states, rows, states.num_prompt_tokens[rows],
                                 states.num_tokens[rows], vocab_size, device)

    banned_rows, banned_ids = _banned_pairs(states, rows, num_output)

    def index_tensor(values: list[int]) -> torch.Tensor | None:
        return torch.tensor(values, dtype=torch.int64, device=device) if values else None

    allowed_mask = None
    if any(states.allowed_token_ids[r] is not None for r in rows):
        allowed_mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)
        for b, row in enumerate(rows):
            allowed = states.allowed_token_ids[row]
            if allowed is not None:
                allowed_mask[b] = False
                allowed_mask[b, [t for t in allowed if t < vocab_size]] = True
    bias_rows, bias_ids, bias_values = [], [], []
    for b, row in enumerate(rows):
        for token_id, bias in (states.logit_bias[row] or {}).items():
            if token_id < vocab_size:
                bias_rows.append(b)
                bias_ids.append(token_id)
                bias_values.append(bias)
    processors = [(b, states.logits_processors[row], _output_ids(states, row))
                  for b, row in enumerate(rows) if states.logits_processors[row]]
    num_logprobs = states.num_logprobs[rows]
    return SamplingMetadata(
        temperature=tensor(temperature),
        all_greedy=bool(greedy.all()),
        all_random=not bool(greedy.any()),
        top_p=tensor(top_p) if np.any(top_p < 1.0) else None,
        top_k=tensor(top_k) if np.any(top_k > 0) else None,
        min_p=tensor(min_p) if np.any(min_p > 0.0) else None,
        seeded_rows=seeded.tolist(),
        seeds=states.seeds[rows][seeded].tolist(),
        output_positions=num_output[seeded].tolist(),
        presence_penalties=tensor(presence) if use_penalties else None,
        frequency_penalties=tensor(frequency) if use_penalties else None,
        repetition_penalties=tensor(repetition) if use_penalties else None,
        prompt_token_ids=prompt_ids,
        output_token_ids=output_ids,
        banned_rows=index_tensor(banned_rows),
        banned_token_ids=index_tensor(banned_ids),
        allowed_token_mask=allowed_mask,
        logit_bias_rows=index_tensor(bias_rows),
        logit_bias_token_ids=index_tensor(bias_ids),
        logit_bias_values=(torch.tensor(bias_values, dtype=torch.float32, device=device)
                           if bias_rows else None),
        logits_processors=processors,
        max_num_logprobs=int(num_logprobs.max()) if np.any(num_logprobs >= 0) else None,
        logprobs_mode=logprobs_mode,
    )
