"""Beam search on top of the engine (vLLM's `LLM.beam_search` algorithm).

Each step every live beam is one request with `max_tokens=1` and `logprobs=2 * beam_width`; the
candidates (beam + one of its top tokens) of each prompt are ranked by the length-penalised score
and the best `beam_width` survive. Beams of one prompt share their common prefix's KV blocks through
the prefix cache's reference counts, so a step recomputes only each beam's last partial block.

    score = cumulative_logprob / len(tokens) ** length_penalty
    (len counts prompt + generated tokens, minus a final EOS; as vLLM's get_beam_search_score)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any


# |length_penalty| bound: the score's len ** length_penalty stays a finite, non-zero float for
# any sequence length up to 10**30 tokens (a larger power overflows, or underflows to 0).
MAX_LENGTH_PENALTY = 10.0


@dataclass(frozen=True)
class BeamSearchParams:
    """beam_width >= 1; max_tokens >= 1 new tokens; length_penalty in [-MAX_LENGTH_PENALTY,
    MAX_LENGTH_PENALTY], as in the score above.

    Raises:
        ValueError: naming the field out of range.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        if self.beam_width < 1:
            raise ValueError(f"beam_width must be >= 1, got {self.beam_width}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        check_length_penalty(self.length_penalty)


def check_length_penalty(length_penalty: float) -> None:
    """Raises ValueError naming `length_penalty` unless it is a finite number within
    +-MAX_LENGTH_PENALTY."""
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
            or not -MAX_LENGTH_PENALTY <= length_penalty <= MAX_LENGTH_PENALTY:
        raise ValueError(f"length_penalty must be a number in [-{MAX_LENGTH_PENALTY:g}, "
                         f"{MAX_LENGTH_PENALTY:g}], got {length_penalty!r}")


@dataclass
class BeamSearchSequence:
    """tokens: prompt + generated ids; logprobs: the generated tokens' logprobs."""

    tokens: list[int]
    logprobs: list[float] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float) -> float:
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / (seq_len ** length_penalty)


def beam_search_num_logprobs(beam_width: int, vocab_size: int, max_logprobs: int) -> int:
    """Alternatives asked per beam and step: 2 * beam_width (never more than the vocabulary).

    Raises:
        ValueError: if that exceeds the engine's max_logprobs (-1 = no cap).
    """
    num_logprobs = min(2 * beam_width, vocab_size)
    if 0 <= max_logprobs < num_logprobs:
        raise ValueError(f"beam_width {beam_width} needs {num_logprobs} logprobs per step, more "
                         f"than the engine's max_logprobs ({max_logprobs}); start the engine "
                         f"with max_logprobs={num_logprobs} (or -1)")
    return num_logprobs


class BeamSearch:
    """A beam search over several prompts, stepped by its caller (the offline `LLM` or the
    server), so both run the one algorithm.

    Each step the caller runs every sequence of `pending()` for one token with `step_params` and
    hands `advance` each one's logprobs of that token (`CompletionOutput.logprobs[0]`), in order.

    Args:
        prompt_token_ids: one id list per prompt.
        params: width, length, penalty.
        eos_token_ids: the ids that end a beam (unless params.ignore_eos).
        num_logprobs: alternatives per step (`beam_search_num_logprobs`).
    """

    def __init__(self, prompt_token_ids: list[list[int]], params: BeamSearchParams,
                 eos_token_ids: Collection[int], num_logprobs: int) -> None:
        from pagedllm.sampling_params import SamplingParams

        self.params = params
        self.prompt_token_ids = [list(p) for p in prompt_token_ids]
        self._eos = set(eos_token_ids)
        self._eos_id = next(iter(eos_token_ids), None)
        self.step_params = SamplingParams(max_tokens=1, logprobs=num_logprobs,
                                          temperature=params.temperature, ignore_eos=True,
                                          detokenize=False)
        self._live = [[BeamSearchSequence(list(p))] for p in self.prompt_token_ids]
        self._completed: list[list[BeamSearchSequence]] = [[] for _ in self.prompt_token_ids]
        self._steps = 0

    def _score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self._eos_id,
                                 self.params.length_penalty)

    def pending(self) -> list[list[int]]:
        """The token ids (prompt + generated) of every live beam, prompt by prompt; [] when the
        search is over."""
        if self._steps >= self.params.max_tokens:
            return []
        return [beam.tokens for beams in self._live for beam in beams]

    def advance(self, logprobs: list[dict[int, Any]]) -> None:
        """Extend each pending beam by each of its candidate tokens ({token id: Logprob}) and
        keep the best `beam_width` per prompt."""
        flat = [(i, beam) for i, beams in enumerate(self._live) for beam in beams]
        candidates: list[list[BeamSearchSequence]] = [[] for _ in self._live]
        for (i, beam), entry in zip(flat, logprobs, strict=True):
            for token_id, lp in entry.items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [lp.logprob],
                                         beam.cum_logprob + lp.logprob)
                if token_id in self._eos and not self.params.ignore_eos:
                    new.finish_reason = "stop"
                    self._completed[i].append(new)
                else:
                    candidates[i].append(new)
        self._live = [sorted(c, key=self._score, reverse=True)[:self.params.beam_width]
                      for c in candidates]
        self._steps += 1

    def results(self, tokenizer) -> list[BeamSearchOutput]:
        """The best `beam_width` sequences per prompt, best first, with their text."""
        results = []
        for i, prompt in enumerate(self.prompt_token_ids):
            for beam in self._live[i]:
                beam.finish_reason = "length"
            best = sorted(self._completed[i] + self._live[i], key=self._score,
                          reverse=True)[:self.params.beam_width]
            for beam in best:
                beam.text = tokenizer.decode(beam.tokens[len(prompt):], skip_special_tokens=True)
            results.append(BeamSearchOutput(best))
        return results


def run_beam_search(llm, prompt_token_ids: list[list[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt through `llm.generate` (an `LLM`).

    Raises:
        ValueError: if 2 * beam_width alternatives exceed the engine's max_logprobs.
    """
    engine = llm.llm_engine
    search = BeamSearch(prompt_token_ids, params, engine.input_processor.eos_token_ids,
                        beam_search_num_logprobs(params.beam_width,
                                                 engine.input_processor.vocab_size,
                                                 engine.config.request_limits.max_logprobs))
    while pending := search.pending():
        outputs = llm.generate(pending, search.step_params, use_tqdm=False)
        search.advance([out.outputs[0].logprobs[0] for out in outputs])
    return search.results(llm.get_tokenizer())
