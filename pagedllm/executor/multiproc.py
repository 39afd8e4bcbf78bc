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
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import signal
import socket
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.executor.abstract import DistributedExecutorBase, WorkerDiedError, driver_rank
from pagedllm.platforms import current_platform

logger = logging.getLogger(__name__)

# Seconds a worker gets to exit after "shutdown" before it is terminated, then killed.
_SHUTDOWN_GRACE_S = 5.0


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


def _mp_context():
    method = os.environ.get("PAGEDLLM_WORKER_MULTIPROC_METHOD",
                            current_platform.worker_multiproc_method)
    ctx = mp.get_context(method)
    if method == "forkserver":
        # The server imports torch and the worker once; each worker is then a cheap fork of it.
        ctx.set_forkserver_preload(["pagedllm.worker.worker"])
    return ctx


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
                 engine_conns: list[Connection]) -> None:
    """Body of a worker process: build the Worker, then serve calls until "shutdown" or EOF.

    `conn` is the pipe to the engine (None for the ranks of other nodes, which take their calls
    from rank 0). `engine_conns` are the engine's ends of the pipes created so far: closed here,
    so that the worker sees EOF (and exits) when the engine process dies.
    """
    for c in engine_conns:
        c.close()
    from pagedllm.worker.worker import Worker

    per_node = _ranks_per_node(config)
    try:
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
    usual `if __name__ == "__main__":` guard.

    Raises:
        WorkerDiedError: a worker failed to start or load the model (with its traceback).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.world_size = config.parallel_config.world_size
        self.driver_rank = driver_rank(config)
        self._closed = False
        ctx = _mp_context()
        init_method = _init_method(config)
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(_ranks_per_node(config)):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, name=f"pagedllm-worker-{rank}", daemon=True,
                               args=(config, rank, init_method, child_conn,
                                     self.conns + [parent_conn]))
            proc.start()
            child_conn.close()
            self.procs.append(proc)
            self.conns.append(parent_conn)
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
                self._fail(f"worker rank {rank} is unreachable ({e}); exit code "
                           f"{self.procs[rank].exitcode}")
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
                    self.procs[rank].join(1)
                    self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) died during "
                               f"{method} with exit code {self.procs[rank].exitcode}")
                if status == "error":
                    self._fail(f"worker rank {rank} failed in {method}:\n{value}")
                for r, v in value.items():
                    results[r] = v
            if not answered:
                rank = sentinels[next(s for s in ready if s in sentinels)]
                self._fail(f"worker rank {rank} (pid {self.procs[rank].pid}) died during "
                           f"{method} with exit code {self.procs[rank].exitcode}")
        return results

    def _fail(self, message: str) -> None:
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
