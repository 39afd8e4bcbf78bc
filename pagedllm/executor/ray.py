"""RayExecutor: one worker per rank as a Ray actor, placed by a placement group.

    engine process (Ray driver)          Ray actors (one per rank, any node of the cluster)
    ───────────────────────────          ─────────────────────────────────────────────────
    ray.put(scheduler_output, ─────────► RayWorkerWrapper.execute_method("execute_model", refs)
            grammar_output)
    ray.get(all refs)          ◄──────── driver rank: ModelRunnerOutput; others: None

`ray.init` joins the cluster named by `RAY_ADDRESS` (e.g. "ray://head:10001" or "auto"); without
it a local Ray instance is started for this engine and stopped at shutdown. The placement group
holds one bundle per rank ({"GPU": 1} on CUDA, {"CPU": 1} on CPU) with the PACK strategy, so the
ranks of a TP group share a node whenever they fit. The torch.distributed rendezvous is rank 0's
node address and a port free there. A dead actor surfaces as `WorkerDiedError`.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.core.sched_output import GrammarOutput, SchedulerOutput
from pagedllm.executor.abstract import DistributedExecutorBase, WorkerDiedError, driver_rank
from pagedllm.platforms import current_platform

logger = logging.getLogger(__name__)


def init_ray(num_cpus: int) -> bool:
    """Join the Ray cluster named by `RAY_ADDRESS`, or start a local Ray instance of `num_cpus`
    CPUs when it is unset; nothing when Ray is initialised already.

    Returns:
        True if this call initialised Ray (the caller then calls `ray.shutdown()` when done).

    Raises:
        ImportError: Ray is not installed (`pip install ray`, or the `ray` extra).
    """
    import ray

    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    init_kwargs: dict[str, Any] = {"address": address, "log_to_driver": True}
    if address is None:
        init_kwargs.update(num_cpus=num_cpus, include_dashboard=False)
    ray.init(**init_kwargs)
    return True


class RayWorkerWrapper:
    """The body of a Ray actor: creates its Worker once told its rank, then runs its methods."""

    def __init__(self) -> None:
        self.worker = None

    def node_address_and_free_port(self) -> tuple[str, int]:
        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_worker(self, config: EngineConfig, rank: int, local_rank: int,
                    local_world_size: int, distributed_init_method: str) -> int:
        from pagedllm.worker.worker import Worker

        current_platform.configure_options()    # this actor's PAGEDLLM_* variables
        self.worker = Worker(config, rank=rank, local_rank=local_rank,
                             local_world_size=local_world_size,
                             distributed_init_method=distributed_init_method)
        return os.getpid()

    def execute_method(self, method: str, reply: bool, *args: Any) -> Any:
        result = getattr(self.worker, method)(*args)
        return result if reply else None


class RayExecutor(DistributedExecutorBase):
    """Start one actor per rank in a placement group and load the model.

    Raises:
        ImportError: Ray is not installed (`pip install ray`).
        WorkerDiedError: an actor failed to start or to load the model.
    """

    def __init__(self, config: EngineConfig) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._remove_placement_group = remove_placement_group
        self.config = config
        self.world_size = config.parallel_config.world_size
        self.driver_rank = driver_rank(config)
        self._closed = False
        self._owns_ray = init_ray(max(self.world_size, os.cpu_count() or 1))
        self.actors: list[Any] = []
        self.placement_group = None
        try:
            self._start(config, placement_group, PlacementGroupSchedulingStrategy)
        except BaseException:
            self.shutdown()
            raise

    def _start(self, config, placement_group, strategy_cls) -> None:
        ray = self._ray
        key = current_platform.ray_resource_key
        bundles = [{key: 1.0} for _ in range(self.world_size)]
        self.placement_group = placement_group(bundles, strategy="PACK")
        ray.get(self.placement_group.ready(), timeout=60)
        actor_cls = ray.remote(RayWorkerWrapper)
        resources = {"num_gpus": 1} if key == "GPU" else {"num_cpus": 1}
        for rank in range(self.world_size):
            strategy = strategy_cls(placement_group=self.placement_group,
                                    placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(scheduling_strategy=strategy,
                                                 **resources).remote())
        addresses = self._get([a.node_address_and_free_port.remote() for a in self.actors],
                              "start-up")
        nodes = [ip for ip, _ in addresses]
        master_ip, master_port = addresses[0]
        init_method = f"tcp://{master_ip}:{master_port}"
        self.worker_pids = self._get([
            actor.init_worker.remote(config, rank, nodes[:rank].count(nodes[rank]),
                                     nodes.count(nodes[rank]), init_method)
            for rank, actor in enumerate(self.actors)], "start-up")
        logger.info("Ray workers: %s", ", ".join(f"rank {r} on {ip}"
                                                 for r, ip in enumerate(nodes)))
        self.collective_rpc("load_model")

    def _get(self, refs: list, method: str) -> list[Any]:
        try:
            return self._ray.get(refs)
        except (self._ray.exceptions.RayActorError, self._ray.exceptions.RayTaskError) as e:
            self.shutdown()
            raise WorkerDiedError(f"a Ray worker failed during {method}: {e}") from e

    def collective_rpc(self, method: str, args: tuple = (),
                       reply_rank: int | None = None) -> list[Any]:
        """Call `Worker.method(*args)` on every rank; results in rank order.

        Raises:
            WorkerDiedError: an actor died or raised, or the executor is shut down.
        """
        if self._closed:
            raise WorkerDiedError("the executor is shut down")
        args = tuple(self._ray.put(a) if isinstance(a, (SchedulerOutput, GrammarOutput)) else a
                     for a in args)
        # Top-level ObjectRef arguments reach the actors as their values (put once, read by all).
        return self._get([actor.execute_method.remote(method,
                                                      reply_rank is None or rank == reply_rank,
                                                      *args)
                          for rank, actor in enumerate(self.actors)], method)

    def shutdown(self) -> None:
        """Kill the actors, free the placement group, stop Ray if this executor started it."""
        if self._closed:
            return
        self._closed = True
        for actor in self.actors:
            self._ray.kill(actor)
        if self.placement_group is not None:
            self._remove_placement_group(self.placement_group)
        if self._owns_ray:
            self._ray.shutdown()
