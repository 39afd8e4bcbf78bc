"""Attention backends. Each exposes `build_metadata(common)` and `forward(...)`."""
