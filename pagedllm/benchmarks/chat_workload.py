"""Chat workload (`pagedllm bench latency --workload chat`): seeded everyday questions and
requests (explain, compare, list, write a short text), the kind of prompt an assistant model
answers in free prose, rendered with the tokenizer's chat template when it has one.

Each prompt is one instruction template filled with one topic. The topics are split in two
disjoint halves: `split="eval"` (the benchmark's, default) and `split="train"` (what
`scripts/train_eagle3.py` distils a speculative head on), so a head trained on the one is measured
on questions about other subjects. The engine runs each request greedily for exactly `output_len`
tokens, as every latency workload.
"""

from __future__ import annotations

import numpy as np

from pagedllm.benchmarks.workload import BenchRequest

_TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the immune system",
    "plate tectonics", "the French Revolution", "the printing press", "climate change",
    "renewable energy", "the human heart", "honeybees", "the Roman Empire", "electricity",
    "the internet", "vaccines", "the Moon", "rainbows", "earthquakes", "the Great Wall of China",
    "DNA", "gravity", "the stock market", "inflation", "recycling", "coral reefs",
    "the Industrial Revolution", "chess", "jazz music", "the Olympic Games", "dinosaurs",
    "the solar system", "machine learning", "blockchain", "coffee", "sleep", "meditation",
    "the Amazon rainforest", "deserts", "tides", "magnets", "the Renaissance", "democracy",
    "bread baking", "bicycles", "airplanes", "submarines", "the human brain", "antibiotics",
    "glaciers", "hurricanes", "the Silk Road", "ancient Egypt", "the Moon landing",
    "nuclear power", "solar panels", "electric cars", "trees", "mushrooms", "octopuses",
    "penguins", "wolves", "elephants", "the ocean", "clouds", "snow", "lightning", "soil",
    "composting", "gardening", "cooking pasta", "learning a language", "public speaking",
    "time management", "saving money", "running", "swimming", "yoga", "friendship",
    "teamwork", "writing an essay", "job interviews", "remote work", "video games",
    "photography", "painting", "the piano", "poetry", "libraries", "museums", "maps",
    "the metric system", "prime numbers", "fractions", "probability", "the Pythagorean theorem",
    "computers", "smartphones", "passwords", "email", "robots", "satellites", "telescopes",
    "microscopes", "bacteria", "viruses", "the digestive system", "bones", "muscles",
    "vitamins", "water", "salt", "sugar", "chocolate", "tea", "rice", "bridges", "skyscrapers",
    "trains", "rivers", "mountains", "islands", "the Arctic", "Antarctica", "the seasons",
)
_TEMPLATES = (
    "Explain {t} in simple terms.",
    "What is {t}? Give a short explanation.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "Why is {t} important?",
    "How would you explain {t} to a ten-year-old?",
    "Write a short poem about {t}.",
    "List some common questions people ask about {t}, and answer one of them.",
    "Tell me about the history of {t}.",
    "What are the advantages and disadvantages of {t}?",
    "Write a short story that involves {t}.",
    "Summarize what everyone should know about {t}.",
)


def chat_topics(split: str = "eval") -> tuple[str, ...]:
    """The topics of one split: "eval" (every fourth topic) or "train" (the rest).

    Raises:
        ValueError: another split name.
    """
    if split not in ("eval", "train"):
        raise ValueError(f"split must be 'eval' or 'train', got {split!r}")
    return tuple(t for i, t in enumerate(_TOPICS) if (i % 4 == 0) == (split == "eval"))


def chat_prompts(num_prompts: int, seed: int = 0, split: str = "eval") -> list[str]:
    """`num_prompts` question texts (seeded): a template and a topic of `split` each, no pair
    twice until all pairs are used."""
    topics = chat_topics(split)
    rng = np.random.default_rng(seed)
    pairs = [(t, q) for t in topics for q in _TEMPLATES]
    out: list[str] = []
    while len(out) < num_prompts:
        for i in rng.permutation(len(pairs))[:num_prompts - len(out)]:
            topic, template = pairs[i]
            out.append(template.format(t=topic))
    return out


def encode_chat(tokenizer, text: str) -> list[int]:
    """`text` as one user turn through `tokenizer`'s chat template with the generation prompt
    (plain encoding when it has no template) -> token ids."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):   # a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text)["input_ids"])


def make_chat_workload(tokenizer, num_prompts: int, output_len: int, seed: int = 0,
                       split: str = "eval") -> list[BenchRequest]:
    """The questions as token ids, each with `output_len` output tokens.

    Raises:
        ValueError: for num_prompts or output_len below 1, or an unknown split.
    """
    if num_prompts < 1 or output_len < 1:
        raise ValueError(f"num_prompts and output_len must be >= 1, got {num_prompts}, "
                         f"{output_len}")
    return [BenchRequest(prompt_token_ids=encode_chat(tokenizer, text), output_len=output_len)
            for text in chat_prompts(num_prompts, seed, split)]
