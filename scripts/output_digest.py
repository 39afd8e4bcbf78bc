"""Digest of a model's outputs on a fixed workload, to show a refactor changed nothing.

    python scripts/output_digest.py MODEL [--dtype bfloat16]

Runs 12 prompts of 16-600 random token ids (greedy, and seeded sampling with top-5 logprobs
and prompt logprobs) in one `generate` call, then prints a SHA-256 over every output's token
ids and logprob floats (their exact bits) and the first outputs' token ids. Run it on two
commits (e.g. from a `git worktree`) with the same MODEL: equal digests mean bit-identical
outputs.
"""

from __future__ import annotations

import argparse
import hashlib
import struct

import numpy as np

from pagedllm import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_model_len=1024)
    vocab = min(len(llm.get_tokenizer()), 32000) - 1
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, int(n)).tolist()}
               for n in rng.integers(16, 600, 12)]
    params = [SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True) if i % 2 == 0
              else SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=48,
                                  logprobs=5, prompt_logprobs=1 if i % 4 == 1 else None,
                                  ignore_eos=True)
              for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    digest = hashlib.sha256()
    for out in outputs:
        c = out.outputs[0]
        digest.update(np.asarray(c.token_ids, dtype=np.int64).tobytes())
        for d in (c.logprobs or []) + [d for d in (out.prompt_logprobs or []) if d]:
            for token, lp in sorted(d.items()):
                digest.update(struct.pack("<qd", token, lp.logprob))
    print("first tokens:", [o.outputs[0].token_ids[:6] for o in outputs[:3]])
    print("digest:", digest.hexdigest())


if __name__ == "__main__":
    main()
