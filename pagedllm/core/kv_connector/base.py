"""The scheduler side of a KV connector (vLLM's `KVConnectorBase_V1`, role SCHEDULER).

A KV connector moves KV blocks between the device cache and somewhere else (a host-memory or
disk tier, another engine). Its scheduler side decides, in plain Python and without torch, what
moves; what it decides for a step travels to the workers in `SchedulerOutput.kv_connector_metadata`
and their side (`pagedllm/worker/kv_connector/`) moves the bytes at fixed seams of the step:

    Scheduler.schedule()
      new request:  get_computed_blocks (device prefix hits)
                    -> get_num_new_matched_tokens(request, num_computed)   tokens it can supply
                    -> allocate_slots(...)                                 blocks for all of them
                    -> update_state_after_alloc(request, block_ids, num_external_tokens)
      end of step:  build_connector_meta(scheduler_output) -> SchedulerOutput.kv_connector_metadata
    Scheduler._free_request(request) -> request_finished(request, block_ids)

Tokens a connector supplies count as computed (and as cached tokens in the usage), exactly as
device prefix hits do; the worker loads them before the forward that first reads them.
"""

from __future__ import annotations

from typing import Protocol

from pagedllm.core.request import Request
from pagedllm.core.sched_output import KVConnectorStats, KVTransferError, SchedulerOutput

__all__ = ["KVConnectorScheduler", "KVConnectorStats", "KVTransferError"]


class KVConnectorScheduler(Protocol):
    """The scheduler side of a connector (one instance, in the engine core)."""

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> int | None:
        """Tokens after the first `num_computed_tokens` (device prefix hits, a whole number of
        blocks) this connector can supply; never past `request.num_tokens - 1` (the last
        token's logits must be computed). None: not known yet (an asynchronous lookup or
        transfer runs; the request waits without blocking the others and is asked again).

        Raises:
            KVTransferError: the request cannot get its KV (it fails alone).
        """

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        """The request was admitted holding `block_ids` (its whole block list, KV cache group
        0) with `num_external_tokens` of them (after its device hits) to be loaded by the
        connector before this step's forward."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> object:
        """What the workers do this step (plain, picklable data); resets the step's state."""

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict | None]:
        """The request finished (vLLM's signature): whether its blocks must stay allocated
        until the workers report its transfer done (asynchronous saves; no connector here asks
        it, the scheduler frees them at once), and the `kv_transfer_params` its final output
        carries (None: none)."""

    def discard_blocks(self, block_hashes: list[bytes]) -> None:
        """The workers failed to load these blocks (`ModelRunnerOutput.invalid_block_ids`):
        never offer them again."""

    def update_worker_infos(self, worker_infos: list[dict]) -> None:
        """The ranks' `KVConnectorWorker.info()` after a weight update (a disk tier's file
        layouts carry the new checkpoint's fingerprint)."""

    def reset_cache(self) -> None:
        """Forget every stored block (the prefix cache was reset: after a weight update no
        stored KV is valid)."""

    def stats(self) -> KVConnectorStats:
        """Counts since start."""

    def shutdown(self) -> None:
        """Release sockets and threads (the engine shuts down)."""
