"""Data-parallel engine cores as Ray actors (`--data-parallel-backend ray`, vLLM's name).

    front end (this process, the Ray driver)           Ray cluster, any node
    ───────────────────────────────────────            ─────────────────────────────────────
    MPEngineCoreClient, replica i                       RayEngineCoreActor (bundle i of the
      binds PUSH/PULL tcp://<bind_host>:<free port> ◄──   placement group): serve_engine_core,
      CURVE server, accepts only core i's key pair        its own executor (uni / mp for TP)
      watches the actor's `run` call (RayCoreHandle)

`RayReplicaPlacement` joins the cluster (`RAY_ADDRESS`, as the Ray executor does), reserves one
bundle per replica with the SPREAD strategy (one node per replica while there are nodes enough)
and hands out one `RayCoreLauncher` per replica; each launcher is the `multiprocess_mode` of that
replica's engine (engine/core_client.py). The transport is the same ZeroMQ/msgspec one as for a
local core process, over TCP bound to `bind_host` only; Ray itself carries only the engine
config and the socket endpoints with the core's CURVE key pair to the actor (Ray's own channel,
which Ray requires to be a trusted network). A replica whose actor dies (killed, its node lost)
ends its `run` call: the client sees that as the core's death, fails the replica's requests and
the server exits 1, as for a local core process. Ray ends the actors when their owner (this
front end) dies, so no replica outlives its server.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.core_proc import CoreEndpoints, serve_engine_core
from pagedllm.executor.ray import init_ray
from pagedllm.platforms import current_platform

logger = logging.getLogger(__name__)

# Seconds the cluster gets to reserve the replicas' resources.
_PLACEMENT_TIMEOUT_S = 120.0


class RayEngineCoreActor:
    """The body of one replica's Ray actor."""

    def where(self) -> tuple[str, str, int]:
        """(node id, node address, pid) of this actor."""
        import ray

        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
                os.getpid())

    def run(self, config: EngineConfig, endpoints: CoreEndpoints) -> int:
        """Serve the engine core until Shutdown (0) or failure (1); see core_proc.py."""
        return serve_engine_core(config, endpoints, parent_pid=None)


class RayCoreHandle:
    """A replica's actor as `core_client.CoreHandle`: `sentinel` becomes readable when its `run`
    call ends (returned, or the actor died); the actor is then killed to free its resources.

    Args:
        actor: the actor handle; run_ref: the ObjectRef of its `run` call; pid: its process.
    """

    def __init__(self, actor: Any, run_ref: Any, pid: int) -> None:
        import ray

        self._ray = ray
        self._actor = actor
        self.pid = pid
        self.exitcode: int | None = None
        self._done = threading.Event()
        read, self._write = os.pipe()
        self.sentinel = read
        weakref.finalize(self, _close_fds, read, self._write)
        threading.Thread(target=self._watch, args=(run_ref,), name="pagedllm-ray-core-watch",
                         daemon=True).start()

    def _watch(self, run_ref: Any) -> None:
        try:
            self.exitcode = self._ray.get(run_ref)
        except Exception as e:  # noqa: BLE001 - the actor died: its run call cannot return
            logger.error("the engine-core actor (pid %d) died: %s", self.pid,
                         str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.exitcode = -9
        self.kill()
        self._done.set()
        os.write(self._write, b"\0")

    def is_alive(self) -> bool:
        return not self._done.is_set()

    def join(self, timeout: float | None = None) -> None:
        self._done.wait(timeout)

    def terminate(self) -> None:
        self.kill()

    def kill(self) -> None:
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception:  # noqa: BLE001 - gone already, or Ray is shut down
            pass


def _close_fds(*fds: int) -> None:
    for fd in fds:
        os.close(fd)


class RayCoreLauncher:
    """Starts replica `index`'s engine core in bundle `index` of `placement` (see
    `core_client.CoreLauncher`)."""

    fixed_endpoints = None
    shared = False

    def __init__(self, placement: RayReplicaPlacement, index: int) -> None:
        self.placement = placement
        self.index = index
        self.bind_host = placement.bind_host

    def launch(self, config: EngineConfig, endpoints: CoreEndpoints,
               parent_pid: int) -> RayCoreHandle:
        """Raises:
            RuntimeError: the actor did not start within the placement timeout.
        """
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        world_size = config.parallel_config.world_size
        resources = ({"num_gpus": world_size, "num_cpus": 0}
                     if current_platform.ray_resource_key == "GPU" else {"num_cpus": 1})
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=self.placement.placement_group,
            placement_group_bundle_index=self.index)
        actor = ray.remote(RayEngineCoreActor).options(
            scheduling_strategy=strategy, max_restarts=0, **resources).remote()
        try:
            node_id, address, pid = ray.get(actor.where.remote(), timeout=_PLACEMENT_TIMEOUT_S)
        except Exception as e:
            ray.kill(actor, no_restart=True)
            raise RuntimeError(f"the engine-core actor of data-parallel replica {self.index} "
                               f"did not start: {e}") from e
        logger.info("data-parallel replica %d: engine core in a Ray actor on node %s (%s), "
                    "pid %d", self.index, node_id[:12], address, pid)
        self.node_id = node_id
        return RayCoreHandle(actor, actor.run.remote(config, endpoints), pid)


class RayReplicaPlacement:
    """One Ray placement-group bundle per data-parallel replica (SPREAD over the nodes).

    Args:
        num_replicas: data-parallel size.
        world_size: ranks per replica (tensor x pipeline parallel): GPUs per bundle on CUDA;
            a CPU replica's bundle is one CPU (its kernels' threads are its node's business).
        bind_host: the address of this machine the front end binds the replicas' sockets on
            (default: the address Ray uses for this driver's node).

    Raises:
        ImportError: Ray is not installed.
        RuntimeError: the cluster cannot hold the bundles within the timeout.
    """

    def __init__(self, num_replicas: int, world_size: int,
                 bind_host: str | None = None) -> None:
        import ray
        from ray.util.placement_group import placement_group

        self._ray = ray
        self._owns_ray = init_ray(max(num_replicas, os.cpu_count() or 1))
        key = current_platform.ray_resource_key
        bundles = [{key: float(world_size if key == "GPU" else 1)}
                   for _ in range(num_replicas)]
        self.placement_group = placement_group(bundles, strategy="SPREAD")
        try:
            ray.get(self.placement_group.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except Exception as e:
            self.shutdown()
            raise RuntimeError(f"the Ray cluster cannot place {num_replicas} data-parallel "
                               f"replicas of {bundles[0]} each within "
                               f"{_PLACEMENT_TIMEOUT_S:.0f} s (resources: "
                               f"{ray.cluster_resources()})") from e
        self.bind_host = bind_host or _driver_node_address(ray)
        self._closed = False

    def launcher(self, index: int) -> RayCoreLauncher:
        return RayCoreLauncher(self, index)

    def shutdown(self) -> None:
        """Free the placement group; leave Ray if this object joined it (idempotent)."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.placement_group)
        except Exception:  # noqa: BLE001 - Ray is gone already
            pass
        if self._owns_ray:
            self._ray.shutdown()


def _driver_node_address(ray: Any) -> str:
    """The address Ray registered for the node this driver runs on."""
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id and node.get("NodeManagerAddress"):
            return node["NodeManagerAddress"]
    return ray.util.get_node_ip_address()
