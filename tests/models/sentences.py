"""Deterministic English sentences of mixed lengths for embedding tests."""

from __future__ import annotations


def mixed_length_sentences(n: int = 50) -> list[str]:
    """`n` deterministic English sentences of 3 to ~130 tokens."""
    subjects = ["The cat", "A young engineer", "Our small village", "The stock market",
                "This recipe", "The old lighthouse", "My neighbour's dog", "The orchestra",
                "A quantum computer", "The football team"]
    verbs = ["sat quietly near", "talked for hours about", "slowly changed", "was built beside",
             "celebrated", "could not explain", "depends heavily on", "moved towards"]
    objects = ["the window", "the price of bread", "an ancient castle", "the morning tide",
               "a forgotten song", "the new regulations", "the river bank", "winter storms"]
    out = []
    for i in range(n):
        s = f"{subjects[i % 10]} {verbs[i % 8]} {objects[(i * 3) % 8]}."
        out.append(" ".join([s] * (1 + (i * 7) % 12)) if i % 5 else s.split(" ")[1])
    return out
