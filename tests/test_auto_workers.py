"""The `${auto_workers:}` resolver under a CPU quota: the config's num_workers follows the cgroup.

In process, over the "Workers per budget" table (docs/loader.md): a composed config resolves num_workers while
`hardware.cpu_budget` (what the resolver calls) reads a fake cgroup tree. Then for real: `dlpipe
+recipe=smoke --cfg job --resolve` runs inside a cgroup with a CPU quota (we are root; the cgroups
are removed afterwards), flat and nested, against one without a quota.
"""

from __future__ import annotations

import functools
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf
from test_config import make as compose_config
from test_config import registered  # noqa: F401  (autouse: resolvers, schemas and recipes registered)
from test_hardware import fake_host

from dlpipe.machine import hardware

# docs/loader.md, "Workers per budget": 1 -> 0, 2 -> 2, 3-4 -> budget - 1, 5-8 -> budget - 2,
# 9-15 -> budget // 2 (at least 6), 16+ -> 8.
README_WORKERS = {1: 0, 2: 2, 3: 2, 4: 3, 5: 3, 6: 4, 7: 5, 8: 6, 9: 6, 10: 6, 11: 6, 12: 6, 13: 6, 14: 7, 15: 7,
                  16: 8}
AFFINITY = 64  # in process: more CPUs than any quota below, so the quota is what limits


def readme_workers(budget: int) -> int:
    return README_WORKERS[min(budget, 16)]


def host_with_quota(monkeypatch, tmp_path: Path, layout: str, cpus: float | None) -> None:
    """The process sits in /job under a cgroup v1 or v2 tree whose /job has `cpus` CPUs (None: no quota);
    hardware.cpu_budget, as the resolver calls it, reads that tree and no Slurm or torchrun variable."""
    period = 100000
    quota = "max" if cpus is None else str(round(cpus * period))
    if layout == "v2":
        roots = fake_host(tmp_path, "0::/job\n", {"cgroup.controllers": "cpu memory\n",
                                                   "job/cpu.max": f"{quota} {period}\n"})
    else:
        roots = fake_host(tmp_path, "1:cpu,cpuacct:/job\n0::/\n", {
            "cpu,cpuacct/job/cpu.cfs_quota_us": ("-1" if cpus is None else quota) + "\n",
            "cpu,cpuacct/job/cpu.cfs_period_us": f"{period}\n"})
    monkeypatch.setattr(hardware, "cpu_budget",
                        functools.partial(hardware.cpu_budget, **roots, environ={}, affinity=AFFINITY))


@pytest.mark.parametrize("layout", ["v1", "v2"])
@pytest.mark.parametrize("cpus", [1, 2, 3, 4, 5, 8, 9, 12, 15, 16, 64, 0.5, 2.5])
def test_resolved_num_workers_follows_the_cgroup_quota(monkeypatch, tmp_path, layout, cpus):
    """A fractional quota counts as the next whole CPU (2.5 CPUs -> budget 3)."""
    host_with_quota(monkeypatch, tmp_path, layout, cpus)
    cfg = compose_config()
    assert OmegaConf.to_container(cfg.loader)["num_workers"] == "${auto_workers:}"  # the resolver decides it
    assert cfg.loader.num_workers == readme_workers(math.ceil(cpus))


def test_without_a_quota_the_affinity_decides(monkeypatch, tmp_path):
    host_with_quota(monkeypatch, tmp_path, "v2", None)
    assert compose_config().loader.num_workers == readme_workers(AFFINITY)


# --- a real cgroup ----------------------------------------------------------------------------------


def cpu_controller() -> tuple[str, Path] | None:
    """("v1" | "v2", the cpu controller's mount) where this host has one, else None."""
    for name in ("cpu,cpuacct", "cpuacct,cpu", "cpu"):  # v1 first: on hybrid hosts it holds the cpu controller
        mount = Path("/sys/fs/cgroup") / name
        if (mount / "cpu.cfs_quota_us").is_file():
            return "v1", mount
    controllers = Path("/sys/fs/cgroup/cgroup.controllers")
    if controllers.is_file() and "cpu" in controllers.read_text().split():
        return "v2", controllers.parent
    return None


class Cgroups:
    """Creates cgroups with CPU quotas under the real cpu controller; remove() deletes them, leaves first."""

    def __init__(self, layout: str, mount: Path):
        self.layout, self.mount = layout, mount
        self.made: list[Path] = []

    def make(self, rel: str, cpus: float | None) -> Path:
        """`rel` under the mount with a quota of `cpus` (None: none); skips the test where the host
        refuses (a read-only mount, a v2 root that cannot hand the cpu controller down)."""
        path = self.mount / rel
        try:
            path.mkdir()
            self.made.append(path)
            self._limit(path, cpus)
        except OSError as e:
            pytest.skip(f"cannot make a cgroup with a CPU quota here: {e}")
        return path

    def _limit(self, path: Path, cpus: float | None) -> None:
        if self.layout == "v2":
            # The parent must hand the cpu controller down before a child has cpu.max.
            (path.parent / "cgroup.subtree_control").write_text("+cpu")
            if cpus is not None:
                (path / "cpu.max").write_text(f"{round(cpus * 100000)} 100000")
        elif cpus is not None:
            period = int((path / "cpu.cfs_period_us").read_text())
            (path / "cpu.cfs_quota_us").write_text(str(round(cpus * period)))

    def remove(self) -> None:
        for path in reversed(self.made):
            # The processes have exited and been reaped; the kernel may still be emptying the group.
            for _ in range(50):
                if not path.exists():
                    break
                try:
                    path.rmdir()
                except OSError:
                    time.sleep(0.1)
            assert not path.exists(), f"could not remove the test cgroup {path}"


@pytest.fixture
def cgroups():
    found = cpu_controller()
    if found is None:
        pytest.skip("no cgroup cpu controller under /sys/fs/cgroup")
    if os.geteuid() != 0:
        pytest.skip("creating cgroups needs root")
    groups = Cgroups(*found)
    try:
        yield groups
    finally:
        groups.remove()


def resolved_workers_in(cgroup: Path, tmp_path: Path) -> int:
    """loader.num_workers as `dlpipe +recipe=smoke --cfg job --resolve` prints it, run inside `cgroup`."""
    command = [sys.executable, "-m", "dlpipe", "+recipe=smoke", "--cfg", "job", "--resolve"]
    # The shell moves itself into the cgroup, then becomes dlpipe: the whole run is inside it.
    script = f"echo $$ > {shlex.quote(str(cgroup / 'cgroup.procs'))} && exec {shlex.join(command)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "LOCAL_WORLD", "WORLD_SIZE", "DLPIPE_"))}
    r = subprocess.run(["sh", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
                       stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)["loader"]["num_workers"]


@pytest.mark.integration
def test_the_cli_resolves_workers_from_a_real_cgroup_quota(cgroups, tmp_path):
    """1 CPU of quota, on the group itself or on its parent only, gives no workers; the same command
    in a group without a quota gets the workers of its affinity."""
    affinity = len(os.sched_getaffinity(0))
    if affinity < 2:
        pytest.skip("one CPU of affinity already means no workers: a quota could not change the answer")
    tag = f"dlpipe-test-{os.getpid()}"
    free = cgroups.make(f"{tag}-free", None)
    capped = cgroups.make(f"{tag}-capped", 1)
    cgroups.make(f"{tag}-parent", 1)
    nested = cgroups.make(f"{tag}-parent/job", None)
    assert resolved_workers_in(free, tmp_path) == readme_workers(affinity)
    assert resolved_workers_in(capped, tmp_path) == 0
    assert resolved_workers_in(nested, tmp_path) == 0  # the parent's quota caps the unlimited child
