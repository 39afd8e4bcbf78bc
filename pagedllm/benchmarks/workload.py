"""Seeded synthetic workloads: random token-id prompts with exact output lengths.

`make_workload(spec)` is a pure function of its `WorkloadSpec`: the same spec (seed included)
gives the same requests, so the engine, Hugging Face and llama.cpp run identical work. Prompts are
token ids drawn uniformly from [token_low, vocab_size), so no tokenizer is needed; every request
ignores EOS and stops at `max_tokens = output_len`, so output lengths are exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedllm.sampling_params import SamplingParams

# Ids below this are skipped: special tokens and the 256 byte tokens of Llama-style vocabularies.
DEFAULT_TOKEN_LOW = 300


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt ids and `output_len`, the tokens it generates (all of them with
    `ignore_eos`, the default; without it at most that many, the request ending at the model's
    EOS as a real client's request does)."""

    prompt_token_ids: list[int]
    output_len: int
    ignore_eos: bool = True


@dataclass(frozen=True)
class WorkloadSpec:
    """What to generate.

    Lengths are fixed (`input_len`, `output_len`) unless a `random_*` range (inclusive
    [low, high], uniform) is given, which then wins.
    """

    num_prompts: int
    vocab_size: int
    input_len: int = 128
    output_len: int = 128
    random_input_len: tuple[int, int] | None = None
    random_output_len: tuple[int, int] | None = None
    seed: int = 0
    token_low: int | None = None

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError("input_len and output_len must be >= 1, got "
                             f"{self.input_len} and {self.output_len}")
        for name in ("random_input_len", "random_output_len"):
            rng = getattr(self, name)
            if rng is not None and not 1 <= rng[0] <= rng[1]:
                raise ValueError(f"{name} must be LOW:HIGH with 1 <= LOW <= HIGH, got {rng}")
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be >= 2, got {self.vocab_size}")

    @property
    def effective_token_low(self) -> int:
        low = self.token_low if self.token_low is not None else DEFAULT_TOKEN_LOW
        return min(low, self.vocab_size // 4)


def parse_len_range(text: str | None) -> tuple[int, int] | None:
    """"32:512" -> (32, 512); None -> None. Raises ValueError for anything else."""
    if text is None:
        return None
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"expected LOW:HIGH, got {text!r}")
    try:
        low, high = int(parts[0]), int(parts[1])
    except ValueError:
        raise ValueError(f"expected integers LOW:HIGH, got {text!r}") from None
    if not 1 <= low <= high:
        raise ValueError(f"expected 1 <= LOW <= HIGH, got {text!r}")
    return low, high


def _lengths(rng: np.random.Generator, n: int, fixed: int,
             bounds: tuple[int, int] | None) -> np.ndarray:
    if bounds is None:
        return np.full(n, fixed, dtype=np.int64)
    return rng.integers(bounds[0], bounds[1] + 1, size=n)


def make_workload(spec: WorkloadSpec) -> list[BenchRequest]:
    """The requests of `spec`, deterministic in `spec` (numpy PCG64 seeded with `spec.seed`)."""
    rng = np.random.default_rng(spec.seed)
    input_lens = _lengths(rng, spec.num_prompts, spec.input_len, spec.random_input_len)
    output_lens = _lengths(rng, spec.num_prompts, spec.output_len, spec.random_output_len)
    low = spec.effective_token_low
    return [BenchRequest(prompt_token_ids=rng.integers(low, spec.vocab_size, size=int(n)).tolist(),
                         output_len=int(m))
            for n, m in zip(input_lens, output_lens)]


def sampling_params_for(request: BenchRequest) -> SamplingParams:
    """Greedy (so HF can run the same work), `max_tokens = output_len`; EOS ignored (exactly
    `output_len` tokens) unless the request says otherwise."""
    return SamplingParams(temperature=0.0, max_tokens=request.output_len,
                          ignore_eos=request.ignore_eos)


def workload_summary(requests: list[BenchRequest]) -> dict[str, int]:
    return {"num_requests": len(requests),
            "num_input_tokens": sum(len(r.prompt_token_ids) for r in requests),
            "num_output_tokens": sum(r.output_len for r in requests),
            "max_input_len": max(len(r.prompt_token_ids) for r in requests),
            "max_output_len": max(r.output_len for r in requests)}
