"""Agent-style workload (`pagedllm bench latency --workload agent`): code edits and JSON rewrites
whose prompts hold the text a correct answer repeats, the case suffix decoding targets.

Each request is one task, seeded: a JSON record (8 to 12 fields of names, cities, ids, tags) to
return with one field changed, or a Python function to return with one identifier renamed. The
prompt is the instruction plus the text, rendered with the tokenizer's chat template when it has
one (an instruction-tuned model then answers by copying most of the prompt); the engine runs it
greedily for exactly `output_len` tokens, as every latency workload, or (`ignore_eos=False`,
`bench latency --no-ignore-eos`) until the model's EOS, at most `output_len` tokens: a real
agent's request, which ends with the answer.
"""

from __future__ import annotations

import json

import numpy as np

from pagedllm.benchmarks.workload import BenchRequest

_NAMES = ("alice", "bob", "carol", "dave", "erin", "frank", "grace", "heidi", "ivan", "judy",
          "mallory", "oscar", "peggy", "trent", "victor", "walter")
_CITIES = ("Paris", "Berlin", "Lisbon", "Oslo", "Vienna", "Madrid", "Prague", "Dublin", "Rome",
           "Warsaw", "Athens", "Helsinki")
_TAGS = ("admin", "beta", "billing", "support", "ops", "sales", "legal", "research")
_VARS = ("total", "count", "items", "result", "value", "index", "buffer", "offset", "limit",
         "scale", "weight", "score")


def _json_task(rng: np.random.Generator) -> str:
    record: dict = {"id": int(rng.integers(1000, 99999)),
                    "name": str(rng.choice(_NAMES)).title() + " " + str(rng.choice(_NAMES)).title(),
                    "email": f"{rng.choice(_NAMES)}{int(rng.integers(1, 99))}@example.com",
                    "city": str(rng.choice(_CITIES)), "age": int(rng.integers(18, 90)),
                    "status": "active",
                    "tags": [str(t) for t in rng.choice(_TAGS, size=int(rng.integers(1, 4)),
                                                        replace=False)]}
    for i in range(int(rng.integers(1, 6))):
        record[f"field_{i}"] = str(rng.choice(_CITIES)).lower()
    field = str(rng.choice(["city", "age", "status"]))
    new_value = {"city": str(rng.choice(_CITIES)), "age": int(rng.integers(18, 90)),
                 "status": "inactive"}[field]
    return (f"Rewrite this JSON object with \"{field}\" set to {json.dumps(new_value)}. Keep every "
            f"other field unchanged and output only the JSON.\n\n"
            f"{json.dumps(record, indent=2)}")


def _code_task(rng: np.random.Generator) -> str:
    a, b, c, new = (str(v) for v in rng.choice(_VARS, size=4, replace=False))
    fn = f"update_{rng.choice(_NAMES)}"
    code = (f"def {fn}({a}, {b}):\n"
            f"    {c} = 0\n"
            f"    for i in range(len({a})):\n"
            f"        if {a}[i] > {b}:\n"
            f"            {c} += {a}[i] * {b}\n"
            f"        else:\n"
            f"            {c} -= {a}[i]\n"
            f"    if {c} < 0:\n"
            f"        {c} = -{c}\n"
            f"    return {c} / max(len({a}), 1)\n")
    return (f"Rename the variable `{c}` to `{new}` in this Python function and output the whole "
            f"function.\n\n```python\n{code}```")


def agent_prompts(num_prompts: int, seed: int = 0) -> list[str]:
    """`num_prompts` task texts, alternately JSON rewrites and code edits (seeded)."""
    rng = np.random.default_rng(seed)
    return [(_json_task if i % 2 == 0 else _code_task)(rng) for i in range(num_prompts)]


def make_agent_workload(tokenizer, num_prompts: int, output_len: int,
                        seed: int = 0, ignore_eos: bool = True) -> list[BenchRequest]:
    """The tasks as token ids (through `tokenizer`'s chat template when it has one), each with
    `output_len` output tokens (at most that many, ending at EOS, when not `ignore_eos`).

    Raises:
        ValueError: for num_prompts or output_len below 1.
    """
    if num_prompts < 1 or output_len < 1:
        raise ValueError(f"num_prompts and output_len must be >= 1, got {num_prompts}, "
                         f"{output_len}")
    requests = []
    for text in agent_prompts(num_prompts, seed):
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):   # a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer(text)["input_ids"]
        requests.append(BenchRequest(prompt_token_ids=list(ids), output_len=output_len,
                                     ignore_eos=ignore_eos))
    return requests
