"""Latency: TTFT / TPOT / ITL percentiles by stepping the engine, and a batch-1 roofline.

Requests are added in waves of `batch_size` and stepped to completion by this module's own loop,
which makes the calls `EngineCore.step` and `LLMEngine.step` make (schedule -> execute_model ->
sample_tokens -> update_from_output -> process_outputs) and times each, so the share of a step
spent outside the model forward is measured without touching engine code. Token arrival times are
taken when `process_outputs` hands a request's tokens back, as a streaming client would see them.

Roofline: a decode step must read every weight once (the embedding table excepted: one row per
token) plus the KV cache of its context, so memory bandwidth bounds tokens/s at
batch / ((weight_bytes + kv_bytes) / bandwidth). Bandwidth is measured here with a large torch
copy (read + write) and an fp32 GEMV loop (read only, what a batch-1 decode does).
"""

from __future__ import annotations

import contextlib
import json
import math
import struct
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagedllm.benchmarks.report import load_average, percentiles
from pagedllm.benchmarks.throughput import warmup_prompt
from pagedllm.benchmarks.workload import BenchRequest, sampling_params_for

STEP_PHASES = ("schedule", "execute_model", "sample_tokens", "update_from_output",
               "process_outputs")
# Timed inside execute_model and sample_tokens (so not part of the step total): the runner's input
# preparation, and the model forward with the logits.
INNER_PHASES = ("prepare_inputs", "forward")
_DTYPE_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


# ------------------------------------------------------------------ bandwidth and roofline
def measure_memory_bandwidth(num_bytes: int = 256 * 2**20, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` GB/s (1e9 bytes/s) of a torch copy (read + write counted) and of an fp32
    GEMV (the matrix read once), on torch's current thread count."""
    n = num_bytes // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best_copy = min(_timed(lambda: dst.copy_(src)) for _ in range(repeats))
    del src, dst
    cols = 4096
    weight = torch.ones(n // cols, cols, dtype=torch.float32)
    x = torch.ones(cols, dtype=torch.float32)
    torch.mv(weight, x)
    best_gemv = min(_timed(lambda: torch.mv(weight, x)) for _ in range(repeats))
    return {"copy_gbps": 2 * num_bytes / best_copy / 1e9, "gemv_gbps": num_bytes / best_gemv / 1e9,
            "buffer_mib": num_bytes / 2**20}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_fma_peak(seconds: float = 0.05, repeats: int = 8) -> dict[str, float | None]:
    """The cores' arithmetic peak in GFLOP/s, from a register-only FMA loop on torch's current
    thread count (`fma_peak_probe` in native/kernels/csrc/cpu_packed_gemm.cpp, best of `repeats`
    short runs of about `seconds`, so that one of them likely finds the cores free on a shared
    machine): float32 FMAs at the widest vector width the kernels were built
    for, and bf16 dot products (`vdpbf16ps`; None without AVX512_BF16). The fraction of it a
    GEMM reaches is what `measure_linear_gemm` reports. Empty without the native kernels."""
    from pagedllm.native.kernels import cpu_kernels

    lib = cpu_kernels()
    if lib is None:
        return {}
    result: dict[str, float | None] = {}
    for key, kind in (("fp32_fma_gflops", 0), ("bf16_dot_gflops", 1)):
        iterations = 1_000_000
        if lib.fma_peak_probe(iterations, kind) < 0:   # also starts the threads
            result[key] = None
            continue
        start = time.perf_counter()
        lib.fma_peak_probe(iterations, kind)
        iterations = max(iterations, int(iterations * seconds / (time.perf_counter() - start)))
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            flops = lib.fma_peak_probe(iterations, kind)
            best = max(best, flops / (time.perf_counter() - start) / 1e9)
        result[key] = best
    return result


def measure_linear_gemm(shapes: list[tuple[int, int]], rows: list[int], dtype: torch.dtype,
                        min_seconds: float = 0.05) -> list[dict[str, Any]]:
    """GFLOP/s of y = x W^T for each weight shape (N, K) and row count M on torch's current
    thread count: the dot-product kernel (`ops.cpu_linear`), the packed GEMM
    (`ops.packed_linear` on `ops.pack_linear_weight(W)`) and torch's GEMM (`F.linear`), timed
    interleaved (one call of each in turn, best of the rounds: fair on a shared machine).
    x and W are in `dtype` (float32 or bfloat16); flops = 2 M N K. Each row also gives the
    packed GEMM's fraction of the FMA peak for its math (bf16 dot products for bf16 weights
    where the kernels pack bf16 pairs, else float32 FMAs). Empty without the native kernels."""
    from pagedllm.native.kernels import cpu_kernels
    from pagedllm.native.kernels import ops

    lib = cpu_kernels()
    if lib is None:
        return []
    peak = measure_fma_peak()
    peak_key = ("bf16_dot_gflops" if dtype == torch.bfloat16 and lib.packed_gemm_bf16_pairs()
                else "fp32_fma_gflops")
    out = []
    for n, k in shapes:
        weight = torch.randn(n, k).to(dtype)
        packed = ops.pack_linear_weight(weight)
        for m in rows:
            x = torch.randn(m, k).to(dtype)
            fns = {"dot_kernel": lambda: ops.cpu_linear(x, weight),
                   "packed": lambda: ops.packed_linear(x, packed),
                   "torch": lambda: torch.nn.functional.linear(x, weight)}
            best = {name: min(_timed(fn) for _ in range(2)) for name, fn in fns.items()}
            rounds = max(3, min(50, int(min_seconds / max(sum(best.values()), 1e-6))))
            for _ in range(rounds):
                for name, fn in fns.items():
                    best[name] = min(best[name], _timed(fn))
            flops = 2 * m * n * k
            row: dict[str, Any] = {"n": n, "k": k, "m": m}
            row.update({f"{name}_gflops": flops / t / 1e9 for name, t in best.items()})
            row["packed_fraction_of_peak"] = row["packed_gflops"] / peak[peak_key]
            out.append(row)
    return out


def _safetensors_shapes(model_path: str) -> dict[str, tuple[str, list[int]]]:
    shapes: dict[str, tuple[str, list[int]]] = {}
    for path in sorted(Path(model_path).glob("*.safetensors")):
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = (info["dtype"], info["shape"])
    return shapes


def _gguf_weight_bytes(path: str) -> tuple[int, int]:
    """(parameters, bytes a decode step reads) of a .gguf file, its tensors in their own
    types: every tensor but an untied token embedding (a lookup reads one row)."""
    import gguf

    tensors = gguf.GGUFReader(path).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    total = sum(int(t.n_elements) for t in tensors)
    read = sum(int(t.n_bytes) for t in tensors if tied or t.name != "token_embd.weight")
    return total, read


def _safetensors_weight_bytes(model_path: str, config: dict, elem: int) -> tuple[int, int]:
    """(parameters, bytes a decode step reads at `elem` bytes per parameter) of a safetensors
    checkpoint: every tensor but an untied token embedding (a lookup reads one row)."""
    shapes = _safetensors_shapes(model_path)
    total = embed = 0
    for name, (_, shape) in shapes.items():
        numel = int(np.prod(shape)) if shape else 1
        total += numel
        if name.endswith("embed_tokens.weight"):
            embed += numel
    tied = bool(config.get("tie_word_embeddings")) or not any("lm_head" in n for n in shapes)
    return total, (total if tied else total - embed) * elem


def decode_bytes_per_token(model_path: str, dtype: torch.dtype) -> dict[str, Any]:
    """Bytes of weights one batch-1 decode step reads, in `dtype` (the run's, not the file's;
    a .gguf file's weights in their block types, as the engine keeps them), and the KV-cache
    bytes per context token."""
    from pagedllm.model_loader.gguf import is_gguf_path, prepare_gguf_view

    elem = torch.empty((), dtype=dtype).element_size()
    config_dir = prepare_gguf_view(model_path) if is_gguf_path(model_path) else model_path
    config = json.loads((Path(config_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    if is_gguf_path(model_path):
        total, read_bytes = _gguf_weight_bytes(model_path)
    else:
        total, read_bytes = _safetensors_weight_bytes(model_path, config, elem)
    num_heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // num_heads
    kv_per_token = (2 * config["num_hidden_layers"] * config.get("num_key_value_heads", num_heads)
                    * head_dim * elem)
    return {"num_params": total, "weight_bytes_per_step": read_bytes,
            "kv_bytes_per_context_token": kv_per_token, "dtype": str(dtype).removeprefix("torch.")}


def roofline(bytes_info: dict[str, Any], bandwidth_gbps: float, batch_size: int,
             mean_context_len: float, tpot_s: float) -> dict[str, float]:
    """Bandwidth-bound decode tokens/s for `batch_size` requests at `mean_context_len`, and where
    the measured TPOT stands against it."""
    step_bytes = (bytes_info["weight_bytes_per_step"]
                  + batch_size * mean_context_len * bytes_info["kv_bytes_per_context_token"])
    bound_step_s = step_bytes / (bandwidth_gbps * 1e9)
    return {"bytes_per_decode_step_mb": step_bytes / 1e6,
            "bandwidth_gbps_used_for_bound": bandwidth_gbps,
            "roofline_decode_tokens_per_s": batch_size / bound_step_s,
            "measured_decode_tokens_per_s": batch_size / tpot_s,
            "fraction_of_roofline": bound_step_s / tpot_s,
            "achieved_bandwidth_gbps": step_bytes / tpot_s / 1e9}


# ------------------------------------------------------------------ the stepping loop
@dataclass
class _Timeline:
    arrival: float
    token_times: list[float] = field(default_factory=list)
    num_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)


@dataclass
class StepTimes:
    """Seconds per phase for every engine step (a multi-step round is one, its `num_steps`
    recorded beside), split into pure-decode steps and the rest."""

    decode: dict[str, list[float]] = field(
        default_factory=lambda: {p: [] for p in STEP_PHASES + INNER_PHASES + ("num_steps",)})
    other: dict[str, list[float]] = field(
        default_factory=lambda: {p: [] for p in STEP_PHASES + INNER_PHASES + ("num_steps",)})


class EngineStepper:
    """Runs `LLMEngine` steps phase by phase, timing each phase.

    NOTE(bench): when the executor exposes its worker's model runner, `execute_model` and
    `sample_tokens` are called (and timed) apart, the later steps of a multi-step round
    (`run_remaining_steps`) counting in execute_model; otherwise `executor.execute_model` covers
    all and `sample_tokens` reads 0. Inside them, the runner's input preparation and the model
    forward (`_run_model`, the CUDA graph replay, `compute_logits` and the native decode loop)
    are timed by wrapping those bound methods on this engine's instances only; engine code is
    untouched. The worker's platform hooks run around each step as in `Worker.execute_model`
    (on the CPU the thread governor, platforms/cpu_contention.py). The native greedy verification of drafts (`runner.native_verify.run`) counts as
    forward too.
    """

    def __init__(self, llm_engine) -> None:
        self.engine = llm_engine
        self.core = llm_engine.engine_core
        worker = getattr(self.core.executor, "worker", None)
        runner = getattr(worker, "model_runner", None)
        self.runner = runner if (hasattr(runner, "execute_model")
                                 and hasattr(runner, "sample_tokens")) else None
        # The worker's per-step platform hooks (the CPU thread governor, which fits the thread
        # count to a shared machine's free cores), called around the runner's phases as
        # `Worker.execute_model` calls them.
        self._platform = getattr(worker, "platform", None) if self.runner is not None else None
        self._inner_s = dict.fromkeys(INNER_PHASES, 0.0)
        if self.runner is not None and hasattr(self.runner, "_prepare_inputs"):
            self._time_method(self.runner, "_prepare_inputs", "prepare_inputs")
            self._time_method(self.runner, "_run_model", "forward")
            self._time_method(self.runner.model, "compute_logits", "forward")
            if getattr(self.runner, "graph_runner", None) is not None:
                self._time_method(self.runner.graph_runner, "run", "forward")
            if getattr(self.runner, "native_verify", None) is not None:
                # Greedy verification steps of n-gram / suffix drafts (worker/native_verify.py).
                self._time_method(self.runner.native_verify, "run", "forward")

    def _time_decode_loop(self) -> None:
        """Time the runner's native decode loop (multi-step rounds' later steps: forwards with
        their argmax, native/decode_loop.py) as forward, once the runner has made it."""
        rounds = getattr(self.runner, "multi_step", None)
        loop = getattr(rounds, "native_loop", None)
        if loop and not getattr(loop, "_bench_timed", False):
            self._time_method(loop, "run", "forward")
            loop._bench_timed = True

    def _time_method(self, obj, name: str, phase: str) -> None:
        method = getattr(obj, name)

        def timed(*args, **kwargs):
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self._inner_s[phase] += time.perf_counter() - t

        setattr(obj, name, timed)

    def step(self, times: StepTimes | None = None, profile_labels: bool = False):
        label = torch.profiler.record_function if profile_labels else _null_label
        core, engine = self.core, self.engine
        self._inner_s = dict.fromkeys(INNER_PHASES, 0.0)
        t0 = time.perf_counter()
        with label("bench.schedule"):
            so = core.scheduler.schedule()
            grammar_output = core.scheduler.get_grammar_output(so)
        t1 = time.perf_counter()
        if self.runner is not None:
            if self._platform is not None:
                self._platform.before_step()
            with label("bench.execute_model"):
                self.runner.execute_model(so)
            t2 = time.perf_counter()
            with label("bench.sample_tokens"):
                runner_output = self.runner.sample_tokens(grammar_output)
            t3 = time.perf_counter()
            if so.num_steps > 1:
                self._time_decode_loop()
                with label("bench.run_remaining_steps"):
                    runner_output = self.runner.run_remaining_steps(so.num_steps, runner_output)
                # The later steps are forwards and sampling: execute_model's share.
                t2 += time.perf_counter() - t3
                t3 = time.perf_counter()
            if self._platform is not None:
                self._platform.after_step()
        else:
            runner_output = core.executor.execute_model(so, grammar_output)
            t2 = t3 = time.perf_counter()
        with label("bench.update_from_output"):
            core_outputs = core.scheduler.update_from_output(so, runner_output)
        t4 = time.perf_counter()
        with label("bench.process_outputs"):
            request_outputs, to_abort = engine.output_processor.process_outputs(core_outputs)
            if to_abort:
                core.abort_requests(to_abort)
        t5 = time.perf_counter()
        if times is not None:
            is_decode = so.total_num_scheduled_tokens == len(so.num_scheduled_tokens)
            bucket = times.decode if is_decode else times.other
            for phase, dt in zip(STEP_PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                bucket[phase].append(dt)
            for phase, dt in self._inner_s.items():
                bucket[phase].append(dt)
            bucket["num_steps"].append(so.num_steps)
        return request_outputs, t5


def _null_label(_name: str):
    return contextlib.nullcontext()


def run_wave(stepper: EngineStepper, requests: list[BenchRequest], id_prefix: str,
             times: StepTimes | None, profile_labels: bool = False) -> list[_Timeline]:
    """Add `requests` at once and step until they finish; per-request token arrival times."""
    timelines: dict[str, _Timeline] = {}
    for i, r in enumerate(requests):
        req_id = f"{id_prefix}-{i}"
        timelines[req_id] = _Timeline(arrival=time.perf_counter())
        stepper.engine.add_request(req_id, {"prompt_token_ids": r.prompt_token_ids},
                                   sampling_params_for(r))
    while stepper.engine.has_unfinished_requests():
        outputs, now = stepper.step(times, profile_labels)
        for out in outputs:
            tl = timelines.get(out.request_id)
            if tl is None:
                continue
            ids = out.outputs[0].token_ids
            n = len(ids)
            tl.token_times.extend([now] * (n - tl.num_tokens))
            tl.num_tokens = n
            tl.token_ids = list(ids)
    return list(timelines.values())


def latency_figures(timelines: list[_Timeline], wave_latencies: list[float]) -> dict[str, Any]:
    ttft = [t.token_times[0] - t.arrival for t in timelines if t.token_times]
    tpot = [(t.token_times[-1] - t.token_times[0]) / (len(t.token_times) - 1)
            for t in timelines if len(t.token_times) > 1]
    itl = [b - a for t in timelines for a, b in zip(t.token_times, t.token_times[1:])]
    e2e = [t.token_times[-1] - t.arrival for t in timelines if t.token_times]
    return {**percentiles(ttft, "ttft_ms", 1e3), **percentiles(tpot, "tpot_ms", 1e3),
            **percentiles(itl, "itl_ms", 1e3), **percentiles(e2e, "e2e_latency_ms", 1e3),
            **percentiles(wave_latencies, "batch_latency_ms", 1e3)}


def step_breakdown(times: StepTimes) -> dict[str, Any]:
    """Mean ms per phase for decode steps and other (prefill / mixed) steps; the share of a step
    spent outside `execute_model` (scheduler, sampling, output bookkeeping), and the share spent
    outside the model forward and logits (the same plus the runner's input preparation and
    sampling; where the forward was not timed, execute_model less the input preparation counts
    as the forward). The means are per model step: a multi-step round's times are spread over
    its steps (`{kind}_rounds` counts the engine steps, `{kind}_steps` the model steps)."""
    out: dict[str, Any] = {}
    for kind, bucket in (("decode", times.decode), ("prefill_or_mixed", times.other)):
        num_rounds = len(bucket["schedule"])
        if num_rounds == 0:
            continue
        num_steps = int(sum(bucket["num_steps"]))
        means = {p: float(np.sum(bucket[p])) / num_steps * 1e3
                 for p in STEP_PHASES + INNER_PHASES}
        total = sum(means[p] for p in STEP_PHASES)
        out[f"{kind}_steps"] = num_steps
        out[f"{kind}_rounds"] = num_rounds
        out[f"{kind}_step_ms"] = {**{f"{p}_ms": v for p, v in means.items()}, "total_ms": total}
        out[f"{kind}_share_outside_execute_model"] = (total - means["execute_model"]) / total
        forward = means["forward"] or means["execute_model"] - means["prepare_inputs"]
        out[f"{kind}_share_outside_forward"] = (total - forward) / total
    return out


def run_latency(llm, requests: list[BenchRequest], batch_size: int, num_iters_warmup: int = 1,
                profile: bool = False, profile_steps: int = 8) -> dict[str, Any]:
    """Run `requests` in waves of `batch_size` (the first `num_iters_warmup` waves untimed).

    Returns latency percentiles (TPOT and e2e over the tokens each request generated, which
    end at EOS for requests that do not ignore it), the timed requests' output lengths
    (`output_lens`) and greedy token ids (`output_token_ids`, one list per request, for comparing
    runs), the decode step breakdown and, with `profile`, the top ops of a torch.profiler trace
    of `profile_steps` decode steps (on one extra wave).
    """
    stepper = EngineStepper(llm.llm_engine)
    run_wave(stepper, [BenchRequest(warmup_prompt(requests), 4)], "warmup", None)
    waves = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    times = StepTimes()
    timelines: list[_Timeline] = []
    wave_latencies: list[float] = []
    for w, wave in enumerate(waves):
        start = time.perf_counter()
        tls = run_wave(stepper, wave, f"wave{w}", times if w >= num_iters_warmup else None)
        if w >= num_iters_warmup:
            wave_latencies.append(time.perf_counter() - start)
            timelines.extend(tls)
    result = _latency_result(batch_size, timelines, wave_latencies, times)
    if profile:
        result["profile_top_ops"] = profile_decode_steps(stepper, waves[-1], profile_steps)
    return result


def _latency_result(batch_size: int, timelines: list[_Timeline], wave_latencies: list[float],
                    times: StepTimes) -> dict[str, Any]:
    return {"backend": "pagedllm", "batch_size": batch_size,
            "num_timed_requests": len(timelines),
            "num_output_tokens": sum(t.num_tokens for t in timelines),
            "output_lens": [t.num_tokens for t in timelines],
            "output_token_ids": [t.token_ids for t in timelines],
            **latency_figures(timelines, wave_latencies),
            "step_breakdown": step_breakdown(times),
            "load_avg_1m_after": load_average()}


def _wave_tpot_ms(timelines: list[_Timeline]) -> float:
    """Mean over a wave's requests of each request's TPOT in ms (NaN when no request of the wave
    generated two tokens)."""
    return latency_figures(timelines, [])["tpot_ms_mean"]


def run_latency_alternating(spec_llm, plain_llm, requests: list[BenchRequest], batch_size: int,
                            num_iters_warmup: int = 1) -> tuple[dict, dict, dict]:
    """The same waves through two engines built side by side, alternating wave by wave.

    Each wave of `batch_size` requests runs through the speculating engine (`spec_llm`) and then
    through the plain one (`plain_llm`), or the other way round on odd waves (A-B, B-A, ...: the
    pair order cancels any drift within a pair); the first `num_iters_warmup` waves are untimed.
    Each timed wave gives a pair of TPOTs measured seconds apart, so a load change on a shared
    machine moves both and their ratio far less than it moves two runs made one after the
    other (which `run_latency` twice does).

    Returns (spec result, plain result, alternation): the two results as `run_latency` gives
    them (no profile), and `alternation` = {"pairs": one dict per timed wave with `wave`,
    `first` ("spec" | "plain"), `spec_tpot_ms`, `plain_tpot_ms` (the mean over the wave's
    requests of each request's TPOT), `tpot_ratio` (plain / spec, > 1 = speculation is faster;
    None where a TPOT is NaN: no request of the wave generated two tokens), `spec_e2e_ms`,
    `plain_e2e_ms`, `e2e_ratio`}, and over the pairs' ratios `tpot_ratio_median`,
    `tpot_ratio_min`, `tpot_ratio_max`, `tpot_ratio_iqr` (p75 - p25), `e2e_ratio_median`,
    `num_pairs`. Raises ValueError when `batch_size` < 1 or no wave is timed.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    waves = [requests[i:i + batch_size] for i in range(0, len(requests), batch_size)]
    if len(waves) <= num_iters_warmup:
        raise ValueError(f"{len(waves)} waves leave none timed after {num_iters_warmup} "
                         "warm-up waves")
    steppers = {"spec": EngineStepper(spec_llm.llm_engine),
                "plain": EngineStepper(plain_llm.llm_engine)}
    for stepper in steppers.values():
        run_wave(stepper, [BenchRequest(warmup_prompt(requests), 4)], "warmup", None)
    times = {name: StepTimes() for name in steppers}
    timelines: dict[str, list[_Timeline]] = {name: [] for name in steppers}
    wave_latencies: dict[str, list[float]] = {name: [] for name in steppers}
    pairs: list[dict[str, Any]] = []
    for w, wave in enumerate(waves):
        timed = w >= num_iters_warmup
        order = ("spec", "plain") if w % 2 == 0 else ("plain", "spec")
        pair: dict[str, Any] = {"wave": w, "first": order[0]}
        for name in order:
            start = time.perf_counter()
            tls = run_wave(steppers[name], wave, f"wave{w}", times[name] if timed else None)
            elapsed = time.perf_counter() - start
            if timed:
                wave_latencies[name].append(elapsed)
                timelines[name].extend(tls)
                pair[f"{name}_tpot_ms"] = _wave_tpot_ms(tls)
                pair[f"{name}_e2e_ms"] = float(np.mean(
                    [t.token_times[-1] - t.arrival for t in tls if t.token_times])) * 1e3
        if timed:
            pair["tpot_ratio"] = _ratio(pair["plain_tpot_ms"], pair["spec_tpot_ms"])
            pair["e2e_ratio"] = _ratio(pair["plain_e2e_ms"], pair["spec_e2e_ms"])
            pairs.append(pair)
    results = {name: _latency_result(batch_size, timelines[name], wave_latencies[name],
                                     times[name]) for name in steppers}
    return results["spec"], results["plain"], alternation_summary(pairs)


def _ratio(num: float, den: float) -> float | None:
    if math.isnan(num) or math.isnan(den) or den == 0:
        return None
    return num / den


def alternation_summary(pairs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median, min, max and interquartile range of the pairs' `tpot_ratio` (pairs whose ratio
    is None left out; all NaN when none is left) and the median of their `e2e_ratio`."""
    tpot = [p["tpot_ratio"] for p in pairs if p.get("tpot_ratio") is not None]
    e2e = [p["e2e_ratio"] for p in pairs if p.get("e2e_ratio") is not None]
    nan = float("nan")
    out: dict[str, Any] = {"pairs": pairs, "num_pairs": len(tpot)}
    if tpot:
        q25, q50, q75 = np.percentile(tpot, [25, 50, 75])
        out.update(tpot_ratio_median=float(q50), tpot_ratio_min=float(min(tpot)),
                   tpot_ratio_max=float(max(tpot)), tpot_ratio_iqr=float(q75 - q25))
    else:
        out.update(tpot_ratio_median=nan, tpot_ratio_min=nan, tpot_ratio_max=nan,
                   tpot_ratio_iqr=nan)
    out["e2e_ratio_median"] = float(np.median(e2e)) if e2e else nan
    return out


def profile_decode_steps(stepper: EngineStepper, wave: list[BenchRequest],
                         num_steps: int) -> list[dict[str, Any]]:
    """torch.profiler over `num_steps` decode steps of `wave`; the top 20 ops by self CPU time
    (the table is also printed)."""
    from torch.profiler import ProfilerActivity, profile

    engine = stepper.engine
    for i, r in enumerate(wave):
        engine.add_request(f"profile-{i}", {"prompt_token_ids": r.prompt_token_ids},
                           sampling_params_for(r))
    stepper.step()  # the prefill
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            if not engine.has_unfinished_requests():
                break
            stepper.step(profile_labels=True)
    while engine.has_unfinished_requests():
        stepper.step()
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=25))
    rows = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:20]
    total = sum(e.self_cpu_time_total for e in averages) or 1
    return [{"op": e.key, "calls": e.count, "self_cpu_ms_per_step":
             e.self_cpu_time_total / 1e3 / num_steps,
             "self_cpu_share": e.self_cpu_time_total / total} for e in rows]
