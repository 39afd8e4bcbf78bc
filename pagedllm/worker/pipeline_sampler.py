"""Sampling under pipeline parallelism: only the last stage samples; the tokens reach every stage.

Each stage's runner keeps the request states (token ids, for the first stage's next input ids and
for the sampling metadata), so every stage must record the same tokens. The last stage samples
from its logits and broadcasts the token ids over its pipeline group; the other stages receive
them instead of sampling (their LM head is `layers.pipeline.MissingLMHead`). Logprobs exist on the
last stage only, whose ModelRunnerOutput is the one the engine uses.
"""

from __future__ import annotations

import torch

from pagedllm.distributed.parallel_state import GroupCoordinator, get_pp_group
from pagedllm.sample.metadata import SamplingMetadata
from pagedllm.sample.sampler import Sampler, SamplerOutput


class PipelineStageSampler:
    """Wraps the last stage's `Sampler`; on other stages receives its tokens.

    Same call as `Sampler`: logits [B, V] -> SamplerOutput with sampled_token_ids [B] int64.
    """

    def __init__(self, sampler: Sampler, pp: GroupCoordinator) -> None:
        self.sampler = sampler
        self.pp = pp

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        src = self.pp.ranks[-1]
        if self.pp.is_last_rank:
            out = self.sampler(logits, metadata)
            self.pp.broadcast(out.sampled_token_ids.contiguous(), src)
            return out
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        return SamplerOutput(self.pp.broadcast(tokens, src), None)


def pipeline_stage_sampler(sampler: Sampler) -> Sampler | PipelineStageSampler:
    """`sampler` itself without pipeline parallelism, else its `PipelineStageSampler`."""
    pp = get_pp_group()
    return sampler if pp.world_size == 1 else PipelineStageSampler(sampler, pp)
