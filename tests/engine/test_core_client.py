"""The engine core in its own process (multiprocess_mode): the same outputs as in-process, per-request
errors stay per request, utility calls, bytes from a socket never run code, signals to the process
group leave the core serving, and a SIGKILLed core fails what is pending at once.

One core process serves the whole module (start-up is the slow part); the last test kills it, so
it must stay last in this file.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import pickle
import signal
import stat
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from pagedllm import SamplingParams
from pagedllm.core.scheduler import SchedulerStats
from pagedllm.engine import core_serial as wire
from pagedllm.engine.async_llm import AsyncLLM, EngineDeadError
from pagedllm.engine.core_client import MPEngineCoreClient, SpawnLauncher
from pagedllm.engine.core_proc import EngineCoreProc
from pagedllm.engine.engine_core import EngineCoreRequest
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.engine.sleep_mode import EngineSleepingError
from pagedllm.sampling_params import RequestOutputKind

ENGINE_KWARGS = {"dtype": "float32", "kv_cache_memory_bytes": 16_000_000, "seed": 0,
                 "enable_sleep_mode": True}
PROMPTS = [f"Prompt {i}: the quick brown fox" + " jumps" * (i % 4) for i in range(5)]


@pytest.fixture(scope="module")
def mp_engine(tiny_llama: Path):
    engine = LLMEngine.from_engine_args(str(tiny_llama), multiprocess_mode=True, **ENGINE_KWARGS)
    yield engine
    engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def inproc_engine(tiny_llama: Path):
    engine = LLMEngine.from_engine_args(str(tiny_llama), **ENGINE_KWARGS)
    yield engine
    engine.engine_core.shutdown()


def _run(engine: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]) -> dict:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    finished = {}
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish"
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return {request_id: ([(c.token_ids, c.text, c.finish_reason,
                           [{t: round(lp.logprob, 5) for t, lp in d.items()}
                            for d in c.logprobs or []]) for c in out.outputs],
                         [d and {t: round(lp.logprob, 5) for t, lp in d.items()}
                          for d in out.prompt_logprobs or []])
            for request_id, out in finished.items()}


def _requests() -> dict[str, tuple[str, SamplingParams]]:
    requests = {f"greedy{i}": (p, SamplingParams(temperature=0.0, max_tokens=10, logprobs=2))
                for i, p in enumerate(PROMPTS)}
    requests["seeded_n2"] = (PROMPTS[0], SamplingParams(temperature=1.0, top_p=0.9, seed=7,
                                                        n=2, max_tokens=10))
    requests["stop"] = (PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=20,
                                                   stop=["e"], stop_token_ids=[3],
                                                   prompt_logprobs=1))
    requests["penalties"] = (PROMPTS[2], SamplingParams(
        temperature=0.8, seed=1, max_tokens=10, repetition_penalty=1.3, logit_bias={5: 3.0},
        bad_words=["ab"]))
    requests["choice"] = (PROMPTS[3], SamplingParams(
        temperature=0.0, max_tokens=10, structured_outputs={"choice": ["yes", "no"]}))
    return requests


def test_outputs_equal_in_process(mp_engine: LLMEngine, inproc_engine: LLMEngine) -> None:
    assert isinstance(mp_engine.engine_core, MPEngineCoreClient)
    expected = _run(inproc_engine, _requests())
    got = _run(mp_engine, _requests())
    assert got == expected
    assert got["choice"][0][0][1] in ("yes", "no")
    assert len(got["stop"][1]) == len(mp_engine.tokenizer(PROMPTS[1]).input_ids)
    seeded = got["seeded_n2"][0]
    assert len(seeded) == 2 and seeded[0] != seeded[1]
    assert mp_engine.get_num_unfinished_requests() == 0
    stats = mp_engine.get_stats()
    assert stats.num_running_reqs == 0 and stats.prefix_cache_stats.requests > 0


def test_abort_and_errors_stay_per_request(mp_engine: LLMEngine) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    mp_engine.add_request("long", PROMPTS[0], long)
    mp_engine.add_request("short", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))
    with pytest.raises(ValueError, match="vocabulary"):
        mp_engine.add_request("bad", {"prompt_token_ids": [10**9]}, long)
    with pytest.raises(ValueError, match="logits_processors"):
        mp_engine.add_request("callable", PROMPTS[2], SamplingParams(
            logits_processors=[lambda ids, logits: logits]))
    finished, seen_long = {}, False
    while not seen_long:
        for out in mp_engine.step():
            seen_long |= out.request_id == "long"
            if out.finished:
                finished[out.request_id] = out
    mp_engine.abort_request("long")
    while mp_engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in mp_engine.step() if o.finished})
    assert list(finished) == ["short"] and len(finished["short"].outputs[0].token_ids) == 4
    # The abort freed the core's request (a utility call is ordered after the abort).
    assert mp_engine.engine_core.call_utility("get_stats").num_running_reqs == 0

    # The core's own guard refuses a request that slipped past the front end's checks (here a
    # priority under fcfs) alone, as an "error" output; the request beside it completes.
    client = mp_engine.engine_core
    good = mp_engine.input_processor.process("ok", PROMPTS[3], SamplingParams(
        temperature=0.0, max_tokens=3))[0]
    client.add_request(EngineCoreRequest("prio", good.prompt_token_ids, good.sampling_params,
                                         3, priority=5))
    client.add_request(good)
    outputs = []
    while client.has_unfinished_requests():
        outputs += client.step()
    errors = [o for o in outputs if o.finish_reason == "error"]
    assert [o.request_id for o in errors] == ["prio"] and "priority" in errors[0].error
    assert sum(len(o.new_token_ids) for o in outputs if o.request_id == "ok") == 3


def test_utility_calls_are_generic(mp_engine: LLMEngine) -> None:
    client = mp_engine.engine_core
    _run(mp_engine, {"lookup": (PROMPTS[0], SamplingParams(max_tokens=1))})
    assert client.get_stats().prefix_cache_stats.queries > 0
    assert client.reset_prefix_cache() >= 0          # a public EngineCore method, forwarded
    # The core sends its stats before a utility call's result: get_stats() is the reset's.
    assert client.get_stats().prefix_cache_stats.queries == 0
    assert client.call_utility("get_num_unfinished_requests") == 0
    stats = client.call_utility("get_stats")
    assert stats.num_blocks == client.num_blocks    # converted back to SchedulerStats
    with pytest.raises(AttributeError, match="private"):
        client.call_utility("_update", None, None)
    with pytest.raises(AttributeError, match="no method"):
        client.call_utility("no_such_method")
    with pytest.raises(AttributeError, match="not available"):
        client.scheduler  # noqa: B018 - the core's internals stay in its process
    with pytest.raises(TypeError):
        client.call_utility("reset_prefix_cache", 1, 2)
    assert client.reset_prefix_cache() >= 0          # still serving


def test_sleeping_core_refuses_requests_and_survives(mp_engine: LLMEngine) -> None:
    """Asleep, a request is refused on the front end with EngineSleepingError (what the server
    turns into 503 engine_sleeping); one that reaches the core anyway is refused there alone,
    and the core serves again after wake_up."""
    client = mp_engine.engine_core
    params = SamplingParams(temperature=0.0, max_tokens=3)
    mp_engine.sleep(1)
    assert mp_engine.is_sleeping()
    with pytest.raises(EngineSleepingError, match="asleep"):
        mp_engine.add_request("asleep", PROMPTS[0], params)
    sneaked = mp_engine.input_processor.process("sneaked", PROMPTS[0], params)[0]
    client._send(wire.request_to_wire(sneaked))   # past the client's own check
    client._unfinished.add("sneaked")
    outputs = []
    while client.has_unfinished_requests():
        outputs += client.step()
    assert [o.finish_reason for o in outputs] == ["error"] and "asleep" in outputs[0].error
    mp_engine.wake_up()
    assert not mp_engine.is_sleeping()
    [(token_ids, *_)], _ = _run(mp_engine, {"awake": (PROMPTS[0], params)})["awake"]
    assert len(token_ids) == 3


class _RunsCode:
    """Unpickling this would create `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_socket_bytes_never_run_code(mp_engine: LLMEngine, inproc_engine: LLMEngine,
                                     tmp_path: Path) -> None:
    client = mp_engine.engine_core
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_RunsCode(str(marker)))
    # IPC sockets only, in a folder only this user may enter; the core process listens on none.
    for address in (client.input_address, client.output_address):
        assert address.startswith("ipc://")
        folder = Path(address[len("ipc://"):]).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for decoder in (wire.make_input_decoder(), wire.make_output_decoder()):
        for frame in (payload, b"\x00\xff garbage", msgspec.msgpack.encode(["add", 1])):
            with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
                decoder.decode(frame)
    # A peer that reaches the front end's listening socket: its frames are dropped.
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(client.output_address)
    sock.send(payload)
    sock.send(b"\x93\xa6result")
    sock.close(linger=1000)
    ctx.term()
    # The core's side of the loop drops such frames too (checked on an in-process core).
    proc = EngineCoreProc(inproc_engine.engine_core, [], [], os.getpid())
    refused: list = []
    proc._handle(0, memoryview(payload), refused)
    assert not refused and not proc._stopping
    # A well-formed frame with malformed sampling parameters fails that request alone.
    for bad in ({"temperature": -1.0, "output_kind": 0}, {"temperature": 0.0},
                {"output_kind": 0, "no_such_field": 1}):
        frame = msgspec.msgpack.encode(wire.AddRequest("bad", [1, 2], bad, 3, None, 0, None))
        proc._handle(0, memoryview(frame), refused)
    assert [o.finish_reason for _, o in refused] == ["error"] * 3
    assert not inproc_engine.engine_core.has_unfinished_requests()
    result = proc._call_utility(wire.CallUtility(0, "__class__", []))
    assert result.error is not None and "private" in result.error
    out = _run(mp_engine, {"after": (PROMPTS[0], SamplingParams(temperature=0.0,
                                                                max_tokens=3))})
    assert len(out["after"][0][0][0]) == 3
    assert not marker.exists()


def test_core_serves_several_front_ends(inproc_engine: LLMEngine) -> None:
    """One core, two front ends (the API-server pool's layout): each request's outputs and each
    utility result go back to the front end that sent it, aborts are acknowledged to their
    sender, a front end with no request on the core still gets the stats once it is idle, and
    the counters the front ends receive add up to the core's (each gets its share)."""
    ctx = zmq.Context()
    fronts, pulls, pushes = [], [], []
    for i in range(2):
        to_core, from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        to_core.bind(f"inproc://in{i}")
        from_core.bind(f"inproc://out{i}")
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.connect(f"inproc://in{i}")
        push.connect(f"inproc://out{i}")
        fronts.append((to_core, from_core))
        pulls.append(pull)
        pushes.append(push)
    base = inproc_engine.engine_core.get_stats().prefix_cache_stats
    proc = EngineCoreProc(inproc_engine.engine_core, pulls, pushes, os.getpid())
    encoder, decoder = wire.make_encoder(), wire.make_output_decoder()
    params = {"temperature": 0.0, "max_tokens": 3, "output_kind": 0}
    prompt = inproc_engine.tokenizer.encode(PROMPTS[0])
    fronts[0][0].send(encoder.encode(wire.AddRequest("a", prompt, params, 3, None, 0, None)))
    fronts[1][0].send(encoder.encode(wire.AddRequest("b", prompt, params, 3, None, 0, None)))
    fronts[1][0].send(encoder.encode(wire.AddRequest("c", prompt, params, 3, None, 0, None)))
    fronts[1][0].send(encoder.encode(wire.AbortRequests(["c"])))
    proc._process_inputs(block=False)
    fronts[1][0].send(encoder.encode(wire.CallUtility(7, "get_num_unfinished_requests", [])))
    proc._process_inputs(block=False)
    while proc.core.has_unfinished_requests():
        proc._send_outputs(proc.core.step())
    received: list[list] = [[], []]
    for i, (_, from_core) in enumerate(fronts):
        while from_core.poll(100):
            received[i].append(decoder.decode(from_core.recv()))
    steps = [[m for m in msgs if isinstance(m, wire.StepOutputs)] for msgs in received]
    ids = [{o.request_id for m in msgs for o in m.outputs} for msgs in steps]
    assert ids == [{"a"}, {"b"}]
    assert [sum(m.aborts_handled for m in msgs) for msgs in steps] == [0, 1]
    results = [m for m in received[1] if isinstance(m, wire.UtilityResult)]
    assert [(r.call_id, r.result) for r in results] == [(7, 2)]
    assert not any(isinstance(m, wire.UtilityResult) for m in received[0])
    assert steps[0][-1].stats.num_running_reqs == steps[1][-1].stats.num_running_reqs == 0
    end = inproc_engine.engine_core.get_stats().prefix_cache_stats
    shares = [msgs[-1].stats.prefix_cache_stats for msgs in steps]
    assert sum(s.queries for s in shares) == end.queries - base.queries
    assert sum(s.requests for s in shares) == end.requests - base.requests == 2
    for sock in (*pulls, *pushes, *(s for pair in fronts for s in pair)):
        sock.close(linger=0)
    ctx.term()


class _TcpLauncher(SpawnLauncher):
    """A local core process reached over TCP + CURVE, as a Ray actor on another node is."""

    bind_host = "127.0.0.1"


@pytest.mark.slow
def test_tcp_transport_admits_only_its_core(tiny_llama: Path, inproc_engine: LLMEngine,
                                            tmp_path: Path) -> None:
    """Over TCP (the Ray backend's transport) the sockets listen on the configured address
    only, and a peer without the core's CURVE key pair neither receives requests nor gets its
    bytes (a pickle) read: the requests still finish as in-process, and nothing ran."""
    config = inproc_engine.config
    engine = LLMEngine(config, multiprocess_mode=_TcpLauncher())
    try:
        client = engine.engine_core
        assert client.input_address.startswith("tcp://127.0.0.1:")
        marker = tmp_path / "pwned"
        ctx = zmq.Context()
        thief = ctx.socket(zmq.PULL)     # would take every other request from a plain PUSH
        thief.connect(client.input_address)
        forger = ctx.socket(zmq.PUSH)
        forger.connect(client.output_address)
        forger.send(pickle.dumps(_RunsCode(str(marker))), zmq.NOBLOCK)
        requests = {f"r{i}": (p, SamplingParams(temperature=0.0, max_tokens=6))
                    for i, p in enumerate(PROMPTS)}
        assert _run(engine, requests) == _run(inproc_engine, requests)
        assert not thief.poll(500)
        thief.close(linger=0)
        forger.close(linger=0)
        ctx.term()
        assert not marker.exists()
    finally:
        engine.engine_core.shutdown()


@pytest.mark.slow
def test_start_up_error_is_raised_as_in_process(tiny_llama: Path) -> None:
    """A core that cannot start (a KV cache too small for one block) raises the in-process
    engine's error type and message in the front end, and leaves no process behind."""
    kwargs = {**ENGINE_KWARGS, "kv_cache_memory_bytes": 1000}
    with pytest.raises(Exception) as in_process:
        LLMEngine.from_engine_args(str(tiny_llama), **kwargs)
    with pytest.raises(type(in_process.value), match="KV cache budget") as multiprocess:
        LLMEngine.from_engine_args(str(tiny_llama), multiprocess_mode=True, **kwargs)
    assert str(in_process.value) in str(multiprocess.value)
    assert not [c for c in mp.active_children() if c.name == "pagedllm-engine-core"]


def test_group_signals_leave_the_core_serving_until_told(mp_engine: LLMEngine,
                                                         inproc_engine: LLMEngine) -> None:
    """SIGTERM and SIGINT reach a whole process group (systemd's stop, a Ctrl-C): the core
    ignores them and serves on, for its front ends' graceful shutdown; the API-server pool's
    stop pipe (its write end closed) ends the core's loop."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        os.kill(mp_engine.engine_core.pid, sig)
    time.sleep(0.3)
    mp_engine.check_health()
    requests = {"after_signals": (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=5))}
    assert _run(mp_engine, requests) == _run(inproc_engine, requests)
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://stop-in")
    push.bind("inproc://stop-out")
    stop_r, stop_w = mp.Pipe(duplex=False)
    proc = EngineCoreProc(inproc_engine.engine_core, pull, push, None, stop_r)
    loop = threading.Thread(target=proc.run)
    loop.start()
    loop.join(0.6)
    assert loop.is_alive()          # idle, waiting for input
    stop_w.close()
    loop.join(5)
    assert not loop.is_alive()
    stop_r.close()
    for sock in (pull, push):
        sock.close(linger=0)
    ctx.term()


def test_async_streaming_abort_and_sigkill(mp_engine: LLMEngine,
                                           inproc_engine: LLMEngine) -> None:
    """Must run last: it shuts the module's core down (by killing it)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, output_kind=RequestOutputKind.DELTA)
    expected = _run(inproc_engine, {"s": (PROMPTS[4], SamplingParams(temperature=0.0,
                                                                     max_tokens=8))})
    recorded: list[SchedulerStats] = []

    class Recorder:
        def record(self, scheduler_stats, iteration_stats) -> None:
            recorded.append(scheduler_stats)

    async_llm = AsyncLLM(mp_engine, [Recorder()])
    dead: list[BaseException] = []

    async def run():
        async_llm.on_dead(dead.append)
        deltas = [out.outputs[0].token_ids async for out in
                  async_llm.generate(PROMPTS[4], params, "stream")]
        # (How many deltas is timing: a consumer that falls behind gets them merged.)
        assert [t for d in deltas for t in d] == expected["s"][0][0][0]
        # Abort by closing the stream after its first output.
        stream = await async_llm.add_request("abort", PROMPTS[0], SamplingParams(
            temperature=0.0, max_tokens=500, ignore_eos=True))
        await stream.__anext__()
        stream.close()
        # The gauges follow the abort: the last stats recorded (an idle loop records nothing
        # more) show no request running (they kept showing 1 after a client disconnect).
        deadline = time.monotonic() + 10
        while recorded[-1].num_running_reqs or recorded[-1].num_waiting_reqs:
            assert time.monotonic() < deadline, recorded[-1]
            await asyncio.sleep(0.05)
        # A pending request when the core process is SIGKILLed: fails at once.
        stream = await async_llm.add_request("killed", PROMPTS[1], SamplingParams(
            temperature=0.0, max_tokens=1000, ignore_eos=True))
        await stream.__anext__()
        os.kill(mp_engine.engine_core.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="died"):
            async for _ in stream:
                pass
        # At once (the client waits on the process sentinel), not at a request timeout; the
        # margin is for a loaded 2-core machine.
        assert time.monotonic() - start < 15
        with pytest.raises(EngineDeadError):
            await async_llm.add_request("late", PROMPTS[2], params)
        await asyncio.sleep(0.1)  # the on_dead callbacks run on the loop

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        async_llm.shutdown()
    assert dead and async_llm.dead_error is not None  # what /health reports
