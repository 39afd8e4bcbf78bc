"""Sampling flags shared by `pagedllm generate` and `pagedllm chat`.

Flags left out take the model's default (`--generation-config`), else SamplingParams' own; they
are checked by SamplingParams before the model loads and combined with the model's defaults after.
"""

from __future__ import annotations

import argparse
from typing import Any

from pagedllm.engine.arg_utils import bounded_int


def add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: str) -> None:
    """Register the sampling flags; `default_max_tokens` says in --max-tokens' help what a
    command uses when neither the flag nor the model sets it."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=bounded_int(1), default=None,
                   help="most tokens to generate per answer (default: the model's "
                        f"max_new_tokens, else {default_max_tokens}); more than the context "
                        "leaves after the prompt is refused")
    g.add_argument("--temperature", type=float, default=None,
                   help="default: the model's, else 1.0 (0: greedy)")
    g.add_argument("--top-p", type=float, default=None, help="default: the model's, else 1.0")
    g.add_argument("--top-k", type=int, default=None, help="default: the model's, else 0 (off)")
    g.add_argument("--min-p", type=float, default=None, help="default: the model's, else 0.0")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="default: the model's, else 1.0")
    g.add_argument("--stop", action="append", default=None,
                   help="stop the answer before this string (repeat the flag for several)")
    g.add_argument("--request-seed", type=int, default=None,
                   help="per-request sampling seed (default: the engine's --seed)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating after the end-of-sequence token (up to --max-tokens)")


def given_sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """SamplingParams keyword arguments of the flags the user gave (others left to defaults).

    Raises:
        ValueError: a value SamplingParams refuses (checked here, before the model loads).
    """
    from pagedllm.sampling_params import SamplingParams

    given = {"max_tokens": args.max_tokens, "temperature": args.temperature,
             "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty}
    given = {name: value for name, value in given.items() if value is not None}
    given.update(stop=args.stop, seed=args.request_seed, ignore_eos=args.ignore_eos)
    SamplingParams(**given)
    return given
