"""The CPU thread plan (platforms/cpu_topology.py) on fake machine layouts, and its sysfs reader
on a fake sysfs tree and on this machine."""

from __future__ import annotations

import pytest
import torch

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cpu_topology import (CpuInfo, ThreadPlan, allowed_cpus, format_cpu_list,
                                             parse_threads_bind, plan_threads, read_cpu_quota,
                                             read_topology, reserved_cpus,
                                             resolve_reserved_cores)


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
    assert plan_threads({0, 1}, _machine(1, 2, 1)) == ThreadPlan(2)   # this CI machine's shape


def test_processes_of_one_machine_get_disjoint_cores():
    topology = _machine(1, 8, 2)          # cpus 0-7 the cores, 8-15 their siblings
    assert plan_threads(set(topology), topology, 0, 2) == ThreadPlan(4, frozenset(range(4)))
    assert plan_threads(set(topology), topology, 1, 2) == ThreadPlan(4, frozenset(range(4, 8)))
    shares = [plan_threads(set(topology), topology, r, 3).bind for r in range(3)]
    assert [len(s) for s in shares] == [2, 3, 3] and frozenset().union(*shares) == set(range(8))
    # More processes than cores: one core each, shared round robin; "nobind": counted, unbound.
    small = _machine(1, 2, 1)
    assert [plan_threads({0, 1}, small, r, 3) for r in range(3)] == [
        ThreadPlan(1, frozenset({0})), ThreadPlan(1, frozenset({1})), ThreadPlan(1, frozenset({0}))]
    assert plan_threads(set(topology), topology, 1, 2, threads_bind="nobind") == ThreadPlan(4)


def test_two_sockets_bind_one_node_one_cpu_per_core():
    topology = _machine(2, 4, 2)          # cpus 0-3 node 0, 4-7 node 1, 8-15 their siblings
    plan = plan_threads(set(topology), topology)
    assert plan == ThreadPlan(4, frozenset({0, 1, 2, 3}), 0)
    # Ranks of one machine: a node each, the larger node first.
    allowed = set(topology) - {0, 8}      # node 0 has fewer allowed CPUs now
    assert plan_threads(allowed, topology, 0, 2) == ThreadPlan(4, frozenset({4, 5, 6, 7}), 1)
    assert plan_threads(allowed, topology, 1, 2) == ThreadPlan(3, frozenset({1, 2, 3}), 0)
    # More ranks than nodes: disjoint shares of the cores, in node order; NUMA binding off: a
    # single process unbound, ranks still on their own cores.
    assert plan_threads(set(topology), topology, 2, 3) == ThreadPlan(3, frozenset({5, 6, 7}))
    assert plan_threads(set(topology), topology, bind=False) == ThreadPlan(8)
    assert plan_threads(set(topology), topology, 0, 2, bind=False) == ThreadPlan(
        4, frozenset(range(4)))


def test_explicit_binding_in_vllms_format():
    topology = _machine(1, 8, 1)
    plan = plan_threads(set(topology), topology, 1, 2, threads_bind="0-3|4,5")
    assert plan == ThreadPlan(2, frozenset({4, 5})) and "cpu_threads_bind" in plan.reason
    with pytest.raises(ValueError, match=r"gives 2 CPU list\(s\) for 3 process\(es\)"):
        plan_threads(set(topology), topology, 0, 3, threads_bind="0-3|4-7")
    with pytest.raises(ValueError, match=r"CPU\(s\) 8-9 not allowed"):
        plan_threads(set(topology), topology, 0, 1, threads_bind="6-9")
    for bad in ("0-a", "3-1", "0-3|", "all", "0-", "0,,1", " 0", "1 - 2", "+1", "\u0663",
                "-1", "0-1-2", "0-99999999"):
        with pytest.raises(ValueError, match="cpu_threads_bind"):
            parse_threads_bind(bad)
    assert format_cpu_list({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"


def test_cpu_quota_caps_the_thread_count():
    topology = _machine(1, 2, 1)
    plan = plan_threads({0, 1}, topology, cpu_quota=1.0)
    assert plan == ThreadPlan(1) and "quota of 1.00 CPUs" in plan.reason
    assert plan_threads({0, 1}, topology, cpu_quota=1.5) == ThreadPlan(1)   # rounded down
    assert plan_threads({0, 1}, topology, cpu_quota=0.2) == ThreadPlan(1)   # at least one
    assert plan_threads({0, 1}, topology, cpu_quota=4.0) == ThreadPlan(2)   # no cap
    big = _machine(1, 8, 1)               # the quota is shared by the machine's processes
    assert plan_threads(set(big), big, 1, 2, cpu_quota=2.0) == ThreadPlan(1, frozenset(range(4, 8)))
    assert plan_threads({0, 1, 2}, {}, cpu_quota=2.0) == ThreadPlan(2)      # unknown layout


def test_cores_reserved_for_the_front_end():
    topology = _machine(1, 8, 2)
    plan = plan_threads(set(topology), topology, reserved_cores=1)
    assert plan == ThreadPlan(7, frozenset(range(7))) and "reserved" in plan.reason
    assert reserved_cpus(set(topology), topology, 1) == {7, 15}
    assert plan_threads(set(topology), topology, 1, 2, reserved_cores=2) == ThreadPlan(
        3, frozenset({3, 4, 5}))
    assert resolve_reserved_cores(None, set(topology), topology) == 1
    assert resolve_reserved_cores(None, {0, 1}, _machine(1, 2, 1)) == 0
    assert resolve_reserved_cores(3, {0, 1}, _machine(1, 2, 1)) == 3
    with pytest.raises(ValueError, match="leaves no core"):
        plan_threads({0, 1}, _machine(1, 2, 1), reserved_cores=2)


def test_unknown_layout_counts_logical_cpus_and_bad_arguments():
    assert plan_threads({0, 1, 2}, {}) == ThreadPlan(3)
    assert plan_threads({0}, {}, 0, 4) == ThreadPlan(1)
    with pytest.raises(ValueError, match="no CPU"):
        plan_threads(set(), {})
    with pytest.raises(ValueError, match="local_rank"):
        plan_threads({0}, {}, 2, 2)


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_read_cpu_quota_cgroup_v2_and_v1(tmp_path):
    proc = tmp_path / "proc_cgroup"
    _write(proc, "0::/a/b")
    _write(tmp_path / "v2" / "a" / "b" / "cpu.max", "max 100000")
    _write(tmp_path / "v2" / "a" / "cpu.max", "150000 100000")     # the parent's quota binds
    _write(tmp_path / "v2" / "cpu.max", "400000 100000")
    assert read_cpu_quota(tmp_path / "v2", proc) == (1.5, str(tmp_path / "v2" / "a" / "cpu.max"))
    _write(proc, "5:memory:/x\n4:cpu,cpuacct:/x\n0::/")
    _write(tmp_path / "v1" / "cpu,cpuacct" / "x" / "cpu.cfs_quota_us", "50000")
    _write(tmp_path / "v1" / "cpu,cpuacct" / "x" / "cpu.cfs_period_us", "100000")
    _write(tmp_path / "v1" / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1")
    assert read_cpu_quota(tmp_path / "v1", proc)[0] == 0.5
    _write(proc, "4:cpu,cpuacct:/docker/abc")      # a namespace's path absent from the mount
    assert read_cpu_quota(tmp_path / "v1", proc) is None                     # root: -1, none
    assert read_cpu_quota(tmp_path / "v1", tmp_path / "missing") is None


def test_read_topology_from_a_fake_sysfs(tmp_path):
    for node, cpus in ((0, "0-1,4"), (1, "2-3,5"), (2, "")):      # node 2: memory only
        (tmp_path / "node" / f"node{node}").mkdir(parents=True)
        (tmp_path / "node" / f"node{node}" / "cpulist").write_text(cpus + "\n")
    for cpu in range(6):
        d = tmp_path / "cpu" / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "core_id").write_text(f"{cpu % 4}\n")
        (d / "physical_package_id").write_text(f"{int(cpu in (2, 3, 5))}\n")
    topology = read_topology(tmp_path)
    assert topology[4] == CpuInfo(0, (0, 0)) and topology[5] == CpuInfo(1, (1, 1))
    # node 1 holds three physical cores (2, 3, 5), node 0 two (cpu 4 is cpu 0's sibling)
    assert plan_threads(set(range(6)), topology) == ThreadPlan(3, frozenset({2, 3, 5}), 1)
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
