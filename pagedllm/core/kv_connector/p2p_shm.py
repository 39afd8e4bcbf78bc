"""The P2pShmConnector's scheduler side: prefill/decode disaggregation between two engines on
one machine (docs/kv_connectors.md), matched per request through `kv_transfer_params` as vLLM's
toy proxy does:

    proxy -> prefill (kv_producer):  max_tokens=1, kv_transfer_params {"do_remote_decode": true}
        its workers write the prompt's blocks to shared memory when the prompt is computed;
        on finishing, the request is offered to the TransferServer and its output carries
        kv_transfer_params {"do_remote_prefill": true, "remote_engine_id", "remote_host",
        "remote_port", "remote_request_id"}
    proxy -> decode (kv_consumer):   the request with those kv_transfer_params
        get_num_new_matched_tokens pulls (asynchronously: the request waits, others run) and
        then reports the prompt's tokens but the last as external; the workers load them
        before the first forward, which computes the last prompt token and samples.

A failed pull (the prefill peer dead, a timeout, another model's layout) fails that request
alone (`KVTransferError`). The transport is p2p_transport.py.
"""

from __future__ import annotations

import os
import secrets
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from pagedllm.core.kv_connector.base import KVConnectorStats, KVTransferError
from pagedllm.core.kv_connector.factory import P2P_SHM_DEFAULTS
from pagedllm.core.kv_connector.p2p_transport import (PullReply, TransferClient, TransferServer,
                                                      check_engine_id, check_transfer_file,
                                                      transfer_file, transfer_key)
from pagedllm.core.kv_connector.shm_owner import ShmOwnership, sweep_stale_files
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import SchedulerOutput




@dataclass
class ExportSpec:
    """Producer: write device blocks `block_ids` (a prompt's, in order) to the file `key`."""

    key: str
    block_ids: list[int]


@dataclass
class LoadSpec:
    """Consumer: fill device blocks `block_ids` from blocks `first_block`, `first_block + 1`,
    ... of the file `key` of owner `engine_id` (the consumer itself, once the pull handed the
    file over: shm_owner.py), then delete the file."""

    engine_id: str
    key: str
    first_block: int
    block_ids: list[int]


@dataclass
class P2pShmMetadata:
    """One step's transfers (plain data; crosses to the workers)."""

    exports: list[ExportSpec] = field(default_factory=list)
    loads: list[LoadSpec] = field(default_factory=list)


def engine_id_of(config) -> str:
    """The producer's engine id (`KVTransferConfig.engine_id`, else one from its port: two
    producers on one machine have different ports)."""
    return config.engine_id or f"pagedllm{config.kv_port}"


def shm_dir_of(config) -> Path:
    return Path(config.kv_connector_extra_config.get("shm_dir", P2P_SHM_DEFAULTS["shm_dir"]))


def check_remote_prefill_params(params: dict, host: str, port: int,
                                prompt_logprobs: int | None) -> str:
    """Check a decode request's `kv_transfer_params` ({"do_remote_prefill": true, ...}) against
    this consumer's one prefill peer `host`:`port` (kv_ip, kv_port) before any transfer; the
    front end runs it too, so a client's bad params are a 400, not a failed request.

    Returns:
        the remote engine id (a safe file-name part).

    Raises:
        ValueError: naming the field: a missing or other peer, a missing remote_request_id, an
            unsafe remote_engine_id, or prompt_logprobs (they need every prompt position here).
    """
    missing = [k for k in ("remote_host", "remote_port", "remote_engine_id", "remote_request_id")
               if params.get(k) in (None, "")]
    if missing:
        raise ValueError(f"kv_transfer_params: do_remote_prefill needs {', '.join(missing)} "
                         "(the prefill instance's answer, as `pagedllm proxy` forwards it)")
    if (params["remote_host"], params["remote_port"]) != (host, port):
        raise ValueError(f"kv_transfer_params name the prefill peer {params['remote_host']}:"
                         f"{params['remote_port']}; this instance accepts only {host}:{port} "
                         "(kv_ip, kv_port)")
    if not isinstance(params["remote_request_id"], str):
        raise ValueError("kv_transfer_params: remote_request_id must be a string")
    if prompt_logprobs is not None:
        raise ValueError("prompt_logprobs need every prompt position computed here; they "
                         "cannot be combined with a remote prefill (kv_transfer_params)")
    return check_engine_id(params["remote_engine_id"], "kv_transfer_params: remote_engine_id")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Export:
    request: Request
    block_ids: list[int]
    exported: bool = False


class P2pShmProducerScheduler:
    """kv_producer: export each `do_remote_decode` request's prompt blocks and offer them.

    Args:
        config: the `KVTransferConfig`.
        block_size: tokens per block.
        layouts: each rank's layout string (`KVConnectorWorker.info()["layout"]`).
    """

    def __init__(self, config, block_size: int, layouts: list[str]) -> None:
        extra = {**P2P_SHM_DEFAULTS, **config.kv_connector_extra_config}
        self.block_size = block_size
        self.layouts = layouts
        self.engine_id = engine_id_of(config)
        self.host, self.port = config.kv_ip, config.kv_port
        self.shm_dir = shm_dir_of(config)
        # Holds the engine id in shm_dir and removes dead producers' files (shm_owner.py).
        self.ownership = ShmOwnership(self.shm_dir, self.engine_id,
                                      float(extra["transfer_ttl"]))
        try:
            self.server = TransferServer(config.kv_ip, config.kv_port, extra["kv_peer_ip"],
                                         float(extra["transfer_ttl"]))
        except BaseException:
            self.ownership.release()
            raise
        self._requests: dict[str, _Export] = {}
        self._stats = KVConnectorStats()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        return 0

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        params = request.kv_transfer_params
        if params and params.get("do_remote_decode"):
            self._requests[request.request_id] = _Export(request, list(block_ids))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pShmMetadata:
        self.ownership.maybe_sweep()   # (files of consumers that died holding them)
        meta = P2pShmMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(new.req_id)
            if state is not None:
                state.block_ids = list(new.block_ids[0])
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids in zip(cached.req_ids, cached.new_block_ids):
            state = self._requests.get(req_id)
            if state is not None:
                state.block_ids.extend(new_block_ids[0])
        for req_id in scheduler_output.num_scheduled_tokens:
            state = self._requests.get(req_id)
            # (num_computed_tokens already counts this step's tokens)
            if state is None or state.exported \
                    or state.request.num_computed_tokens < state.request.num_prompt_tokens:
                continue
            n = _cdiv(state.request.num_prompt_tokens, self.block_size)
            meta.exports.append(ExportSpec(transfer_key(req_id), state.block_ids[:n]))
            state.exported = True
            self._stats.stored_blocks += n
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict | None]:
        state = self._requests.pop(request.request_id, None)
        if state is None or not state.exported:
            return False, None
        key = transfer_key(request.request_id)
        files = [transfer_file(self.shm_dir, self.engine_id, key, rank)
                 for rank in range(len(self.layouts))]
        if request.status not in (RequestStatus.FINISHED_STOPPED,
                                  RequestStatus.FINISHED_LENGTH_CAPPED):
            self.server.withdraw(files)   # (aborted or failed: nobody will pull it)
            return False, None
        self.server.offer(key, PullReply(True, num_tokens=request.num_prompt_tokens,
                                         block_size=self.block_size,
                                         layouts=list(self.layouts)), files)
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": self.engine_id, "remote_host": self.host,
                       "remote_port": self.port, "remote_request_id": request.request_id}

    def update_worker_infos(self, worker_infos: list[dict]) -> None:
        self.layouts = [info["layout"] for info in worker_infos]

    def reset_cache(self) -> None:
        """Nothing is cached: exports are per request."""

    def discard_blocks(self, block_hashes: list[bytes]) -> None:
        """Nothing is cached."""

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(**vars(self._stats))

    def shutdown(self) -> None:
        self.server.close()
        self.ownership.release()


@dataclass
class _Pull:
    engine_id: str   # the producer's
    key: str
    future: Future
    consumed: bool = False    # its blocks were loaded (or found in the device cache)


class P2pShmConsumerScheduler:
    """kv_consumer: pull each `do_remote_prefill` request's prompt KV from the configured peer.

    Args: as `P2pShmProducerScheduler`'s.
    """

    def __init__(self, config, block_size: int, layouts: list[str]) -> None:
        extra = {**P2P_SHM_DEFAULTS, **config.kv_connector_extra_config}
        self.block_size = block_size
        self.layouts = layouts
        self.host, self.port = config.kv_ip, config.kv_port
        self.shm_dir = shm_dir_of(config)
        # A pull hands the files over: they are renamed into this consumer's own name, held
        # like a producer's (shm_owner.py), so they go if it dies before loading them.
        self.owner_id = f"{engine_id_of(config)}-decode{os.getpid()}.{secrets.token_hex(4)}"
        self.ownership = ShmOwnership(self.shm_dir, self.owner_id,
                                      float(extra["transfer_ttl"]))
        try:
            self.client = TransferClient(config.kv_ip, config.kv_port,
                                         config.engine_id or "decode",
                                         float(extra["transfer_timeout"]))
        except BaseException:
            self.ownership.release()
            raise
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kv-transfer-pull")
        self._pulls: dict[str, _Pull] = {}
        self._loads: list[LoadSpec] = []
        self._stats = KVConnectorStats()

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> int | None:
        """The prompt's tokens but the last after `num_computed_tokens` once the pull
        succeeded; None while it runs (the request waits); 0 without remote prefill.

        Raises:
            KVTransferError: bad kv_transfer_params, or the pull failed.
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0
        pull = self._pulls.get(request.request_id)
        if pull is None:
            pull = self._start_pull(request, params)
        if pull.consumed:
            return 0   # (resumed after preemption: recomputed locally)
        if not pull.future.done():
            wait([pull.future], timeout=0.002)   # (a short wait: the engine loop spins)
            if not pull.future.done():
                return None
        reply = pull.future.result()
        if not reply.ok:
            del self._pulls[request.request_id]
            raise KVTransferError(reply.error)
        if reply.num_tokens != request.num_prompt_tokens:
            self._discard(pull)
            raise KVTransferError(f"the prefill instance computed {reply.num_tokens} prompt "
                                  f"tokens, this request has {request.num_prompt_tokens} (a "
                                  "different prompt or tokenizer)")
        return max(request.num_prompt_tokens - 1 - num_computed_tokens, 0)

    def _start_pull(self, request: Request, params: dict) -> _Pull:
        """Check `params` and start pulling.

        Raises:
            KVTransferError: a peer other than the configured one, a bad engine or request id,
                or a request that needs every prompt position computed (prompt_logprobs).
        """
        try:
            engine_id = check_remote_prefill_params(params, self.host, self.port,
                                                    request.sampling_params.prompt_logprobs)
        except ValueError as e:
            raise KVTransferError(str(e)) from None
        key = transfer_key(params["remote_request_id"])
        pull = _Pull(engine_id, key, self._pool.submit(self._pull, engine_id, key))
        self._pulls[request.request_id] = pull
        return pull

    def _pull(self, engine_id: str, key: str) -> PullReply:
        """(On a pool thread.) The producer's reply, checked against this engine's ranks; the
        files are then renamed into this consumer's name (`owner_id`)."""
        try:
            reply = self.client.pull(key)
        except Exception as e:  # noqa: BLE001 - whatever failed, the request fails alone
            return PullReply(False, f"KV transfer from {self.client.address} failed: {e}")
        if not reply.ok:
            return reply
        files = [transfer_file(self.shm_dir, engine_id, key, rank)
                 for rank in range(len(self.layouts))]
        problem = None
        if reply.block_size != self.block_size:
            problem = (f"the prefill instance's block_size is {reply.block_size}, this one's "
                       f"{self.block_size}")
        elif reply.layouts != self.layouts:
            problem = (f"the prefill instance's KV layouts {reply.layouts} differ from this "
                       f"instance's {self.layouts} (another model, dtype or tensor-parallel "
                       "size)")
        else:
            problem = next(filter(None, (check_transfer_file(path, key, layout)
                                         for path, layout in zip(files, self.layouts))), None)
        if problem is not None:
            # (the producer's ranks may outnumber ours: the files are ours to delete now)
            for rank in range(max(len(reply.layouts), len(self.layouts))):
                transfer_file(self.shm_dir, engine_id, key, rank).unlink(missing_ok=True)
            return PullReply(False, problem)
        try:
            for path, owned in zip(files, self._files(key)):
                path.rename(owned)
        except OSError as e:
            for path in files + self._files(key):
                path.unlink(missing_ok=True)
            return PullReply(False, f"KV transfer: taking over the pulled files failed: {e}")
        return reply

    def _files(self, key: str) -> list[Path]:
        """A pulled transfer's files, once this consumer owns them."""
        return [transfer_file(self.shm_dir, self.owner_id, key, rank)
                for rank in range(len(self.layouts))]

    def _discard(self, pull: _Pull) -> None:
        """Delete a pull's files once it completes, if nothing loads them."""
        def discard(future: Future) -> None:
            if future.result().ok:
                for path in self._files(pull.key):
                    path.unlink(missing_ok=True)
        pull.consumed = True
        pull.future.add_done_callback(discard)

    def update_state_after_alloc(self, request: Request, block_ids: list[int],
                                 num_external_tokens: int) -> None:
        pull = self._pulls.get(request.request_id)
        if pull is None or pull.consumed:
            return
        if num_external_tokens == 0:
            self._discard(pull)   # (the device cache held the whole prompt)
            return
        pull.consumed = True
        end = request.num_prompt_tokens - 1
        first = (end - num_external_tokens) // self.block_size
        last = _cdiv(end, self.block_size)
        self._loads.append(LoadSpec(self.owner_id, pull.key, first, block_ids[first:last]))
        self._stats.queries += last - first
        self._stats.hits += last - first

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> P2pShmMetadata:
        self.ownership.maybe_sweep()   # (files of instances that died holding them)
        meta = P2pShmMetadata(loads=self._loads)
        self._loads = []
        self._stats.loaded_blocks += sum(len(load.block_ids) for load in meta.loads)
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict | None]:
        pull = self._pulls.pop(request.request_id, None)
        if pull is not None and not pull.consumed:
            self._discard(pull)
        return False, None

    def update_worker_infos(self, worker_infos: list[dict]) -> None:
        self.layouts = [info["layout"] for info in worker_infos]

    def reset_cache(self) -> None:
        """Nothing is cached: pulls are per request."""

    def discard_blocks(self, block_hashes: list[bytes]) -> None:
        """Nothing is cached."""

    def stats(self) -> KVConnectorStats:
        return KVConnectorStats(**vars(self._stats))

    def shutdown(self) -> None:
        """Stop pulling; delete the pulled files nothing loaded; give up the owner id."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        sweep_stale_files(self.shm_dir, self.owner_id)
        self.ownership.release()
