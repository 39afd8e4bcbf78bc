"""The copy queue of a KV connector's worker side: its transfers run in submission order on one
background thread (and, on CUDA, on one copy stream), so they overlap the forward; a caller
waits for exactly the transfer it needs (one layer's loads, a step's saves).

    compute thread                       copy thread (and copy stream)
    start_load_kv:   submit(load L0), submit(load L1), ...   -> L0, L1, ... in order
    layer 0:  wait(L0) -> attention 0 -> submit(save L0)     -> save L0 after the loads
    layer 1:  wait(L1) -> attention 1 -> submit(save L1)     -> ...
    wait_for_save:   wait(every save)

Ordering guarantees (what makes it safe):

- **One thread, FIFO.** A transfer starts after every transfer submitted before it, so a save
  of a host slot never overtakes an earlier load of that slot, and a step's saves finish
  before the next step's loads touch the same blocks.
- **CUDA: after the compute queued so far.** `submit` records an event on the caller's
  current stream and the copy waits for it: a save reads a layer only after the kernels that
  wrote it, and a load overwrites a block only after the kernels of earlier steps that read
  it. `wait` makes the caller's stream wait for the copy (no host sync); `wait_host` also
  blocks the host (before it reads host memory a copy wrote).
- **Torch releases the GIL** in its copy kernels, so on the CPU the copy thread runs beside
  the compute thread's kernels, with one intra-op thread of its own.

With `asynchronous=False` every transfer runs inline in `submit` (the synchronous baseline,
on the same code path). A transfer that raises re-raises in whoever waits for it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CopyQueue:
    """See the module docstring.

    Args:
        device: the KV cache's device (a CUDA device gets a copy stream).
        asynchronous: False runs every transfer inline (synchronously).
    """

    def __init__(self, device: torch.device, asynchronous: bool = True) -> None:
        self.asynchronous = asynchronous
        self._executor = None
        if asynchronous:
            # One intra-op thread for the copy thread's own kernels (memory copies): the
            # forward's thread keeps its team, and two OpenMP teams on the same cores wait for
            # each other (a 2 MiB copy took 96 ms with two threads beside another process's
            # load, 0.5 ms with one). torch.set_num_threads sets the calling thread's count
            # and torch's default for threads not yet started; the thread is started now and
            # the default put back, so no other thread is affected.
            threads = torch.get_num_threads()
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer",
                                                initializer=_one_intra_op_thread)
            self._executor.submit(int).result()
            torch.set_num_threads(threads)
        self._stream = (torch.cuda.Stream(device) if asynchronous and device.type == "cuda"
                        else None)

    def submit(self, transfer: Callable[[], None]) -> Future:
        """Run `transfer()` after every earlier one (on CUDA: and after the work queued on the
        caller's current stream); returns what `wait` / `wait_host` take."""
        if self._executor is None:
            done: Future = Future()
            try:
                transfer()
                done.set_result(None)
            except BaseException as e:   # (re-raised by `wait`, as the thread's would be)
                done.set_exception(e)
            return done
        if self._stream is None:
            return self._executor.submit(transfer)
        ready = torch.cuda.Event()
        ready.record()
        return self._executor.submit(self._on_stream, transfer, ready)

    def _on_stream(self, transfer: Callable[[], None], ready) -> object:
        # (the copy thread's current device is its own: CUDA keeps it per thread)
        with torch.cuda.device(self._stream.device), torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            transfer()
            finished = torch.cuda.Event()
            finished.record(self._stream)
        return finished

    def wait(self, ticket: Future) -> None:
        """The transfer of `ticket` is done (on CUDA: the caller's stream waits for it).

        Raises:
            Whatever the transfer raised.
        """
        finished = ticket.result()
        if finished is not None:
            torch.cuda.current_stream().wait_event(finished)

    def wait_host(self, ticket: Future) -> None:
        """As `wait`, and the host waits for the copy too (before reading what it wrote)."""
        finished = ticket.result()
        if finished is not None:
            finished.synchronize()

    def shutdown(self) -> None:
        """Finish the queued transfers and stop the thread."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)


def _one_intra_op_thread() -> None:
    """(The copy thread's start.) Its own intra-op thread count: 1. The count read back makes
    torch take it as this thread's now, rather than at its first kernel from the default of
    that moment."""
    torch.set_num_threads(1)
    torch.get_num_threads()


def wait_all(queue: CopyQueue, tickets: list[Future]) -> None:
    """`queue.wait_host` every ticket, even after one failed.

    Raises:
        The first failed transfer's exception.
    """
    error = None
    for ticket in tickets:
        try:
            queue.wait_host(ticket)
        except Exception as e:   # (the others are still waited for: none may run on)
            error = error or e
    if error is not None:
        raise error
