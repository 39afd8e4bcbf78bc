"""OpenAI-compatible HTTP server (`pagedllm serve`): app factory, protocol models, handlers."""
