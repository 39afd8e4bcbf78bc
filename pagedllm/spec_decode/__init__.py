"""Speculative decoding: draft proposers (n-gram, draft model) and their per-step metadata."""
