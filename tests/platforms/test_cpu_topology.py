"""The CPU thread plan (platforms/cpu_topology.py) on fake machine layouts, and its sysfs reader
on a fake sysfs tree and on this machine."""

from __future__ import annotations

import pytest
import torch

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cpu_topology import (CpuInfo, ThreadPlan, allowed_cpus, plan_threads,
                                             read_topology)


def _machine(nodes: int, cores_per_node: int, smt: int) -> dict[int, CpuInfo]:
    """Linux's usual numbering: first thread of every core, then the second threads."""
    topology, cpu = {}, 0
    for thread in range(smt):
        for node in range(nodes):
            for core in range(cores_per_node):
                topology[cpu] = CpuInfo(node, (node, core))
                cpu += 1
    return topology


def test_one_node_takes_one_thread_per_core_unbound():
    topology = _machine(1, 8, 2)
    assert plan_threads(set(topology), topology) == ThreadPlan(8)
    assert plan_threads(set(topology), topology, 1, 2) == ThreadPlan(4)
    assert plan_threads({0, 1}, _machine(1, 2, 1)) == ThreadPlan(2)   # this CI machine's shape


def test_two_sockets_bind_one_node_one_cpu_per_core():
    topology = _machine(2, 4, 2)          # cpus 0-3 node 0, 4-7 node 1, 8-15 their siblings
    plan = plan_threads(set(topology), topology)
    assert plan == ThreadPlan(4, frozenset({0, 1, 2, 3}), 0)
    # Ranks of one machine: a node each, the larger node first.
    allowed = set(topology) - {0, 8}      # node 0 has fewer allowed CPUs now
    assert plan_threads(allowed, topology, 0, 2) == ThreadPlan(4, frozenset({4, 5, 6, 7}), 1)
    assert plan_threads(allowed, topology, 1, 2) == ThreadPlan(3, frozenset({1, 2, 3}), 0)
    # More ranks than nodes: every core shared evenly, unbound; binding switched off likewise.
    assert plan_threads(set(topology), topology, 2, 3) == ThreadPlan(2)
    assert plan_threads(set(topology), topology, bind=False) == ThreadPlan(8)


def test_unknown_layout_counts_logical_cpus_and_bad_arguments():
    assert plan_threads({0, 1, 2}, {}) == ThreadPlan(3)
    assert plan_threads({0}, {}, 0, 4) == ThreadPlan(1)
    with pytest.raises(ValueError, match="no CPU"):
        plan_threads(set(), {})
    with pytest.raises(ValueError, match="local_rank"):
        plan_threads({0}, {}, 2, 2)


def test_read_topology_from_a_fake_sysfs(tmp_path):
    for node, cpus in ((0, "0-1,4"), (1, "2-3,5")):
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for cpu in range(6):
        d = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "core_id").write_text(f"{cpu % 4}\n")
        (d / "physical_package_id").write_text(f"{int(cpu in (2, 3, 5))}\n")
    topology = read_topology(tmp_path)
    assert topology[4] == CpuInfo(0, (0, 0)) and topology[5] == CpuInfo(1, (1, 1))
    assert plan_threads(set(range(6)), topology) == ThreadPlan(2, frozenset({0, 1}), 0)
    assert read_topology(tmp_path / "missing") == {}


def test_this_machine_and_the_numa_switch(monkeypatch):
    topology = read_topology()
    assert allowed_cpus() <= set(topology) or topology == {}
    before = torch.get_num_threads()
    monkeypatch.delenv("PAGEDLLM_CPU_THREADS", raising=False)
    try:
        CpuPlatform().init_device()
        assert torch.get_num_threads() == plan_threads(allowed_cpus(), topology).num_threads
        monkeypatch.setenv("PAGEDLLM_CPU_NUMA_BIND", "maybe")
        with pytest.raises(ValueError, match="PAGEDLLM_CPU_NUMA_BIND"):
            CpuPlatform().init_device()
    finally:
        torch.set_num_threads(before)
