"""MultiprocExecutor: one worker process per rank, on this machine or over several (`nnodes`).

    engine process (node 0)              worker processes of node 0 (one per local rank)
    ───────────────────────              ───────────────────────────────────────────────
    collective_rpc(method, args) ─pipe─► rank 0: Worker.method(*args) ─┐
                                 ─pipe─► rank 1: Worker.method(*args) ─┤ torch.distributed
                                 ◄─pipe─ ("ok", {rank: result}) | ("error", traceback)
                                                    │
                         nnodes > 1 only: rank 0 relays each call to the ranks of the other nodes
                         (gloo broadcast_object_list) and gathers their answers (gather_object);
                         those run under `pagedllm worker --node-rank K` (`run_headless`).

Every call reaches every rank (the SchedulerOutput is pickled once and sent through the pipes);
the engine waits for every local rank's answer, keeping only the driver's result for
`execute_model`. While waiting it watches every local worker's process sentinel, so a worker
that dies (killed, crashed, out of memory) raises `WorkerDiedError` within a fraction of a second
and the executor terminates the remaining workers: the engine fails loudly, never hangs. A worker
whose engine process dies sees its pipe close and exits.

Why a worker failed must reach the engine's caller, in the exception:
- a Python exception in the worker's code travels over its pipe as ("error", traceback);
- everything else the worker prints (a crash in C code, the stacks `faulthandler` dumps on a
  fatal signal, a failure of multiprocessing's own bootstrap) goes to its stderr, which is a pipe
  to this process: a thread per worker copies it to our stderr and keeps its last lines for the
  error of a worker that dies (`_StderrTail`);
- a main module that 'spawn'/'forkserver' cannot import again in the worker (a script read from
  stdin) is refused before any worker starts (`check_main_reimportable`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import sys
import threading
import traceback
import weakref
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Any, NoReturn

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import DistributedExecutorBase, WorkerDiedError, driver_rank
from pagedllm.platforms import current_platform

logger = logging.getLogger(__name__)

# Seconds a worker gets to exit after "shutdown" before it is terminated, then killed.
_SHUTDOWN_GRACE_S = 5.0
_PEER_DEATH_GRACE_S = 2.0   # how long a rank's error waits for a peer's death to show (seconds)
# What a dead worker's error quotes of its stderr: at most this many of its last lines / bytes.
_TAIL_LINES = 25
_TAIL_BYTES = 16384
# Seconds to wait for the rest of a dead worker's stderr before quoting what has arrived.
_TAIL_WAIT_S = 2.0
# Held while fd 2 is redirected to a starting 'spawn' worker (`_stderr_redirected_to`) and by
# every `_StderrTail` write to fd 2, so no copy ever lands in a worker's own pipe.
_STDERR_LOCK = threading.Lock()


def get_open_port() -> int:
    """A free TCP port on this machine (for the torch.distributed rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks_per_node(config: EngineConfig) -> int:
    pc = config.parallel_config
    return pc.world_size // pc.nnodes


def _init_method(config: EngineConfig) -> str:
    pc = config.parallel_config
    return f"tcp://{pc.master_addr}:{pc.master_port or get_open_port()}"


def _start_method() -> str:
    return (current_platform.options.worker_multiproc_method
            or current_platform.worker_multiproc_method)


def _main_reimported_as(method: str) -> str | None:
    """What start method `method` runs again in each worker before our code: "module NAME"
    (`python -m NAME`), "file PATH" (`python PATH`, PATH as `__main__.__file__` gives it), or
    None (fork copies the process; `python -c`, the REPL and notebooks have no file, and
    multiprocessing skips a package's `__main__`)."""
    if method == "fork":
        return None
    main = sys.modules.get("__main__")
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return None if name.split(".")[-1] == "__main__" else f"module {name}"
    path = getattr(main, "__file__", None)
    return None if path is None else f"file {path}"


def check_main_reimportable(method: str) -> None:
    """Refuse to start workers with `method` when they could not import `__main__` again.

    'spawn' and 'forkserver' run the main module again in every worker (multiprocessing's
    bootstrap, before any pagedllm code), from `__main__.__file__` when it was not run with
    `python -m`. A script read from stdin (`python -`) has the file name '<stdin>', so every
    worker would die in that bootstrap with FileNotFoundError.

    Raises:
        RuntimeError: `__main__.__file__` names no existing file; the message gives the fixes.
    """
    target = _main_reimported_as(method)
    if target is None or not target.startswith("file "):
        return
    path = target[len("file "):]
    if os.path.isfile(os.path.abspath(path)):
        return
    raise RuntimeError(
        f"cannot start the worker processes with the {method!r} multiprocessing start method: "
        f"it runs the main module again in each worker from __main__.__file__ = {path!r}, which "
        f"is not a file (a script read from stdin, `python -`, or built in memory). Save the "
        f"script to a file and run `python script.py` (creating the engine under `if __name__ "
        f"== \"__main__\":`), or set PAGEDLLM_WORKER_MULTIPROC_METHOD=fork (only while no CUDA "
        f"context exists in this process)")


def _mp_context():
    """The multiprocessing context of the workers (see MultiprocExecutor).

    Raises:
        RuntimeError: the start method cannot re-import the main module (see
            `check_main_reimportable`).
    """
    method = _start_method()
    check_main_reimportable(method)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # The server imports torch and the worker once; each worker is then a cheap fork of it.
        ctx.set_forkserver_preload(["pagedllm.worker.worker"])
    return ctx


class _StderrTail:
    """One worker's stderr: a pipe whose reading end a daemon thread copies to this process's
    fd 2 (where the worker used to write directly), keeping the last `_TAIL_BYTES` for the
    error raised when the worker dies.

    `writer` is a `Connection` used only for its file descriptor, so that multiprocessing hands
    it to the worker under every start method; the worker makes it its fd 2
    (`_worker_main`). The thread ends when every copy of `writer` is closed: the engine's (by
    `close_writer`, once the worker started) and the worker's (when it exits).
    """

    def __init__(self, ctx, name: str) -> None:
        self._reader, self.writer = ctx.Pipe(duplex=False)
        self._tail = b""
        self._received = 0  # bytes so far: a position for `printed_since`
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name=name, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        fd = self._reader.fileno()
        while chunk := _read_or_eof(fd):
            with _STDERR_LOCK:
                _write_fully(2, chunk)
            with self._lock:
                self._received += len(chunk)
                self._tail = (self._tail + chunk)[-_TAIL_BYTES:]
        self._reader.close()

    def close_writer(self) -> None:
        """Close the engine's copy of the worker's end (after the worker has started)."""
        self.writer.close()

    def position(self) -> int:
        """How many bytes the worker has printed so far."""
        with self._lock:
            return self._received

    def printed_since(self, position: int, wait_s: float = _TAIL_WAIT_S) -> str:
        """The last `_TAIL_LINES` lines the worker printed after `position` ("" if none), after
        waiting up to `wait_s` seconds for the pipe to close (a dead worker's last words)."""
        self._thread.join(wait_s)
        with self._lock:
            new = self._received - position
            tail = self._tail[-new:] if new > 0 else b""
        return "\n".join(tail.decode(errors="replace").splitlines()[-_TAIL_LINES:]).strip("\n")


def _read_or_eof(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:
        return b""


def _write_fully(fd: int, data: bytes) -> None:
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # our stderr is closed: the text stays in the tail only


def _flush_stderr() -> None:
    if sys.stderr is not None:  # None under pythonw and some embedders
        sys.stderr.flush()


@contextlib.contextmanager
def _stderr_redirected_to(fd: int):
    """Make `fd` this process's fd 2 for the duration (under `_STDERR_LOCK`).

    NOTE(spawn): a 'spawn' worker inherits fd 2 when it is created, and multiprocessing's
    bootstrap (the main module's re-import) runs and fails before the worker could redirect its
    own stderr; so fd 2 is the worker's pipe while `Process.start()` creates it. Whatever other
    threads print in those milliseconds goes through that pipe and is still copied to fd 2.
    """
    _flush_stderr()
    with _STDERR_LOCK:
        saved = os.dup(2)
        try:
            os.dup2(fd, 2)
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _control_group(config: EngineConfig):
    """With several nodes: the gloo group of rank 0 and the ranks of nodes 1.. (every rank
    creates it, in the same order, after its TP/PP groups); None on one node."""
    if config.parallel_config.nnodes == 1:
        return None
    import torch.distributed as dist

    ranks = [0] + list(range(_ranks_per_node(config), config.parallel_config.world_size))
    return dist.new_group(ranks, backend="gloo")


def _call(worker, rank: int, message: tuple) -> tuple[str, Any]:
    method, args, reply_rank = message
    try:
        result = getattr(worker, method)(*args)
        return "ok", result if reply_rank is None or reply_rank == rank else None
    except BaseException:
        return "error", traceback.format_exc()


def _worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection | None,
                 engine_conns: list[Connection], stderr: Connection | None = None) -> None:
    """Body of a worker process: build the Worker, then serve calls until "shutdown" or EOF.

    `conn` is the pipe to the engine (None for the ranks of other nodes, which take their calls
    from rank 0). `engine_conns` are the engine's ends of the pipes created so far: closed here,
    so that the worker sees EOF (and exits) when the engine process dies. `stderr`, when given,
    becomes this process's fd 2 (a `_StderrTail` of the engine), with `faulthandler` writing
    there on a fatal signal.
    """
    # NOTE(ctrl-c): a terminal's Ctrl-C signals the whole foreground process group. The engine
    # process decides what it means (abort requests between steps, then shut the workers down),
    # so a worker ignores it instead of dying inside a collective with a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if stderr is not None:
        _flush_stderr()
        os.dup2(stderr.fileno(), 2)
        stderr.close()
        faulthandler.enable()
    for c in engine_conns:
        c.close()
    per_node = _ranks_per_node(config)
    try:
        from pagedllm.worker.worker import Worker

        current_platform.configure_options()    # this process's PAGEDLLM_* variables
        worker = Worker(config, rank=rank, local_rank=rank % per_node, local_world_size=per_node,
                        distributed_init_method=init_method)
        control = _control_group(config)
    except BaseException:
        if conn is not None:
            conn.send(("error", traceback.format_exc()))
        raise
    if conn is None:
        _serve_relayed_calls(worker, rank, control)
        return
    conn.send(("ok", {rank: os.getpid()}))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the engine process is gone
        if control is not None and rank == 0:
            try:
                _relay(control, message)
            except BaseException:
                # A rank of another node is gone (gloo: "Connection closed by peer").
                conn.send(("error", traceback.format_exc()))
                break
        if message[0] == "shutdown":
            worker.shutdown()
            break
        status, value = _call(worker, rank, message)
        if status == "ok" and control is not None and rank == 0:
            status, value = _gather_relayed(control, value)
        elif status == "ok":
            value = {rank: value}
        conn.send((status, value))


def _relay(control, message: tuple) -> None:
    import torch.distributed as dist

    dist.broadcast_object_list([message], src=0, group=control)


def _gather_relayed(control, own_value: Any) -> tuple[str, Any]:
    """Rank 0: collect the other nodes' answers; ("ok", {rank: value}) or ("error", text)."""
    import torch.distributed as dist

    answers: list[Any] = [None] * dist.get_world_size(control)
    dist.gather_object(("ok", own_value), answers, dst=0, group=control)
    ranks = dist.get_process_group_ranks(control)
    results = {}
    for r, (status, value) in zip(ranks, answers):
        if status == "error":
            return "error", f"worker rank {r} failed:\n{value}"
        results[r] = value
    return "ok", results


def _serve_relayed_calls(worker, rank: int, control) -> None:
    """A rank of node 1..: take each call from rank 0's broadcast, answer through a gather."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=control)
        if box[0][0] == "shutdown":
            worker.shutdown()
            return
        dist.gather_object(_call(worker, rank, box[0]), None, dst=0, group=control)


class MultiprocExecutor(DistributedExecutorBase):
    """Start the worker processes of this node (all ranks when nnodes == 1), load the model.

    The start method is the platform's `worker_multiproc_method`: "forkserver" on CPU (workers
    fork from a clean server that has imported torch once, so only the first engine of a process
    pays the import; a plain "fork" of a process that has already run OpenMP-parallel torch ops
    can hang in the child), "spawn" on CUDA (which cannot be forked once initialised).
    `PAGEDLLM_WORKER_MULTIPROC_METHOD` overrides it. Either way the calling script needs the
    usual `if __name__ == "__main__":` guard, and must be a file (not stdin) unless it is "fork".

    Raises:
        RuntimeError: the start method cannot re-import the main module (`python -`), before
            any worker starts.
        WorkerDiedError: a worker failed to start or load the model (with its traceback, or
            the last lines it printed when it died without one).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel_config.world_size
        self.driver_rank = driver_rank(config)
        self._closed = False
        ctx = _mp_context()
        self._start_method = ctx.get_start_method()
        init_method = _init_method(config)
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        self._stderr_tails: list[_StderrTail] = []
        # Each tail's position at the last answer of every worker: a dead worker's error
        # quotes only what it printed since (a call's output, or its dying words in between).
        self._call_positions: list[int] = []
        if self._start_method == "spawn":
            # Started now, so that it does not inherit a worker's stderr below.
            resource_tracker.ensure_running()
        for rank in range(_ranks_per_node(config)):
            parent_conn, child_conn = ctx.Pipe()
            tail = _StderrTail(ctx, name=f"pagedllm-worker-{rank}-stderr")
            proc = ctx.Process(target=_worker_main, name=f"pagedllm-worker-{rank}", daemon=True,
                               args=(config, rank, init_method, child_conn,
                                     self.conns + [parent_conn], tail.writer))
            with (_stderr_redirected_to(tail.writer.fileno()) if self._start_method == "spawn"
                  else contextlib.nullcontext()):
                proc.start()
            child_conn.close()
            tail.close_writer()
            self.procs.append(proc)
            self.conns.append(parent_conn)
            self._stderr_tails.append(tail)
            self._call_positions.append(0)
        # Workers left alive by a caller that never calls shutdown() are stopped at collection.
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        try:
            self._gather("start-up")
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of this node's workers, in rank order."""
        return [p.pid for p in self.procs]

    def collective_rpc(self, method: str, args: tuple = (),
                       reply_rank: int | None = None) -> list[Any]:
        """Call `Worker.method(*args)` on every rank; their results in rank order.

        With `reply_rank` only that rank sends its result back (the others answer None).

        Raises:
            WorkerDiedError: a worker died, raised, or the executor is shut down.
        """
        if self._closed:
            raise WorkerDiedError("the executor is shut down")
        payload = pickle.dumps((method, args, reply_rank))
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except (BrokenPipeError, OSError) as e:
                self._died(rank, method, f"became unreachable during {method} ({e})")
        return self._gather(method)

    def _gather(self, method: str) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        pending = {conn: r for r, conn in enumerate(self.conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while pending:
            ready = wait(list(pending) + list(sentinels))
            answered = [c for c in ready if c in pending]
            for conn in answered:
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    self._died(rank, method)
                if status == "error":
                    # A rank whose collective broke because a peer died reports first at times:
                    # the dead peer, if any within a moment, is the cause to report.
                    dead = wait(list(sentinels), timeout=_PEER_DEATH_GRACE_S)
                    if dead:
                        self._died(sentinels[dead[0]], method)
                    self._fail(f"worker rank {rank} failed in {method}:\n{value}")
                for r, v in value.items():
                    results[r] = v
            if not answered:
                self._died(sentinels[next(s for s in ready if s in sentinels)], method)
        self._call_positions = [tail.position() for tail in self._stderr_tails]
        return results

    def _died(self, rank: int, method: str, how: str | None = None) -> NoReturn:
        """Fail with the death of worker `rank` during `method`, quoting what it printed."""
        proc = self.procs[rank]
        proc.join(1)
        how = how or f"died during {method}"
        message = f"worker rank {rank} (pid {proc.pid}) {how} with exit code {proc.exitcode}"
        printed = self._stderr_tails[rank].printed_since(self._call_positions[rank])
        reimported = _main_reimported_as(self._start_method)
        if printed:
            message += f". What it printed last (since the workers' previous answer):\n{printed}"
        elif method == "start-up" and proc.exitcode == 1 and reimported is not None:
            # NOTE(forkserver): a forkserver worker's bootstrap prints to the server's stderr,
            # which is ours as it was when the server started: not capturable per worker.
            message += (
                f". It printed nothing here, so it most likely failed while multiprocessing's "
                f"{self._start_method!r} start method ran the main module ({reimported}) again "
                f"in the worker, before any pagedllm code (the traceback is on this process's "
                f"stderr). A script must create the engine under `if __name__ == "
                f"\"__main__\":`, so that the worker's import of it does not start another")
        self._fail(message)

    def _fail(self, message: str) -> NoReturn:
        self.shutdown()
        raise WorkerDiedError(message)

    def shutdown(self) -> None:
        """Ask the workers to leave their groups and exit; terminate those that do not."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        _stop_workers(self.procs, self.conns)


def _stop_workers(procs: list[mp.process.BaseProcess], conns: list[Connection]) -> None:
    alive = [p.is_alive() for p in procs]
    if all(alive):
        # A clean stop: every rank leaves torch.distributed together.
        for conn in conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", (), None)))
            except (BrokenPipeError, OSError):
                pass
    for p, was_alive in zip(procs, alive):
        if was_alive:
            p.join(_SHUTDOWN_GRACE_S if all(alive) else 0)
        if p.is_alive():
            p.terminate()
            p.join(_SHUTDOWN_GRACE_S)
        if p.is_alive():
            p.kill()
            p.join()
    for conn in conns:
        conn.close()


def run_headless(config: EngineConfig) -> int:
    """Run node `config.parallel_config.node_rank` (>= 1) of a multi-node `mp` layout: start
    its ranks, which take their calls from rank 0 on node 0, and wait until they exit.

    Returns the first non-zero exit code of a worker (0 when all exit cleanly), or 128 + the
    signal number after SIGTERM/SIGINT, which stop the workers.

    Raises:
        ValueError: for node_rank 0 (node 0 runs the engine itself).
    """
    pc = config.parallel_config
    if pc.node_rank == 0:
        raise ValueError("node_rank 0 runs the engine (pagedllm serve / generate / LLM); "
                         "`pagedllm worker` is for node_rank >= 1")
    current_platform.configure_options()
    ctx = _mp_context()
    per_node = _ranks_per_node(config)
    init_method = _init_method(config)
    procs = [ctx.Process(target=_worker_main, name=f"pagedllm-worker-{rank}", daemon=True,
                         args=(config, rank, init_method, None, []))
             for rank in range(pc.node_rank * per_node, (pc.node_rank + 1) * per_node)]
    for p in procs:
        p.start()
    logger.info("node %d of %d: ranks %s, rendezvous %s", pc.node_rank, pc.nnodes,
                [pc.node_rank * per_node + i for i in range(per_node)], init_method)
    previous = {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        remaining = list(procs)
        while remaining:
            for sentinel in wait([p.sentinel for p in remaining]):
                p = next(p for p in remaining if p.sentinel == sentinel)
                remaining.remove(p)
                if p.exitcode:
                    logger.error("worker %s exited with code %s", p.name, p.exitcode)
                    return p.exitcode
        return 0
    except SystemExit as e:
        return int(e.code)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for p in procs:
            if p.is_alive():
                p.terminate()
            p.join(_SHUTDOWN_GRACE_S)
            if p.is_alive():
                p.kill()


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
