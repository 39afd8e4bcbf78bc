"""Which cores a CPU engine process computes on, and with how many threads.

The kernels are bound by memory bandwidth at decode and by the FMA units at prefill; neither
gains from a second hardware thread on a core (SMT siblings share the core's load/store and FMA
units), and on a machine of several NUMA nodes (sockets, or chiplet partitions) threads that
read another node's memory run at a fraction of local bandwidth. So by default a process takes
one thread per physical core (llama.cpp's default count), and on a multi-node machine:

- a single process is bound to the node holding most of the CPUs it may use (ties: the lowest
  node), one logical CPU per physical core (vLLM's CPU backend binds to one node likewise, see
  its `VLLM_CPU_OMP_THREADS_BIND=auto`);
- the worker processes of one machine (tensor / pipeline parallel ranks) each take their own
  node when there are at least as many nodes as ranks (rank i: the i-th node by size); with more
  ranks than nodes they share every core evenly, unbound.

The model's memory is then allocated where it is first touched, on the bound node (Linux's
default first-touch policy). `PAGEDLLM_CPU_THREADS` fixes the count (no binding);
`PAGEDLLM_CPU_NUMA_BIND=0` keeps the process unbound (the thread count stays one per core).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

_SYSFS = Path("/sys/devices/system")


@dataclass(frozen=True)
class CpuInfo:
    """One logical CPU: its NUMA node and its physical core (package id, core id)."""

    node: int
    core: tuple[int, int]


@dataclass(frozen=True)
class ThreadPlan:
    """num_threads intra-op threads; `bind` the logical CPUs to restrict the process to (None:
    leave its affinity alone); `node` the NUMA node bound to (None: not bound)."""

    num_threads: int
    bind: frozenset[int] | None = None
    node: int | None = None


def _parse_cpu_list(text: str) -> set[int]:
    """sysfs's "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def read_topology(sysfs: Path = _SYSFS) -> dict[int, CpuInfo]:
    """Every logical CPU sysfs describes -> its CpuInfo; {} where sysfs cannot be read (other
    operating systems, restricted containers): callers then fall back to counting CPUs."""
    try:
        node_of: dict[int, int] = {}
        for node_dir in (sysfs / "node").glob("node[0-9]*"):
            for cpu in _parse_cpu_list((node_dir / "cpulist").read_text()):
                node_of[cpu] = int(node_dir.name[4:])
        topology = {}
        for cpu_dir in (sysfs / "cpu").glob("cpu[0-9]*"):
            cpu = int(cpu_dir.name[3:])
            core_id = int((cpu_dir / "topology" / "core_id").read_text())
            package = int((cpu_dir / "topology" / "physical_package_id").read_text())
            topology[cpu] = CpuInfo(node_of.get(cpu, 0), (package, core_id))
        return topology
    except (OSError, ValueError):
        return {}


def plan_threads(allowed: set[int], topology: dict[int, CpuInfo], local_rank: int = 0,
                 local_world_size: int = 1, bind: bool = True) -> ThreadPlan:
    """The threads (and binding) of process `local_rank` of `local_world_size` on one machine,
    which may run on the logical CPUs `allowed` (see the module docstring for the policy).

    Raises:
        ValueError: `allowed` is empty or local_rank is not in [0, local_world_size).
    """
    if not allowed:
        raise ValueError("plan_threads: no CPU allowed")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"plan_threads: local_rank {local_rank} not in [0, {local_world_size})")
    if any(cpu not in topology for cpu in allowed):   # unknown layout: count logical CPUs
        return ThreadPlan(max(1, len(allowed) // local_world_size))
    by_node: dict[int, list[int]] = {}
    for cpu in sorted(allowed):
        by_node.setdefault(topology[cpu].node, []).append(cpu)
    nodes = sorted(by_node, key=lambda n: (-len(by_node[n]), n))   # largest first
    if bind and len(nodes) > 1 and local_world_size <= len(nodes):
        node = nodes[local_rank]
        first_of_core: dict[tuple[int, int], int] = {}
        for cpu in by_node[node]:
            first_of_core.setdefault(topology[cpu].core, cpu)
        cpus = frozenset(first_of_core.values())
        return ThreadPlan(len(cpus), cpus, node)
    cores = {topology[cpu].core for cpu in allowed}
    return ThreadPlan(max(1, len(cores) // local_world_size))


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))
