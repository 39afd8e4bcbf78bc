"""Benchmarks behind `pagedllm bench {throughput,latency,serve}`.

workload.py (seeded synthetic requests), presets.py (random-weight checkpoints by name),
throughput.py / latency.py (offline engine), serve.py (HTTP client of a running server),
hf_baseline.py / llamacpp_baseline.py (the same workload elsewhere), report.py (figures, JSON),
cli.py (`add_bench_parser`). Nothing here changes the engine: it is driven through its public
objects only.
"""
