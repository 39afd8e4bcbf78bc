"""User entry points: the offline `LLM` class and the `pagedllm` command line."""
