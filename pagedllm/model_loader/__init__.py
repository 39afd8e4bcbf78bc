"""Locate checkpoints (local or hub cache) and load their weights into our model classes."""
