"""Attention over the paged KV cache: step metadata, the forward context and the backends."""
