"""`pagedllm bench soak`: a robustness soak of the OpenAI server (issue #16).

Sends the seeded mix of `soak_cases.make_cases` (valid, invalid and disconnected requests) at a
fixed concurrency to a loopback server, its own (`ManagedServer`: `pagedllm serve` with a KV cache
small enough to force preemption) or `--url`'s, and passes only if every check holds:

  no_5xx                 no answer at all is a 5xx
  invalid_rejected       an invalid request gets a status its case allows (see soak_cases.py)
  invalid_stream_status  a streamed invalid one is never a 200 followed by an error event
  error_object           a 4xx body is {"error": {"message", "type", "param", "code"}}
  error_param            error.param names the broken top-level field (see soak_cases.py)
  valid_completed        a valid request not disconnected gets 200 and n choices per prompt,
                         each with a finish_reason (streamed: a finish_reason chunk per choice,
                         the usage chunk if asked, then `data: [DONE]`), within the timeout
  stream_error_event     no valid stream (disconnected ones included) carries an error event
  server_alive           the process lives, GET /health is 200 throughout and at the end
  idle_metrics           once idle, the running / waiting / KV-usage gauges of /metrics are 0
  rss_drift              the server's RSS at the end at most --rss-drift-limit above its RSS
                         after the warm-up (the first 10% of requests, valid only); a server the
                         soak started only (--url: skipped with a note); shrinking is fine.
                         RSS is summed over the server's process tree (engine-core and API-server
                         processes included; soak_server.py), and reported per process too
  time_limit             all requests are sent and answered within --max-duration-s

Bounded: each request has a timeout, the run a time limit (the end checks take at most
--idle-timeout-s more); a watchdog stops the run early when the server dies, stops answering
/health, or (a server the soak started) outgrows --server-rss-limit-mib, which gets it killed.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagedllm.benchmarks.soak_cases import (CHAT, DISCONNECT, INVALID, VALID, SoakCase,
                                            make_cases, num_warmup)
from pagedllm.benchmarks.soak_client import Outcome, send_case
from pagedllm.benchmarks.soak_server import (IDLE_GAUGES, PREEMPTIONS, ManagedServer,
                                             ProcessRss, loopback_url, parse_metrics)

CHECKS = ("no_5xx", "invalid_rejected", "invalid_stream_status", "error_object", "error_param",
          "valid_completed", "stream_error_event", "server_alive", "idle_metrics", "rss_drift",
          "time_limit")
_MIB = 2**20
_MAX_FAILURES_KEPT = 500
# A rise: RSS samples (every 0.2 s) growing by over _RSS_STEP, with pauses of fewer than
# _RISE_PAUSE samples and no fall; reported from _RSS_JUMP.
_RSS_STEP, _RSS_JUMP, _RISE_PAUSE = 4 * _MIB, 32 * _MIB, 5


@dataclass(frozen=True)
class SoakConfig:
    """Size and limits of one soak (the flags of `pagedllm bench soak`)."""

    num_requests: int = 2000
    concurrency: int = 64
    seed: int = 0
    request_timeout_s: float = 120.0
    max_duration_s: float = 1800.0
    idle_timeout_s: float = 60.0
    rss_drift_limit: float = 0.10
    server_rss_limit_bytes: int = 4096 * _MIB
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("num_requests", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("request_timeout_s", "max_duration_s", "idle_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")


@dataclass
class _Rise:
    """RSS growth over consecutive samples (see _RSS_STEP)."""

    bytes: int
    in_flight: str  # the cases in flight when it began


@dataclass
class _State:
    """What the run has seen so far (shared by the phases, the watchdogs and the report)."""

    outcomes: list[Outcome]
    in_flight: dict[int, SoakCase]
    peak_rss: int = 0
    rss_rises: list[_Rise] = field(default_factory=list)
    health_max_s: float = 0.0  # slowest GET /health of the watchdog (event-loop stalls)
    stopped: tuple[str, str] | None = None  # (check, reason) that cut the run short

    def in_flight_labels(self, limit: int = 4) -> str:
        """The cases in flight, the unusual ones (invalid, disconnects) first."""
        rank = {INVALID: 0, DISCONNECT: 1, VALID: 2}
        cases = sorted(self.in_flight.values(), key=lambda c: (rank[c.kind], c.index))
        return ", ".join(f"#{c.index} {c.kind} {c.label}" for c in cases[:limit]) or "nothing"


# ------------------------------------------------------------------ phases and watchdogs
async def _run_cases(cases: list[SoakCase], send: Callable[[SoakCase], Awaitable[Outcome]],
                     concurrency: int, state: _State) -> None:
    pending = iter(cases)

    async def worker() -> None:
        for case in pending:
            state.in_flight[case.index] = case
            try:
                state.outcomes.append(await send(case))
            finally:
                state.in_flight.pop(case.index, None)

    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(cases)))))


async def _watch_process(server: ManagedServer, limit_bytes: int, state: _State) -> tuple[str, str]:
    previous, still = None, _RISE_PAUSE  # samples since RSS last grew by over _RSS_STEP
    while True:
        code = server.exit_code()
        if code is not None:
            return "server_alive", f"the server process exited with code {code}"
        rss = server.rss_bytes() or 0
        state.peak_rss = max(state.peak_rss, rss)
        if previous is not None and rss - previous > _RSS_STEP:
            if still < _RISE_PAUSE:
                state.rss_rises[-1].bytes += rss - previous
            else:
                state.rss_rises.append(_Rise(rss - previous, state.in_flight_labels()))
            still = 0
        elif previous is not None and rss < previous - _RSS_STEP:
            still = _RISE_PAUSE
        else:
            still += 1
        previous = rss
        if rss > limit_bytes:
            server.kill()
            return "server_alive", (f"the server's RSS reached {rss / _MIB:.0f} MiB (limit "
                                    f"{limit_bytes / _MIB:.0f} MiB); the soak killed it")
        await asyncio.sleep(0.2)


async def _health_problem(control: httpx.AsyncClient) -> str | None:
    try:
        resp = await control.get("/health", timeout=10)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"
    return None if resp.status_code == 200 else f"HTTP {resp.status_code}: {resp.text[:300]}"


async def _watch_health(control: httpx.AsyncClient, state: _State) -> tuple[str, str]:
    failures = 0
    while True:
        await asyncio.sleep(2.0)
        start = time.perf_counter()
        problem = await _health_problem(control)
        state.health_max_s = max(state.health_max_s, time.perf_counter() - start)
        failures = failures + 1 if problem else 0
        if problem and (problem.startswith("HTTP 5") or failures >= 3):
            times = f" {failures} times in a row (10 s timeout)" if failures > 1 else ""
            return "server_alive", f"GET /health failed{times}: {problem}"


async def _report_progress(state: _State, total: int, start: float,
                           interval_s: float = 15.0) -> tuple[str, str]:
    """Print a progress line every `interval_s` (never returns: a watcher that never fires)."""
    while True:
        await asyncio.sleep(interval_s)
        failed = sum(bool(o.failures) for o in state.outcomes)
        print(f"  [{time.monotonic() - start:5.0f} s] {len(state.outcomes)}/{total} answered, "
              f"{len(state.in_flight)} in flight, {failed} with failures", flush=True)


async def _guarded(work: Awaitable[None], watchers: list[Awaitable[tuple[str, str]]],
                   deadline: float, state: _State) -> bool:
    """Run `work` until it ends, a watcher fires or the deadline passes; False if cut short."""
    main = asyncio.ensure_future(work)
    tasks = [asyncio.ensure_future(w) for w in watchers]
    try:
        done, _ = await asyncio.wait({main, *tasks}, timeout=max(0.0, deadline - time.monotonic()),
                                     return_when=asyncio.FIRST_COMPLETED)
        if main in done:
            main.result()
            return True
        fired = [t for t in tasks if t in done]
        state.stopped = fired[0].result() if fired else (
            "time_limit", "--max-duration-s reached before every request was answered")
        if state.in_flight:
            state.stopped = (state.stopped[0], f"{state.stopped[1]}; in flight then "
                             f"({len(state.in_flight)}): {state.in_flight_labels(limit=12)}")
        return False
    finally:
        for task in (main, *tasks):
            task.cancel()
        await asyncio.gather(main, *tasks, return_exceptions=True)


async def _wait_idle(control: httpx.AsyncClient, timeout_s: float) -> tuple[dict[str, float], bool]:
    """Poll /metrics until the IDLE_GAUGES are all 0: (last readings, whether they got there)."""
    deadline = time.monotonic() + timeout_s
    values: dict[str, float] = {}
    while True:
        try:
            values = parse_metrics((await control.get("/metrics")).text)
        except httpx.HTTPError:
            values = {}
        if all(values.get(g) == 0 for g in IDLE_GAUGES):
            return values, True
        if time.monotonic() > deadline:
            return values, False
        await asyncio.sleep(0.5)


# ------------------------------------------------------------------ the run
async def _served_model(control: httpx.AsyncClient, model: str | None) -> tuple[str, str | None]:
    resp = await control.get("/v1/models")
    resp.raise_for_status()
    cards = resp.json()["data"]
    card = next((c for c in cards if c["id"] == model), cards[0])
    return model or card["id"], card.get("root")


async def _chat_works(control: httpx.AsyncClient, model: str) -> bool:
    """False only when the server says the model cannot chat (no chat template)."""
    resp = await control.post(CHAT, json={"model": model, "max_tokens": 1, "messages": [
        {"role": "user", "content": "Hail"}]}, timeout=60)
    return not (resp.status_code == 400 and "chat template" in resp.text)


def _vocab_size(root: str | None) -> int:
    from pagedllm.hf_config import hf_model_info

    if root is None:
        raise ValueError("the server does not say its checkpoint (`root` in /v1/models); "
                         "pass --vocab-size")
    try:
        return hf_model_info(root).vocab_size
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot read the vocabulary size of {root!r} ({e}); pass "
                         "--vocab-size") from e


async def run_soak(url: str, config: SoakConfig, deadline: float, server: ManagedServer | None,
                   api_key: str | None = None, model: str | None = None,
                   vocab_size: int | None = None) -> dict[str, Any]:
    """Soak the server at `url` (loopback); returns the figures and the failures.

    Args:
        deadline: `time.monotonic()` by which every request must be answered.
        server: the process behind `url` when the soak started it (RSS and liveness checks).
        model: name sent in requests (default: the server's first model).
        vocab_size: default: from the checkpoint named by /v1/models.
    """
    host, port = loopback_url(url)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency,
                          max_keepalive_connections=config.concurrency)
    start = time.monotonic()
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits,
                                 timeout=config.request_timeout_s) as client, \
            httpx.AsyncClient(base_url=url, headers=headers, timeout=10) as control:
        model, root = await _served_model(control, model)
        chat = await _chat_works(control, model)
        cases = make_cases(config.num_requests, config.seed, vocab_size or _vocab_size(root),
                           model, chat=chat, skip=config.skip)
        warmup = num_warmup(len(cases))
        state = _State([], {})

        def send(case: SoakCase) -> Awaitable[Outcome]:
            return send_case(client, host, port, api_key, case, config.request_timeout_s)

        def watchers() -> list[Awaitable[tuple[str, str]]]:
            found = [_watch_health(control, state), _report_progress(state, len(cases), start)]
            if server is not None:
                found.append(_watch_process(server, config.server_rss_limit_bytes, state))
            return found

        rss_warm: list[ProcessRss] = []
        if await _guarded(_run_cases(cases[:warmup], send, config.concurrency, state),
                          watchers(), deadline, state):
            await _wait_idle(control, min(config.idle_timeout_s,
                                          max(1.0, deadline - time.monotonic())))
            rss_warm = server.rss_by_process() if server is not None else []
            await _guarded(_run_cases(cases[warmup:], send, config.concurrency, state),
                           watchers(), deadline, state)
        elapsed = time.monotonic() - start
        # A dead server will not get idle: one reading then, not a wait.
        dead = (state.stopped is not None and state.stopped[0] == "server_alive") \
            or await _health_problem(control) is not None
        idle_s = 0.0 if dead else max(5.0, min(config.idle_timeout_s,
                                               deadline - time.monotonic()))
        metrics, idle = await _wait_idle(control, idle_s)
        health = await _health_problem(control)
    end = {"metrics": metrics, "idle": idle, "idle_wait_s": idle_s, "health": health,
           "exit_code": server.exit_code() if server is not None else None,
           "rss_warm": rss_warm,
           "rss_end": server.rss_by_process() if server is not None else []}
    return soak_figures(cases, state, end, config, elapsed, model, chat)


# ------------------------------------------------------------------ figures
def _failure_rows(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    return [{"check": check, "index": o.case.index, "kind": o.case.kind, "label": o.case.label,
             "request": o.case.summary(), "detail": detail}
            for o in sorted(outcomes, key=lambda o: o.case.index) for check, detail in o.failures]


def _end_failures(end: dict[str, Any], config: SoakConfig, state: _State) -> list[dict[str, Any]]:
    rows = []

    def fail(check: str, detail: str) -> None:
        rows.append({"check": check, "index": None, "kind": "server", "label": check,
                     "request": "", "detail": detail})

    if state.stopped is not None:
        fail(*state.stopped)
    if end["exit_code"] is not None:
        fail("server_alive", f"the server process is gone (exit code {end['exit_code']})")
    if end["health"] is not None:
        fail("server_alive", f"GET /health at the end: {end['health']}")
    # A dead server (or engine) neither idles nor keeps its RSS: those checks would only echo it.
    dead = (state.stopped is not None and state.stopped[0] == "server_alive") \
        or end["exit_code"] is not None or end["health"] is not None
    if not end["idle"] and not dead:
        readings = {g: end["metrics"].get(g) for g in IDLE_GAUGES}
        fail("idle_metrics", f"not idle {end['idle_wait_s']:.0f} s after the last request "
                             f"answered: {readings}")
    warm, last = _total(end["rss_warm"]), _total(end["rss_end"])
    if warm and last and not dead and (last - warm) / warm > config.rss_drift_limit:
        grown = sorted(rss_per_process(end["rss_warm"], end["rss_end"]),
                       key=lambda p: -((p["end_mib"] or 0) - (p["after_warmup_mib"] or 0)))
        fail("rss_drift", f"RSS {warm / _MIB:.0f} MiB after the warm-up, {last / _MIB:.0f} MiB "
                          f"at the end (+{100 * (last - warm) / warm:.1f}%, limit "
                          f"{100 * config.rss_drift_limit:.0f}%; summed over "
                          f"{len(end['rss_end'])} processes, most grown: "
                          + ", ".join(_process_line(p) for p in grown[:3])
                          + "); largest rises: "
                          + ("; ".join(_rss_rises(state)) or f"none over {_RSS_JUMP // _MIB} "
                                                              "MiB"))
    return rows


def _total(tree: list[ProcessRss]) -> int | None:
    return sum(p.rss_bytes for p in tree) if tree else None


def rss_per_process(warm: list[ProcessRss], end: list[ProcessRss]) -> list[dict[str, Any]]:
    """Per process of the server's tree (after the warm-up, then at the end; by pid, in the
    tree's order): {"pid", "name", "after_warmup_mib", "end_mib"}, None where the process was
    not there (started or ended in between)."""
    at_warm = {p.pid: p for p in warm}
    at_end = {p.pid: p for p in end}
    rows = []
    for pid in dict.fromkeys([p.pid for p in warm] + [p.pid for p in end]):
        first, last = at_warm.get(pid), at_end.get(pid)
        rows.append({"pid": pid, "name": (last or first).name,
                     "after_warmup_mib": first.rss_bytes / _MIB if first else None,
                     "end_mib": last.rss_bytes / _MIB if last else None})
    return rows


def _process_line(row: dict[str, Any]) -> str:
    mib = [f"{v:.0f}" if v is not None else "-" for v in (row["after_warmup_mib"],
                                                           row["end_mib"])]
    return f"pid {row['pid']} {row['name']} {mib[0]} -> {mib[1]} MiB"


def _rss_rises(state: _State, limit: int = 3) -> list[str]:
    return [f"+{rise.bytes / _MIB:.0f} MiB while in flight: {rise.in_flight}"
            for rise in sorted(state.rss_rises, key=lambda r: -r.bytes)[:limit]
            if rise.bytes > _RSS_JUMP]


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def soak_figures(cases: list[SoakCase], state: _State, end: dict[str, Any], config: SoakConfig,
                 elapsed_s: float, model: str, chat: bool) -> dict[str, Any]:
    """The result dict: counts, latencies, end state, the failures and `passed`."""
    outcomes = state.outcomes
    by_kind = {kind: [o for o in outcomes if o.case.kind == kind]
               for kind in (VALID, INVALID, DISCONNECT)}
    valid_ok = [o for o in by_kind[VALID] if not o.failures]
    statuses: dict[str, Counter] = defaultdict(Counter)
    for o in by_kind[INVALID]:
        statuses[o.case.label][o.status] += 1
    rows = _failure_rows(outcomes) + _end_failures(end, config, state)
    counts = Counter(row["check"] for row in rows)
    warm, last = _total(end["rss_warm"]), _total(end["rss_end"])
    rss = ({"after_warmup_mib": warm / _MIB, "end_mib": last / _MIB,
            "drift_pct": 100 * (last - warm) / warm, "peak_mib": state.peak_rss / _MIB,
            "largest_rises": _rss_rises(state),
            "processes": rss_per_process(end["rss_warm"], end["rss_end"])}
           if warm and last else {"note": "not measured (--url server, or the run was cut "
                                          "short)"})
    metrics = end["metrics"]
    return {
        "passed": not rows, "failed_checks": {c: counts[c] for c in CHECKS if counts[c]},
        "model": model, "chat_endpoint": chat, "num_requests": len(cases),
        "concurrency": config.concurrency, "seed": config.seed,
        "requests_sent": len(outcomes), "requests_not_sent": len(cases) - len(outcomes),
        "valid_sent": len(by_kind[VALID]), "valid_completed": len(valid_ok),
        "latency_ms_p50": 1e3 * _percentile([o.latency_s for o in valid_ok], 50),
        "latency_ms_p99": 1e3 * _percentile([o.latency_s for o in valid_ok], 99),
        "invalid_sent": len(by_kind[INVALID]),
        "invalid_4xx_by_field": dict(Counter(o.case.category for o in by_kind[INVALID]
                                             if o.status and 400 <= o.status < 500)
                                     .most_common()),
        "invalid_status_by_case": {label: ", ".join(f"{s} x{n}" for s, n in c.most_common())
                                   for label, c in sorted(statuses.items())},
        "disconnects_sent": len(by_kind[DISCONNECT]),
        "disconnects_by_kind": dict(Counter(o.disconnect or o.case.label
                                            for o in by_kind[DISCONNECT]).most_common()),
        "end_state": {"idle": end["idle"],
                      **{g.removeprefix("pagedllm:"): metrics.get(g) for g in IDLE_GAUGES},
                      "num_preemptions": metrics.get(PREEMPTIONS)},
        "server_rss": rss, "health_max_latency_s": state.health_max_s, "wall_s": elapsed_s,
        "failures": rows[:_MAX_FAILURES_KEPT], "num_failures": len(rows),
    }


def print_soak_report(result: dict[str, Any]) -> None:
    """The figures, then each failing (check, case label) with its count and first example."""
    from pagedllm.benchmarks.report import print_result

    print_result({k: v for k, v in result.items() if k not in ("failures", "failed_checks")},
                 "server soak")
    processes = result["server_rss"].get("processes") or []
    if processes:
        print(f"server RSS by process (after the warm-up -> at the end), {len(processes)} "
              f"processes:")
        for row in processes:
            print(f"  {_process_line(row)}")
    if result["passed"]:
        print("PASSED: every check held")
        return
    print("FAILED checks: " + ", ".join(f"{c} ({n})" for c, n in result["failed_checks"].items()))
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for row in result["failures"]:
        groups[(row["check"], row["label"])].append(row)
    for (check, label), rows in sorted(groups.items(), key=lambda kv: CHECKS.index(kv[0][0])):
        first = rows[0]
        where = f"#{first['index']} {first['request']}\n      -> " if first["request"] else ""
        print(f"  [{check}] {label} x{len(rows)}: {where}{first['detail']}")


# ------------------------------------------------------------------ command
def _serve_args(args: argparse.Namespace) -> list[str]:
    out = ["--dtype", args.dtype, "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
           "--uvicorn-log-level", "warning"]
    if args.model:
        out += ["--model", args.model]
    if args.max_num_seqs:
        out += ["--max-num-seqs", str(args.max_num_seqs)]
    return out + list(args.serve_arg or ())


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run_soak_command(args: argparse.Namespace) -> int:
    """`pagedllm bench soak`: 0 if every check held, 1 otherwise (the failures printed)."""
    from pagedllm.benchmarks.report import save_json

    config = SoakConfig(args.num_requests, args.concurrency, args.seed, args.request_timeout_s,
                        args.max_duration_s, args.idle_timeout_s, args.rss_drift_limit,
                        args.server_rss_limit_mib * _MIB, tuple(args.skip or ()))
    started = time.monotonic()
    deadline = started + config.max_duration_s
    server, stop_note = None, None
    previous = signal.signal(signal.SIGTERM, _interrupt) \
        if threading.current_thread() is threading.main_thread() else None
    try:
        if args.url:
            url, name = args.url.rstrip("/"), args.model
            loopback_url(url)
            print(f"soaking {url} (RSS not measured: the soak did not start this server)")
        else:
            server, name = ManagedServer(_serve_args(args), args.api_key), None
            print(f"starting: {' '.join(server.cmd)}")
            server.start(timeout_s=max(1.0, min(300.0, deadline - time.monotonic())))
            url, kv = server.url, server.kv_capacity()
            print(f"server up at {url}, log {server.log_path}; KV cache: " + (
                f"{kv['blocks']} blocks x {kv['block_size']} = {kv['tokens']} tokens"
                if kv else "capacity not in the log"))
        result = asyncio.run(run_soak(url, config, deadline, server, args.api_key, name,
                                      args.vocab_size))
        if server is not None:
            result["kv_capacity"] = server.kv_capacity()
    except (RuntimeError, httpx.HTTPError) as e:
        print(f"error: {type(e).__name__}: {e}")
        return 1
    except KeyboardInterrupt:
        print("interrupted: the soak stopped (and stopped its server)")
        return 130
    finally:
        if server is not None:
            code = server.stop()
            stop_note = None if code is None else f"killed by signal {-code}" if code < 0 \
                else f"exit code {code} after SIGTERM"
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    result["server_stop"] = stop_note
    result["total_s"] = time.monotonic() - started
    print_soak_report(result)
    if server is not None:
        errors = [line for line in server.log_text().splitlines()
                  if line.startswith(("ERROR", "Traceback", "CRITICAL"))]
        if errors:
            print(f"server log {server.log_path}: {len(errors)} error lines, first: {errors[0]}")
        elif result["passed"]:
            server.remove_log()
    if args.output_json:
        save_json(args.output_json, [result], {k: v for k, v in vars(args).items()
                                               if k != "func"})
        print(f"results saved to {args.output_json}")
    return 0 if result["passed"] else 1
