"""Which cores a CPU engine process computes on, and with how many threads.

The kernels are bound by memory bandwidth at decode and by the FMA units at prefill; neither
gains from a second hardware thread on a core (SMT siblings share the core's load/store and FMA
units), and on a machine of several NUMA nodes (sockets, or chiplet partitions) threads that
read another node's memory run at a fraction of local bandwidth. The kernels' threads meet at
barriers about ten times a layer, so a thread that another process keeps off its core stalls
all the others: processes that share a machine should not share cores. The policy
(`plan_threads`, `cpu_threads_bind="auto"`):

- one thread per physical core the process may use (llama.cpp's default count), never more
  than its CPU quota (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us`; rounded down, at least one:
  a thread that the quota throttles stalls every barrier as a descheduled one does);
- a single process on one NUMA node stays unbound;
- on a machine of several nodes, a single process is bound to the node holding most of the
  physical cores it may use (ties: the lowest node), one logical CPU per physical core (vLLM's
  CPU backend binds to one node likewise, its `VLLM_CPU_OMP_THREADS_BIND=auto`);
- the worker processes of one machine (tensor / pipeline parallel ranks, data-parallel
  replicas) take a node each when there are at least as many nodes as processes (process i: the
  i-th node by size), and otherwise disjoint, contiguous sets of physical cores (process i the
  i-th share, as vLLM's CPU backend does); with more processes than cores they share.
- `reserved_cores` (the API server's cores: event loop, tokenization, detokenization) are the
  last physical cores allowed, taken out before the rest are shared.

`cpu_threads_bind` may instead give each process's CPUs explicitly, in vLLM's format
("0-15|16-31": process i takes the i-th list, one thread per CPU listed), or "nobind" (no
binding; the physical cores counted and shared as above). The model's memory is allocated where
it is first touched, on the bound node (Linux's default first-touch policy).
`PAGEDLLM_CPU_THREADS` fixes the count (no binding); `PAGEDLLM_CPU_NUMA_BIND=0` keeps a
process off whole-node binding.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

_SYSFS = Path("/sys/devices/system")
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_PROC_CGROUP = Path("/proc/self/cgroup")


@dataclass(frozen=True)
class CpuInfo:
    """One logical CPU: its NUMA node and its physical core (package id, core id)."""

    node: int
    core: tuple[int, int]


@dataclass(frozen=True)
class ThreadPlan:
    """num_threads intra-op threads; `bind` the logical CPUs to restrict the process to (None:
    leave its affinity alone); `node` the NUMA node bound to (None: not bound); `reason` one
    line on why, for the start-up log (not compared)."""

    num_threads: int
    bind: frozenset[int] | None = None
    node: int | None = None
    reason: str = field(default="", compare=False)


_CPU_RANGE = re.compile(r"([0-9]+)(?:-([0-9]+))?", re.ASCII)
# Highest CPU number a list may name (Linux's NR_CPUS reaches 8192; a typo must not expand to
# millions of CPUs before it is found to be not allowed).
MAX_CPU_NUMBER = 65535


def _parse_cpu_list(text: str) -> set[int]:
    """sysfs's "0-3,8,10-11" -> {0, 1, 2, 3, 8, 10, 11}.

    Raises:
        ValueError: a part that is not a CPU number or an ascending range of them (ASCII
            digits, no blanks), an empty part, or a CPU above MAX_CPU_NUMBER.
    """
    cpus: set[int] = set()
    for part in text.split(","):
        match = _CPU_RANGE.fullmatch(part)
        if match is None:
            raise ValueError(f"bad CPU range {part!r}" if part else "an empty CPU range")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first or last > MAX_CPU_NUMBER:
            raise ValueError(f"bad CPU range {part!r}" + (f" (CPUs go up to {MAX_CPU_NUMBER})"
                                                           if last > MAX_CPU_NUMBER else ""))
        cpus.update(range(first, last + 1))
    return cpus


def format_cpu_list(cpus: set[int] | frozenset[int]) -> str:
    """{0, 1, 2, 3, 8} -> "0-3,8" (the inverse of sysfs's list format)."""
    parts, ordered = [], sorted(cpus)
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def parse_threads_bind(spec: str) -> list[set[int]] | None:
    """`cpu_threads_bind` -> the CPU set of each process, or None for "auto" / "nobind".

    Raises:
        ValueError: a spec that is not "auto", "nobind" or "|"-separated CPU lists, or a list
            that is empty or malformed (the message names the spec).
    """
    if spec in ("auto", "nobind"):
        return None
    try:
        return [_parse_cpu_list(part) for part in spec.split("|")]
    except ValueError as e:
        raise ValueError(f"cpu_threads_bind {spec!r}: {e} (expected \"auto\", \"nobind\" or "
                         "CPU lists such as \"0-15|16-31\", one per process)") from None


def check_threads_bind(spec: str, num_processes: int, processes: str,
                       allowed: set[int] | None) -> list[set[int]] | None:
    """`parse_threads_bind(spec)`, checked: one CPU list for each of `num_processes`
    processes (`processes` names them in the message), and, unless `allowed` is None, only
    CPUs in `allowed`. None for "auto" / "nobind".

    Raises:
        ValueError: a spec that does not parse, another number of lists, or CPUs not allowed
            (each message names the spec).
    """
    lists = parse_threads_bind(spec)
    if lists is None:
        return None
    if len(lists) != num_processes:
        raise ValueError(f"cpu_threads_bind {spec!r} gives {len(lists)} CPU list(s) for "
                         f"{processes}")
    missing = set().union(*lists) - allowed if allowed is not None else set()
    if missing:
        raise ValueError(f"cpu_threads_bind {spec!r}: CPU(s) {format_cpu_list(missing)} not "
                         f"allowed to this process (allowed: {format_cpu_list(allowed)})")
    return lists


def read_topology(sysfs: Path = _SYSFS) -> dict[int, CpuInfo]:
    """Every logical CPU sysfs describes -> its CpuInfo; {} where sysfs cannot be read (other
    operating systems, restricted containers): callers then fall back to counting CPUs."""
    try:
        node_of: dict[int, int] = {}
        for node_dir in (sysfs / "node").glob("node[0-9]*"):
            cpulist = (node_dir / "cpulist").read_text().strip()
            for cpu in _parse_cpu_list(cpulist) if cpulist else ():   # (memory-only nodes)
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


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _ancestors(root: Path, cgroup_path: str) -> list[Path]:
    """The cgroup's directory under `root` and each parent up to `root` (a quota anywhere on the
    way limits the process); where the path is not under this mount (a cgroup namespace shows
    "/"), just `root`."""
    here = root / cgroup_path.lstrip("/")
    if not here.is_dir():
        return [root]
    dirs = [here]
    while dirs[-1] != root:
        dirs.append(dirs[-1].parent)
    return dirs


def read_cpu_quota(cgroup_root: Path = _CGROUP_ROOT,
                   proc_cgroup: Path = _PROC_CGROUP) -> tuple[float, str] | None:
    """The CPU quota of this process's cgroup, as (CPUs, the file that set it), the smallest
    over the cgroup and its ancestors; None where none is set or cgroups cannot be read.

    cgroup v2: `cpu.max` holds "QUOTA PERIOD" (µs) or "max PERIOD"; v1: `cpu.cfs_quota_us`
    (-1: none) over `cpu.cfs_period_us`, in the hierarchy holding the `cpu` controller
    (mounted at `cpu`, `cpu,cpuacct` or `cpuacct,cpu`). A quota of 150000 per 100000 µs is
    1.5 CPUs.
    """
    text = _read(proc_cgroup)
    if text is None:
        return None
    best: tuple[float, str] | None = None

    def consider(cpus: float, source: Path) -> None:
        nonlocal best
        if cpus > 0 and (best is None or cpus < best[0]):
            best = (cpus, str(source))

    for line in text.splitlines():
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "":     # cgroup v2 (unified): "0::/path"
            for d in _ancestors(cgroup_root, path):
                fields = (_read(d / "cpu.max") or "").split()
                if len(fields) == 2 and fields[0] != "max":
                    try:
                        consider(int(fields[0]) / int(fields[1]), d / "cpu.max")
                    except (ValueError, ZeroDivisionError):
                        pass
        elif "cpu" in controllers.split(","):
            for mount in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
                root = cgroup_root / mount
                if not root.is_dir():
                    continue
                for d in _ancestors(root, path):
                    try:
                        quota = int(_read(d / "cpu.cfs_quota_us") or "-1")
                        period = int(_read(d / "cpu.cfs_period_us") or "0")
                    except ValueError:
                        continue
                    if quota > 0 and period > 0:
                        consider(quota / period, d / "cpu.cfs_quota_us")
                break
    return best


def _physical_cores(allowed: set[int], topology: dict[int, CpuInfo]) -> list[int]:
    """The first allowed logical CPU of each physical core, in (node, CPU number) order."""
    first_of_core: dict[tuple[int, int], int] = {}
    for cpu in sorted(allowed, key=lambda c: (topology[c].node, c)):
        first_of_core.setdefault(topology[cpu].core, cpu)
    return sorted(first_of_core.values(), key=lambda c: (topology[c].node, c))


def plan_threads(allowed: set[int], topology: dict[int, CpuInfo], local_rank: int = 0,
                 local_world_size: int = 1, bind: bool = True, threads_bind: str = "auto",
                 cpu_quota: float | None = None, reserved_cores: int = 0) -> ThreadPlan:
    """The threads (and binding) of process `local_rank` of `local_world_size` on one machine,
    which may run on the logical CPUs `allowed` under a CPU quota of `cpu_quota` CPUs (None:
    none) shared by those processes (see the module docstring for the policy). `bind` False
    keeps whole-node binding off; `threads_bind` is "auto", "nobind" or explicit CPU lists;
    `reserved_cores` physical cores are left to the front end.

    Raises:
        ValueError: `allowed` is empty; local_rank is not in [0, local_world_size); an explicit
            `threads_bind` with another number of lists than processes, or naming CPUs the
            process may not use; `reserved_cores` leaving no core for the kernels.
    """
    if not allowed:
        raise ValueError("plan_threads: no CPU allowed")
    if not 0 <= local_rank < local_world_size:
        raise ValueError(f"plan_threads: local_rank {local_rank} not in [0, {local_world_size})")
    if reserved_cores < 0:
        raise ValueError(f"cpu_reserved_cores must be >= 0, got {reserved_cores}")

    def capped(threads: int, why: str) -> tuple[int, str]:
        if cpu_quota is None:
            return threads, why
        share = cpu_quota / local_world_size
        quota_threads = max(1, math.floor(share + 1e-9))
        if quota_threads >= threads:
            return threads, why
        shared = f", {share:.2f} per process" if local_world_size > 1 else ""
        rounding = "rounded down" if share >= 1 else "at least one thread"
        return quota_threads, (f"the cgroup CPU quota of {cpu_quota:.2f} CPUs{shared} "
                               f"({rounding}) instead of {why}")

    lists = check_threads_bind(threads_bind, local_world_size,
                               f"{local_world_size} process(es) on this machine", allowed)
    if lists is not None:
        cpus = lists[local_rank]
        n, why = capped(len(cpus), f"one per CPU of cpu_threads_bind {format_cpu_list(cpus)}")
        return ThreadPlan(n, frozenset(cpus), None, why)
    who = (f"process {local_rank} of {local_world_size} on this machine"
           if local_world_size > 1 else "this process")
    if any(cpu not in topology for cpu in allowed):   # unknown layout: count logical CPUs
        n, why = capped(max(1, (len(allowed) - reserved_cores) // local_world_size),
                        f"the logical CPUs {who} may use (CPU layout unknown)")
        return ThreadPlan(n, None, None, why)
    cores = _physical_cores(allowed, topology)
    if reserved_cores:
        if reserved_cores >= len(cores):
            raise ValueError(f"cpu_reserved_cores {reserved_cores} leaves no core for the "
                             f"kernels ({len(cores)} physical cores allowed)")
        cores = cores[:len(cores) - reserved_cores]
    by_node: dict[int, list[int]] = {}
    for cpu in cores:
        by_node.setdefault(topology[cpu].node, []).append(cpu)
    nodes = sorted(by_node, key=lambda n: (-len(by_node[n]), n))   # largest first
    if threads_bind == "auto" and bind and len(nodes) > 1 and local_world_size <= len(nodes):
        node = nodes[local_rank]
        cpus = frozenset(by_node[node])
        n, why = capped(len(cpus), f"one per physical core of NUMA node {node} ({who})")
        return ThreadPlan(n, cpus, node, why)
    if threads_bind == "auto" and (local_world_size > 1 or reserved_cores):
        if local_world_size <= len(cores):
            lo = local_rank * len(cores) // local_world_size
            hi = (local_rank + 1) * len(cores) // local_world_size
            share = cores[lo:hi]
            what = f"its own share of the {len(cores)} physical core(s)"
        else:
            share = [cores[local_rank % len(cores)]]
            what = f"a core shared: more processes than the {len(cores)} physical core(s)"
        if reserved_cores:
            what += f", {reserved_cores} reserved for the front end"
        n, why = capped(len(share), f"one per physical core of {who}: {what}")
        return ThreadPlan(n, frozenset(share), None, why)
    n, why = capped(max(1, len(cores) // local_world_size),
                    f"one per physical core {who} may use ({len(cores)}"
                    + (f" shared by {local_world_size} processes, unbound)"
                       if local_world_size > 1 else ")"))
    return ThreadPlan(n, None, None, why)


# `cpu_reserved_cores=None` (the server's default) reserves one core for the front end from this
# many physical cores up; below, every core computes (a front end's share of a small machine is
# worth less than a kernel thread).
AUTO_RESERVE_MIN_CORES = 8


def resolve_reserved_cores(reserved_cores: int | None, allowed: set[int],
                           topology: dict[int, CpuInfo]) -> int:
    """`reserved_cores`, or for None one core where at least AUTO_RESERVE_MIN_CORES physical
    cores are allowed (logical CPUs where the layout is unknown), else 0."""
    if reserved_cores is not None:
        return reserved_cores
    known = all(cpu in topology for cpu in allowed)
    cores = len(_physical_cores(allowed, topology)) if known else len(allowed)
    return 1 if cores >= AUTO_RESERVE_MIN_CORES else 0


def reserved_cpus(allowed: set[int], topology: dict[int, CpuInfo],
                  reserved_cores: int) -> frozenset[int]:
    """The logical CPUs of the `reserved_cores` physical cores `plan_threads` leaves to the
    front end (every SMT sibling of them): the last physical cores allowed. Empty when none are
    reserved or the layout is unknown."""
    if reserved_cores <= 0 or any(cpu not in topology for cpu in allowed):
        return frozenset()
    kept = {topology[c].core for c in _physical_cores(allowed, topology)[-reserved_cores:]}
    return frozenset(c for c in allowed if topology[c].core in kept)


def allowed_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def bind_process(cpus: frozenset[int]) -> None:
    """Restrict every thread of this process (Linux: each task of /proc/self/task, so thread
    pools started before are moved too; elsewhere the calling thread) to `cpus`; threads
    started later inherit it."""
    os.sched_setaffinity(0, cpus)
    try:
        tasks = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tasks:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:          # a thread that ended meanwhile
            pass
