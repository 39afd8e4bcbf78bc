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


def build_sampling_metadata(states: RequestStates, rows: np.ndarray, vocab_size: int,
                            device: torch.device) -> SamplingMetadata:
    """rows: [B] slots (req_index) sampled this step, in logits row order."""
    temperature = states.temperature[rows]
    greedy = temperature == 0.0

    def tensor(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    top_p = states.top_p[rows]
    top_k = states.top_k[rows].astype(np.int64)
    min_p = states.min_p[rows]
    num_output = states.num_tokens[rows] - states.num_prompt_tokens[rows]
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

    mt_rows, mt_ids = [], []
    for b in np.nonzero(num_output < states.min_tokens[rows])[0]:
        stop_ids = states.stop_token_ids[rows[b]]
        mt_rows += [b] * len(stop_ids)
        mt_ids += stop_ids
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
        min_tokens_rows=torch.tensor(mt_rows, dtype=torch.int64, device=device) if mt_rows else None,
        min_tokens_stop_ids=(torch.tensor(mt_ids, dtype=torch.int64, device=device)
                             if mt_rows else None),
    )
