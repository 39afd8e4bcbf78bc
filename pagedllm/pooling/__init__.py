"""Pooling: turning a model's final hidden states into one vector per request (embeddings).

`params.py` (PoolingParams) and `outputs.py` (EmbeddingRequestOutput) are plain Python for the
front end; `st_config.py` reads sentence-transformers' config files; `pooler.py` is the torch side
used by the pooling runner. See docs/embeddings.md.
"""
