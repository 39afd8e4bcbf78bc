"""The runner's drafter (speculative decoding, `spec_decode/`): the proposer a config asks for,
and the drafts it proposes for the requests a step sampled.

Proposers by how they draft: from the token history alone (n-gram prompt lookup, suffix trees),
with a small model of their own over their own KV cache (draft model), or with a head fed the
target's hidden states (EAGLE, EAGLE-3, and DeepSeek's MTP layer on the same interface; their
drafts come from `worker/eagle_inputs.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.model_loader.loader import load_model
from pagedllm.spec_decode.draft_model import DraftModelProposer
from pagedllm.spec_decode.eagle import EAGLE_METHODS, EagleProposer, load_eagle_head
from pagedllm.spec_decode.mtp import load_mtp_head
from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.suffix import SuffixDecodingProposer
from pagedllm.worker.input_batch import RequestStates

Drafter = NgramProposer | SuffixDecodingProposer | DraftModelProposer | EagleProposer


def make_drafter(config: EngineConfig, target: torch.nn.Module, dtype: torch.dtype,
                 device: torch.device, run_model: Callable, block_size: int) -> Drafter | None:
    """The proposer of `config.speculative_config` (None: no speculative decoding).

    Args:
        target: the loaded target model (EAGLE and MTP heads share its embedding and LM head;
            an EAGLE-3 head makes it return its auxiliary layers' inputs).
        run_model: the runner's `_run_model` (model drafters run their forwards through it).
        block_size: tokens per KV block (model drafters keep their own paged KV cache).

    Raises:
        ValueError: a head that does not fit the target (`load_eagle_head`, `load_mtp_head`),
            or an EAGLE-3 head for a target without auxiliary hidden states.

    NOTE(eagle): with auxiliary layers the native fused decoder stack runs split at them to
    return their inputs; plain greedy decode / verification steps run in the native decode loop,
    which captures them the same way (worker/native_verify.py).
    """
    sc = config.speculative_config
    if sc is None:
        return None
    k = sc.num_speculative_tokens
    if sc.method == "ngram":
        return NgramProposer(k, sc.prompt_lookup_min, sc.prompt_lookup_max)
    if sc.method == "suffix":
        return SuffixDecodingProposer(k, sc.suffix_decoding_max_tree_depth,
                                      sc.suffix_decoding_max_cached_requests,
                                      sc.suffix_decoding_max_spec_factor,
                                      sc.suffix_decoding_min_token_prob,
                                      sc.suffix_decoding_min_match_len)
    if sc.method == "draft_model":
        from transformers import AutoConfig
        path = config.draft_model_path
        draft = load_model(path, AutoConfig.from_pretrained(path), dtype, device)
        return DraftModelProposer(draft, k, run_model, block_size, device)
    if sc.method in EAGLE_METHODS:
        head, aux = load_eagle_head(config.draft_model_path, sc.method, target, dtype, device)
        if aux:
            if not hasattr(target.model, "aux_hidden_state_layers"):
                raise ValueError(f"{type(target).__name__} cannot feed an EAGLE-3 head "
                                 "(no auxiliary hidden states)")
            target.model.aux_hidden_state_layers = aux
        return EagleProposer(head, k, run_model, block_size, device)
    if sc.method == "mtp":
        return EagleProposer(load_mtp_head(config.model_path, target, dtype, device), k,
                             run_model, block_size, device)
    raise ValueError(f"speculative_config: unknown method {sc.method!r}")


def max_drafts(states: RequestStates, rows: np.ndarray, num_speculative_tokens: int,
               max_model_len: int) -> np.ndarray:
    """[len(rows)] int: most drafts each request slot may get next step. 0 for requests whose
    sampling depends on the tokens before each position (`SamplingParams.reads_previous_tokens`,
    or min_tokens not reached): verifying them would need per-position sampling state."""
    eligible = (~states.reads_previous_tokens[rows]
                & (states.num_tokens[rows] - states.num_prompt_tokens[rows]
                   >= states.min_tokens[rows]))
    return np.where(eligible,
                    np.minimum(num_speculative_tokens, max_model_len - states.num_tokens[rows]), 0)


def propose_drafts(drafter: NgramProposer | SuffixDecodingProposer | DraftModelProposer,
                   states: RequestStates, req_ids: list[str], rows: np.ndarray,
                   limits: np.ndarray) -> dict[str, list[int]]:
    """Draft tokens for the next step of the requests `req_ids` (slots `rows`), at most
    `limits` [len(rows)] each; requests with no draft are left out."""
    st = states
    if isinstance(drafter, NgramProposer):
        proposals = [drafter.propose_one(st.token_ids_cpu[r, :st.num_tokens[r]], int(m))
                     for r, m in zip(rows, limits)]
    elif isinstance(drafter, SuffixDecodingProposer):
        proposals = drafter.propose(req_ids, [st.token_ids_cpu[r, :st.num_tokens[r]] for r in rows],
                                    st.num_prompt_tokens[rows], limits)
    else:
        last = st.num_tokens[rows] - 1
        proposals = drafter.propose(st.token_ids_cpu[rows, last], last,
                                    st.block_table.block_table_np[rows], limits)
    return {r: p for r, p in zip(req_ids, proposals) if p}
