"""Hardware facts: cgroup v1/v2 parsing on fake trees, real affinity under taskset, shm, host facts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from dlpipe.machine import cgroups
from dlpipe.machine.gpu import gpu_summary
from dlpipe.machine.hardware import (
    CpuBudget,
    cpu_budget,
    host_facts,
    memory_available_bytes,
    memory_total_bytes,
    recommended_workers,
    shm_bytes,
    shm_free_bytes,
)

REPO = Path(__file__).resolve().parents[1]


def fake_host(tmp_path: Path, proc_cgroup: str, files: dict[str, str]) -> dict[str, str]:
    """Build <tmp>/proc/self/cgroup and files under <tmp>/cg; return cpu_budget root kwargs."""
    proc, cg = tmp_path / "proc", tmp_path / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(proc_cgroup)
    cg.mkdir()
    for rel, content in files.items():
        path = cg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(content)
    return {"proc_root": str(proc), "cgroup_root": str(cg)}


def budget(roots: dict[str, str], affinity: int = 8, **environ: str) -> CpuBudget:
    return cpu_budget(**roots, environ=environ, affinity=affinity)


# --- cgroup v2 ---------------------------------------------------------------------------------


def test_v2_unlimited(tmp_path):
    roots = fake_host(
        tmp_path, "0::/a/b\n", {"a/cpu.max": "max 100000\n", "a/b/cpu.max": "max 100000\n"}
    )
    b = budget(roots)
    assert (b.cgroup_cpus, b.cgroup_source, b.budget) == (None, None, 8)


def test_v2_leaf_limit(tmp_path):
    roots = fake_host(
        tmp_path, "0::/a/b\n", {"a/cpu.max": "max 100000\n", "a/b/cpu.max": "200000 100000\n"}
    )
    b = budget(roots)
    assert b.cgroup_cpus == 2.0
    assert b.cgroup_source == str(tmp_path / "cg" / "a" / "b" / "cpu.max")
    assert b.budget == 2


def test_v2_tighter_ancestor_wins(tmp_path):
    roots = fake_host(
        tmp_path,
        "0::/a/b/c\n",
        {
            "a/cpu.max": "100000 100000\n",  # 1 CPU two levels up
            "a/b/cpu.max": "400000 100000\n",
            "a/b/c/cpu.max": "300000 100000\n",
        },
    )
    b = budget(roots)
    assert b.cgroup_cpus == 1.0
    assert b.cgroup_source == str(tmp_path / "cg" / "a" / "cpu.max")
    assert b.budget == 1


def test_v2_looser_ancestor_does_not_override_leaf(tmp_path):
    roots = fake_host(
        tmp_path, "0::/a/b\n", {"a/cpu.max": "400000 100000\n", "a/b/cpu.max": "200000 100000\n"}
    )
    assert budget(roots).cgroup_cpus == 2.0


def test_v2_fractional_quota_rounds_up(tmp_path):
    roots = fake_host(tmp_path, "0::/job\n", {"job/cpu.max": "150000 100000\n"})
    b = budget(roots, affinity=64)
    assert b.cgroup_cpus == 1.5
    assert b.budget == 2
    assert b.as_params()["cpu.cgroup_cpus"] == "1.5"


def test_v2_path_missing_under_mount_falls_back_to_root(tmp_path):
    # Typical container: /proc/self/cgroup names the host-side path, the mount is our own cgroup.
    proc_cgroup = "0::/system.slice/docker-abc.scope\n"
    roots = fake_host(tmp_path, proc_cgroup, {"cpu.max": "300000 100000\n"})
    b = budget(roots)
    assert b.cgroup_cpus == 3.0
    assert b.cgroup_source == str(tmp_path / "cg" / "cpu.max")
    assert b.budget == 3


def test_v2_partly_existing_path_is_not_trusted(tmp_path):
    # Only "a" exists under the mount: it is some other cgroup, not an ancestor we can vouch for.
    roots = fake_host(
        tmp_path, "0::/a/gone\n", {"cpu.max": "300000 100000\n", "a/cpu.max": "100000 100000\n"}
    )
    assert budget(roots).cgroup_cpus == 3.0


def test_v2_root_path(tmp_path):
    roots = fake_host(tmp_path, "0::/\n", {"cpu.max": "200000 100000\n"})
    assert budget(roots).budget == 2


@pytest.mark.parametrize(
    "content", ["garbage\n", "200000\n", "abc 100000\n", "200000 0\n", "0 100000\n", "", "\xff\xfe"]
)
def test_v2_malformed_cpu_max_is_no_limit(tmp_path, content):
    roots = fake_host(tmp_path, "0::/a\n", {"a/cpu.max": content})
    b = budget(roots)
    assert (b.cgroup_cpus, b.budget) == (None, 8)


def test_v2_malformed_leaf_does_not_hide_valid_ancestor(tmp_path):
    roots = fake_host(
        tmp_path, "0::/a/b\n", {"a/cpu.max": "300000 100000\n", "a/b/cpu.max": "nonsense here\n"}
    )
    assert budget(roots).cgroup_cpus == 3.0


def test_missing_proc_cgroup_is_no_limit(tmp_path):
    b = cpu_budget(
        proc_root=str(tmp_path / "nope"), cgroup_root=str(tmp_path / "cg"), environ={}, affinity=4
    )
    assert (b.cgroup_cpus, b.budget) == (None, 4)


def test_unreadable_cpu_max_is_no_limit(tmp_path):
    roots = fake_host(tmp_path, "0::/a\n", {})
    (tmp_path / "cg" / "a" / "cpu.max").mkdir(parents=True)  # reading a directory raises OSError
    assert budget(roots).cgroup_cpus is None


# --- cgroup v1 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mount", ["cpu,cpuacct", "cpuacct,cpu", "cpu"])
def test_v1_quota(tmp_path, mount):
    roots = fake_host(
        tmp_path,
        f"4:memory:/job\n3:{mount}:/job\n0::/\n",
        {
            f"{mount}/cpu.cfs_quota_us": "-1\n",
            f"{mount}/cpu.cfs_period_us": "100000\n",
            f"{mount}/job/cpu.cfs_quota_us": "300000\n",
            f"{mount}/job/cpu.cfs_period_us": "100000\n",
        },
    )
    b = budget(roots)
    assert b.cgroup_cpus == 3.0
    assert b.cgroup_source == str(tmp_path / "cg" / mount / "job" / "cpu.cfs_quota_us")
    assert b.budget == 3


def test_v1_unlimited(tmp_path):
    roots = fake_host(
        tmp_path,
        "2:cpu,cpuacct:/job\n",
        {
            "cpu,cpuacct/job/cpu.cfs_quota_us": "-1\n",
            "cpu,cpuacct/job/cpu.cfs_period_us": "100000\n",
        },
    )
    b = budget(roots)
    assert (b.cgroup_cpus, b.budget) == (None, 8)


def test_v1_nested_and_missing_path(tmp_path):
    files = {
        "cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
        "cpu,cpuacct/cpu.cfs_period_us": "100000\n",
        "cpu,cpuacct/a/cpu.cfs_quota_us": "-1\n",
        "cpu,cpuacct/a/cpu.cfs_period_us": "100000\n",
    }
    roots = fake_host(tmp_path, "2:cpu,cpuacct:/a\n", files)
    assert budget(roots).cgroup_cpus == 2.0  # the mount root's quota caps the unlimited leaf
    (tmp_path / "proc" / "self" / "cgroup").write_text("2:cpu,cpuacct:/elsewhere/x\n")
    assert budget(roots).cgroup_cpus == 2.0  # absent path: read from the mount root


def test_hybrid_host_uses_v1_cpu_controller(tmp_path):
    # Like this CI host: v1 controllers mounted separately plus an empty cgroup2 at unified/.
    roots = fake_host(
        tmp_path,
        "2:cpuacct:/\n1:cpu:/\n0::/\n",
        {
            "cpu/cpu.cfs_quota_us": "200000\n",
            "cpu/cpu.cfs_period_us": "100000\n",
            "cpuacct/cpuacct.usage": "0\n",
            "unified/cgroup.procs": "",
        },
    )
    assert budget(roots).cgroup_cpus == 2.0


# --- environment and affinity ------------------------------------------------------------------


def test_slurm_and_local_world_size(tmp_path):
    roots = fake_host(tmp_path, "0::/\n", {})
    b = budget(roots, affinity=16, SLURM_CPUS_PER_TASK="8", LOCAL_WORLD_SIZE="2")
    assert (b.slurm_cpus, b.local_world_size, b.budget) == (8, 2, 4)
    assert budget(roots, affinity=2, LOCAL_WORLD_SIZE="8").budget == 1  # never below 1


def test_a_slurm_task_per_rank_keeps_its_own_cpus(tmp_path):
    """submitit on Slurm, one task per GPU: SLURM_CPUS_PER_TASK is each rank's already."""
    roots = fake_host(tmp_path, "0::/\n", {"cpu.max": "3200000 100000\n"})  # the job's 32 CPUs on this node
    env = dict(SLURM_CPUS_PER_TASK="8", LOCAL_WORLD_SIZE="4", WORLD_SIZE="8", SLURM_STEP_NUM_TASKS="8")
    b = budget(roots, affinity=64, **env)
    assert (b.rank_per_slurm_task, b.budget) == (True, 8)
    assert budget(roots, affinity=8, **{**env, "SLURM_CPUS_PER_TASK": "16"}).budget == 8  # bound to 8 CPUs
    # torchrun with 4 ranks inside one Slurm task of 8 CPUs: they share them
    shared = budget(roots, affinity=64, **{**env, "WORLD_SIZE": "4", "SLURM_STEP_NUM_TASKS": "1"})
    assert (shared.rank_per_slurm_task, shared.budget) == (False, 2)
    unbound = {k: v for k, v in env.items() if k != "SLURM_CPUS_PER_TASK"}  # tasks not bound apart
    assert budget(fake_host(tmp_path / "free", "0::/\n", {}), affinity=64, **unbound).budget == 16


def test_all_limits_take_the_minimum(tmp_path):
    roots = fake_host(tmp_path, "0::/\n", {"cpu.max": "300000 100000\n"})
    assert budget(roots, affinity=16, SLURM_CPUS_PER_TASK="8").budget == 3
    assert budget(roots, affinity=2, SLURM_CPUS_PER_TASK="8").budget == 2
    assert budget(roots, affinity=16, SLURM_CPUS_PER_TASK="1").budget == 1


@pytest.mark.parametrize("bad", ["", "0", "-3", "four", "4(x2)"])
def test_invalid_env_values_are_ignored(tmp_path, bad):
    roots = fake_host(tmp_path, "0::/\n", {})
    b = budget(roots, affinity=6, SLURM_CPUS_PER_TASK=bad, LOCAL_WORLD_SIZE=bad)
    assert (b.slurm_cpus, b.local_world_size, b.budget) == (None, 1, 6)


def test_as_params_is_flat_strings(tmp_path):
    roots = fake_host(tmp_path, "0::/\n", {})
    params = budget(roots, affinity=4).as_params()
    assert params == {
        "cpu.affinity": "4",
        "cpu.cgroup_cpus": "none",
        "cpu.cgroup_source": "none",
        "cpu.slurm_cpus": "none",
        "cpu.local_world_size": "1",
        "cpu.rank_per_slurm_task": "False",
        "cpu.sharing_jobs": "1",
        "cpu.budget": "4",
    }


def test_real_host_budget_is_within_affinity():
    b = cpu_budget()
    assert 1 <= b.budget <= b.affinity == len(os.sched_getaffinity(0))


@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset not installed")
def test_taskset_affinity_is_seen_while_cpu_count_is_not():
    code = (
        "import os; from dlpipe.machine.hardware import cpu_budget; "
        "print(cpu_budget().affinity, os.cpu_count())"
    )
    out = subprocess.run(
        ["taskset", "-c", "0", sys.executable, "-c", code],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()
    assert out == ["1", str(os.cpu_count())]


def test_import_has_no_side_effects():
    code = "import sys, dlpipe.machine.hardware; print('torch' in sys.modules, 'pynvml' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.split()
    assert out == ["False", "False"]


# --- workers, memory, GPUs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "cpus, workers",
    [(0, 0), (1, 0), (2, 2), (3, 2), (4, 3), (5, 3), (8, 6), (9, 6), (12, 6), (16, 8), (64, 8)],
)
def test_recommended_workers_table(cpus, workers):
    assert recommended_workers(cpus) == workers


def test_shm_of_real_dir_and_missing_path(tmp_path):
    assert shm_bytes(str(tmp_path)) > 0
    assert 0 <= shm_free_bytes(str(tmp_path)) <= shm_bytes(str(tmp_path))
    assert shm_bytes(str(tmp_path / "missing")) is None
    assert shm_free_bytes(str(tmp_path / "missing")) is None


def test_memory():
    assert 0 < memory_available_bytes() <= memory_total_bytes()


def test_gpu_summary_and_host_facts_never_fake_zero():
    devices, reason = gpu_summary()
    facts = host_facts()
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in facts.items())
    assert facts["host.logical_cpus"] == str(os.cpu_count())
    assert facts["cpu.budget"] == str(cpu_budget().budget)
    assert float(facts["mem.total_gb"]) > 0
    if devices:
        assert reason is None
        assert int(facts["gpu.count"]) == len(devices) >= 1
        assert "gpu.status" not in facts
    else:
        assert reason  # a non-empty explanation, e.g. "NVML library not found (no NVIDIA driver)"
        assert facts["gpu.status"] == f"not available: {reason}"
        assert "gpu.count" not in facts


# --- memory left under cgroup limits ---------------------------------------------------------------

GIB = 2**30


def test_v1_memory_limit_leaves_its_headroom_without_reclaimable_cache(tmp_path):
    """limit - (usage - inactive file cache), the tightest over the path; a v1 "unlimited" is none."""
    mib = 2**20
    roots = fake_host(tmp_path, "4:memory:/job/step\n0::/\n", {
        "memory/job/memory.limit_in_bytes": f"{2 * GIB}\n",
        "memory/job/memory.usage_in_bytes": f"{2 * GIB}\n",
        "memory/job/memory.stat": f"cache 0\ntotal_inactive_file {64 * mib}\n",
        "memory/job/step/memory.limit_in_bytes": "9223372036854771712\n",
        "memory/job/step/memory.usage_in_bytes": f"{1 * GIB}\n"})
    assert cgroups.memory_headroom(**roots) == (64 * mib, str(tmp_path / "cg" / "memory" / "job" /
                                                              "memory.limit_in_bytes"))
    assert memory_available_bytes(**roots) == 64 * mib  # below what any host running this has available


def test_v2_memory_max_and_a_tighter_ancestor(tmp_path):
    roots = fake_host(tmp_path, "0::/a/b\n", {
        "cgroup.controllers": "cpu memory\n",
        "a/memory.max": f"{4 * GIB}\n", "a/memory.current": f"{3 * GIB}\n",
        "a/memory.stat": f"anon {3 * GIB}\ninactive_file 0\n",
        "a/b/memory.max": "max\n", "a/b/memory.current": f"{3 * GIB}\n"})
    assert cgroups.memory_headroom(**roots) == (1 * GIB, str(tmp_path / "cg" / "a" / "memory.max"))


@pytest.mark.parametrize("files", [{}, {"cgroup.controllers": "memory\n", "a/memory.max": "max\n",
                                        "a/memory.current": "123\n"},
                                   {"cgroup.controllers": "memory\n", "a/memory.max": "garbage\n",
                                    "a/memory.current": "1\n"}], ids=["no files", "max", "malformed"])
def test_no_memory_limit_is_the_hosts_memory(tmp_path, files):
    roots = fake_host(tmp_path, "0::/a\n", files)
    assert cgroups.memory_headroom(**roots) is None
    # the host's figure, read twice: equal within what other processes allocate meanwhile
    assert abs(memory_available_bytes(**roots) - psutil.virtual_memory().available) < GIB
