"""Beam search on top of the engine (vLLM's `LLM.beam_search` algorithm).

Each step every live beam is one request with `max_tokens=1` and `logprobs=2 * beam_width`; the
candidates (beam + one of its top tokens) of each prompt are ranked by the length-penalised score
and the best `beam_width` survive. Beams of one prompt share their common prefix's KV blocks through
the prefix cache's reference counts, so a step recomputes only each beam's last partial block.

    score = cumulative_logprob / len(tokens) ** length_penalty
    (len counts prompt + generated tokens, minus a final EOS; as vLLM's get_beam_search_score)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class BeamSearchParams:
    """beam_width >= 1; max_tokens >= 1 new tokens; length_penalty as in the score above."""

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


def run_beam_search(llm, prompt_token_ids: list[list[int]],
                    params: BeamSearchParams) -> list[BeamSearchOutput]:
    """Beam search for each prompt through `llm.generate` (an `LLM`).

    Raises:
        ValueError: if 2 * beam_width alternatives exceed the engine's max_logprobs.
    """
    from pagedllm.sampling_params import SamplingParams

    # 2 * beam_width candidates per beam (never more than the vocabulary has).
    num_logprobs = min(2 * params.beam_width, llm.llm_engine.input_processor.vocab_size)
    max_logprobs = llm.llm_engine.config.request_limits.max_logprobs
    if 0 <= max_logprobs < num_logprobs:
        raise ValueError(f"beam_width {params.beam_width} needs {num_logprobs} logprobs per "
                         f"step, more than the engine's max_logprobs ({max_logprobs}); start "
                         f"the LLM with max_logprobs={num_logprobs} (or -1)")

    tokenizer = llm.get_tokenizer()
    eos = llm.llm_engine.input_processor.eos_token_ids
    eos_id = eos[0] if eos else None
    step_params = SamplingParams(max_tokens=1, logprobs=num_logprobs,
                                 temperature=params.temperature, ignore_eos=True, detokenize=False)

    def score(beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, eos_id, params.length_penalty)

    live = [[BeamSearchSequence(list(p))] for p in prompt_token_ids]
    completed: list[list[BeamSearchSequence]] = [[] for _ in prompt_token_ids]
    for _ in range(params.max_tokens):
        flat = [(i, beam) for i, beams in enumerate(live) for beam in beams]
        if not flat:
            break
        outputs = llm.generate([b.tokens for _, b in flat], step_params, use_tqdm=False)
        candidates: list[list[BeamSearchSequence]] = [[] for _ in live]
        for (i, beam), out in zip(flat, outputs):
            for token_id, lp in out.outputs[0].logprobs[0].items():
                new = BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [lp.logprob],
                                         beam.cum_logprob + lp.logprob)
                if token_id in eos and not params.ignore_eos:
                    new.finish_reason = "stop"
                    completed[i].append(new)
                else:
                    candidates[i].append(new)
        live = [sorted(c, key=score, reverse=True)[:params.beam_width] for c in candidates]
    results = []
    for i, prompt in enumerate(prompt_token_ids):
        for beam in live[i]:
            beam.finish_reason = "length"
        best = sorted(completed[i] + live[i], key=score, reverse=True)[:params.beam_width]
        for beam in best:
            beam.text = tokenizer.decode(beam.tokens[len(prompt):], skip_special_tokens=True)
        results.append(BeamSearchOutput(best))
    return results
