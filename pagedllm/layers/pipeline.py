"""Pipeline-parallel building blocks: which layers a stage holds, placeholders for the others, and
the hand-over of intermediate tensors between stages.

    pp=2, 5 layers:   stage 0: embed, layers 0-2  ──(hidden, residual)──►  stage 1: layers 3-4,
                                                                           norm, LM head, sampling

A stage keeps the model's module tree (so checkpoint names and layer indices stay those of HF)
but holds `PPMissingLayer`s, without parameters, where another stage owns the module.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.distributed.parallel_state import GroupCoordinator


def get_pp_indices(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """[start, end) of the decoder layers held by stage `pp_rank`; the first stages take one
    extra layer each when `num_layers` does not divide evenly.

    Raises:
        ValueError: when there are fewer layers than stages.
    """
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


class PPMissingLayer(nn.Module):
    """Stands where another pipeline stage holds the module; has no parameters, is never run."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another pipeline stage")


class MissingLMHead(PPMissingLayer):
    """The LM head of a stage that is not the last: it does not sample (the last stage samples
    and broadcasts the tokens, see worker/pipeline_sampler.py), so its "logits" are a
    zero-stride view of zeros of the right shape: [n, vocab_size], no memory."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, self.vocab_size, device=hidden.device).expand(hidden.shape[0], -1)


def send_intermediate(pp: GroupCoordinator, hidden: torch.Tensor,
                      residual: torch.Tensor) -> None:
    """Send hidden [n, hidden_size] and residual [n, hidden_size] to the next stage."""
    pp.send(hidden, pp.next_rank)
    pp.send(residual, pp.next_rank)


def recv_intermediate(pp: GroupCoordinator, num_tokens: int, hidden_size: int,
                      dtype: torch.dtype, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Receive (hidden, residual), each [num_tokens, hidden_size], from the previous stage."""
    hidden = pp.recv((num_tokens, hidden_size), dtype, device, pp.prev_rank)
    residual = pp.recv((num_tokens, hidden_size), dtype, device, pp.prev_rank)
    return hidden, residual
