"""How `pagedllm bench soak` talks to the server and judges each answer.

VALID and INVALID cases go through a pooled `httpx.AsyncClient` and are read to their end;
DISCONNECT cases use a raw socket so the client can close (or reset) exactly where its mode says.
The `check_*` functions are pure: (case, status, body, SSE payloads) -> failures, each a
(check name, what happened) pair with the check names of soak.py's docstring.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

from pagedllm.benchmarks.soak_cases import DISCONNECT, INVALID, VALID, SoakCase

_SNIPPET = 300
_JSON = {"Content-Type": "application/json"}


@dataclass
class Outcome:
    """What one case got.

    Attributes:
        status: HTTP status (None: no status line was read).
        latency_s: send to last byte read.
        failures: (check, what happened) pairs; empty = the case passed.
        disconnect: for a DISCONNECT case, what the client actually did.
    """

    case: SoakCase
    status: int | None = None
    latency_s: float = 0.0
    failures: list[tuple[str, str]] = field(default_factory=list)
    disconnect: str = ""


# ------------------------------------------------------------------ checks (pure)
def _snippet(raw: bytes | str) -> str:
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    return text[:_SNIPPET] + ("..." if len(text) > _SNIPPET else "")


def check_stream(case: SoakCase, events: list[str], complete: bool) -> list[tuple[str, str]]:
    """Failures of a valid stream's SSE `data:` payloads; `complete`: it was read to its end."""
    failures, finished, usage, done_at = [], set(), False, None
    for i, data in enumerate(events):
        if data == "[DONE]":
            done_at = i
            continue
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            failures.append(("valid_completed", f"event is not JSON: {_snippet(data)}"))
            continue
        if not isinstance(chunk, dict) or "error" in chunk:
            failures.append(("stream_error_event", f"error event: {_snippet(data)}"))
            continue
        finished |= {c.get("index") for c in chunk.get("choices") or () if c.get("finish_reason")}
        usage = usage or bool(chunk.get("usage"))
    if not complete:
        return failures
    if done_at is None or done_at != len(events) - 1:
        last = _snippet(events[-1]) if events else "none"
        failures.append(("valid_completed", f"stream does not end with data: [DONE] "
                                            f"({len(events)} events, last {last})"))
    if finished != set(range(case.num_choices)):
        failures.append(("valid_completed", f"finish_reason chunks for choices "
                                            f"{sorted(finished, key=str)}, expected "
                                            f"0..{case.num_choices - 1}"))
    if case.include_usage and not usage:
        failures.append(("valid_completed", "include_usage asked, no usage chunk"))
    return failures


def check_valid(case: SoakCase, status: int, raw: bytes,
                events: list[str] | None) -> list[tuple[str, str]]:
    """Failures of a valid request's complete answer."""
    if status >= 500:
        return [("no_5xx", f"HTTP {status}: {_snippet(raw or '|'.join(events or ()))}")]
    if status != 200:
        return [("valid_completed", f"HTTP {status}: {_snippet(raw)}")]
    if case.stream:
        if events is None:
            return [("valid_completed", f"stream asked, got a plain body: {_snippet(raw)}")]
        return check_stream(case, events, complete=True)
    try:
        choices = json.loads(raw)["choices"]
        indices = sorted(c["index"] for c in choices)
        unfinished = [c["index"] for c in choices if not c.get("finish_reason")]
    except (ValueError, KeyError, TypeError) as e:
        return [("valid_completed", f"not a completion ({type(e).__name__}): {_snippet(raw)}")]
    if indices != list(range(case.num_choices)):
        return [("valid_completed", f"choice indices {indices}, expected "
                                    f"0..{case.num_choices - 1}")]
    if unfinished:
        return [("valid_completed", f"choices {unfinished} have no finish_reason")]
    return []


def check_invalid(case: SoakCase, status: int, raw: bytes,
                  events: list[str] | None) -> list[tuple[str, str]]:
    """Failures of an invalid request's answer (status, error object, error.param)."""
    if status >= 500:
        return [("no_5xx", f"HTTP {status}: {_snippet(raw or '|'.join(events or ()))}")]
    if events is not None:
        errors = [e for e in events if e.startswith("{") and '"error"' in e]
        if status == 200 and errors:
            return [("invalid_stream_status", f"HTTP 200, then {_snippet(errors[0])}")]
        raw = raw or "\n".join(events).encode()
    if status not in case.expect_status:
        failures = [("invalid_rejected", f"HTTP {status} (expected {case.expect_status}): "
                                          f"{_snippet(raw)}")]
        if not 400 <= status < 500:
            return failures
    else:
        failures = []
    try:
        error = json.loads(raw)["error"]
        if not (isinstance(error, dict) and {"message", "type", "param", "code"} <= error.keys()
                and isinstance(error["message"], str) and isinstance(error["type"], str)):
            raise KeyError("error fields")
    except (ValueError, KeyError, TypeError):
        return failures + [("error_object", f"HTTP {status}, body {_snippet(raw)}")]
    if error["param"] not in case.expect_params:
        failures.append(("error_param", f"param {error['param']!r}, expected one of "
                                        f"{list(case.expect_params)}: "
                                        f"{_snippet(error['message'])}"))
    return failures


# ------------------------------------------------------------------ sending
async def _pieces(body: bytes, size: int = 1 << 16) -> AsyncIterator[bytes]:
    for start in range(0, len(body), size):
        yield body[start:start + size]


async def _send_http(client: httpx.AsyncClient, case: SoakCase, timeout_s: float) -> Outcome:
    """A VALID or INVALID case through the pooled client, read to its end."""
    outcome, start = Outcome(case), time.perf_counter()
    raw, events = b"", None
    content = _pieces(case.body) if case.chunked else case.body
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", case.path, content=content, headers=_JSON) as resp:
                outcome.status = resp.status_code
                if resp.headers.get("content-type", "").startswith("text/event-stream"):
                    events = [line[5:].strip() async for line in resp.aiter_lines()
                              if line.startswith("data:")]
                else:
                    raw = await resp.aread()
    except TimeoutError:
        outcome.failures.append(_lost(case, f"no complete answer within {timeout_s:.0f} s "
                                            f"(status {outcome.status})"))
    except httpx.HTTPError as e:
        outcome.failures.append(_lost(case, f"{type(e).__name__}: {e} (status {outcome.status})"))
    outcome.latency_s = time.perf_counter() - start
    if not outcome.failures:
        check = check_valid if case.kind == VALID else check_invalid
        outcome.failures = check(case, outcome.status, raw, events)
    return outcome


def _lost(case: SoakCase, detail: str) -> tuple[str, str]:
    return ("valid_completed" if case.kind != INVALID else "invalid_rejected", detail)


def _raw_request(host: str, port: int, case: SoakCase, api_key: str | None) -> bytes:
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    return (f"POST {case.path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(case.body)}\r\n{auth}"
            f"Connection: close\r\n\r\n").encode() + case.body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    lines = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    return int(lines[0].split()[1]), headers


async def _read_events(reader: asyncio.StreamReader, headers: dict[str, str],
                       stop: Callable[[list[str]], bool]) -> tuple[list[str], bool, bytes]:
    """SSE `data:` payloads until `stop(events)` or the body ends: (events, ended, raw body)."""
    chunked = "chunked" in headers.get("transfer-encoding", "").lower()
    events, buffer, body = [], b"", b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0].strip() or b"0", 16)
            data = (await reader.readexactly(size + 2))[:-2] if size else b""
        else:
            length = headers.get("content-length")
            data = await (reader.readexactly(int(length)) if length else reader.read())
        if not data:
            return events, True, body
        body, buffer = body + data, buffer + data
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            events += [line[5:].strip().decode("utf-8", "replace")
                       for line in event.split(b"\n") if line.startswith(b"data:")]
            if stop(events):
                return events, False, body
        if not chunked:
            return events, True, body


async def _disconnect_exchange(reader: asyncio.StreamReader, case: SoakCase,
                               outcome: Outcome) -> None:
    mode = case.category
    if mode in ("raw_close", "raw_reset"):
        outcome.disconnect = mode
        return
    if mode == "before_first_byte":
        try:
            await asyncio.wait_for(reader.read(1), case.disconnect_after)
            outcome.disconnect = "before_first_byte (too late: the response had begun)"
        except TimeoutError:
            outcome.disconnect = "before_first_byte"
        return
    outcome.status, headers = await _read_head(reader)
    if mode == "mid_stream":
        stop = lambda events: len(events) >= case.disconnect_after  # noqa: E731
    else:
        stop = lambda events: bool(events) and events[-1] == "[DONE]"  # noqa: E731
    events, ended, body = await _read_events(reader, headers, stop)
    if outcome.status != 200:
        outcome.disconnect = f"{mode} (no stream: HTTP {outcome.status})"
        outcome.failures = check_valid(case, outcome.status, body, None)
        return
    outcome.disconnect = mode if not ended else f"{mode} (the stream ended first)"
    complete = ended or mode == "after_last_chunk"
    outcome.failures = check_stream(case, events, complete)


async def _send_disconnect(host: str, port: int, case: SoakCase, api_key: str | None,
                           timeout_s: float) -> Outcome:
    """A DISCONNECT case over a raw socket, closed (or reset) as its mode says."""
    outcome, start = Outcome(case), time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(_raw_request(host, port, case, api_key))
            await writer.drain()
            await _disconnect_exchange(reader, case, outcome)
    except TimeoutError:
        outcome.failures.append(("valid_completed", f"no answer within {timeout_s:.0f} s"))
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        outcome.failures.append(("valid_completed", f"{type(e).__name__}: {e}"))
    finally:
        if writer is not None:
            if case.category == "raw_reset":
                writer.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.close()
            try:
                await writer.wait_closed()
            except OSError:
                pass
    outcome.latency_s = time.perf_counter() - start
    return outcome


async def send_case(client: httpx.AsyncClient, host: str, port: int, api_key: str | None,
                    case: SoakCase, timeout_s: float) -> Outcome:
    """Send one case (raw socket for DISCONNECT ones) and judge its answer."""
    try:
        if case.kind == DISCONNECT:
            return await _send_disconnect(host, port, case, api_key, timeout_s)
        return await _send_http(client, case, timeout_s)
    except Exception as e:  # noqa: BLE001 - one odd answer must not end the run
        return Outcome(case, failures=[_lost(case, f"the soak could not read the answer: "
                                                   f"{type(e).__name__}: {e}")])
