"""Limits of the cgroups on this process's path: the CPU quota (hardware.cpu_budget) and the memory
left under the tightest memory limit (hardware.memory_available_bytes).

psutil and `os.cpu_count()` see the host: a container or Slurm job given 2 CPUs and 8 GiB on a 64-core,
512 GiB node reads as the node. The limits are found by following /proc/self/cgroup into the mounted
hierarchies (v1, v2, or hybrid with v2 at <root>/unified) and taking the minimum over every ancestor,
since a parent's limit caps each child. Missing or malformed control files mean "no limit visible":
never a failed launch, never an invented limit. Nothing is read at import.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

Limit = tuple[float, str]
"""(value, the control file that set it)."""


def read_text(path: str) -> str | None:
    # Missing or unreadable control files are normal (no controller, rootless container):
    # they mean "no limit visible to us", so report None instead of failing the launch.
    try:
        with open(path, encoding="ascii") as f:
            return f.read()
    except (OSError, ValueError):  # ValueError covers UnicodeDecodeError on garbage content
        return None


def tightest_on_path(mount: str, rel: str, read: Callable[[str], Limit | None]) -> Limit | None:
    """Minimum limit from `<mount>/<rel>` up to `<mount>`: a parent's limit caps every child."""
    mount = os.path.normpath(mount)
    leaf = os.path.normpath(os.path.join(mount, rel.lstrip("/")))
    # Inside containers /proc/self/cgroup names the host-side path, which is absent under the
    # container's mount (its root *is* our cgroup); a ".." escape is never trusted either.
    inside = leaf == mount or leaf.startswith(mount + os.sep)
    if not inside or not os.path.isdir(leaf):
        leaf = mount
    best: Limit | None = None
    directory = leaf
    while True:
        found = read(directory)
        if found is not None and (best is None or found[0] < best[0]):
            best = found
        if directory == mount:
            return best
        directory = os.path.dirname(directory)


def hierarchy(controller: str, v1_mounts: Sequence[str], proc_root: str, cgroup_root: str
              ) -> tuple[str, str, bool] | None:
    """(mount, this process's path inside it, whether it is cgroup v2) of the hierarchy that holds
    `controller`, or None. A v1 line naming the controller wins (on hybrid hosts the v2 tree is
    often empty); `v1_mounts`: the directory names that controller's v1 mount may have."""
    text = read_text(os.path.join(proc_root, "self", "cgroup"))
    if text is None:
        return None
    v2_path: str | None = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        number, controllers, path = parts
        if number == "0" and controllers == "":
            v2_path = path
        elif controller in controllers.split(","):
            for name in (controllers, *v1_mounts):
                mount = os.path.join(cgroup_root, name)
                if os.path.isdir(mount):
                    return mount, path, False
    if v2_path is None:
        return None
    # Hybrid layout mounts cgroup2 at <root>/unified; a pure v2 root has cgroup.controllers.
    unified = os.path.join(cgroup_root, "unified")
    pure_v2 = os.path.exists(os.path.join(cgroup_root, "cgroup.controllers"))
    return (unified if not pure_v2 and os.path.isdir(unified) else cgroup_root), v2_path, True


def _number(text: str | None) -> int | None:
    try:
        return int(text or "")  # int() tolerates the trailing newline
    except ValueError:
        return None  # "max", empty or malformed: no limit


def _inactive_file(directory: str, key: str) -> int:
    """Page cache the kernel reclaims before it kills for memory (what `docker stats` and the
    kubelet leave out of a container's usage)."""
    for line in (read_text(os.path.join(directory, "memory.stat")) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            return _number(value) or 0
    return 0


# v1 reports "no limit" as the largest page-aligned 63-bit number; anything above this is none.
_V1_UNLIMITED = 2**62


def _v2_headroom(directory: str) -> Limit | None:
    """memory.max - (memory.current - inactive file cache), or None when unlimited."""
    path = os.path.join(directory, "memory.max")
    limit, usage = _number(read_text(path)), _number(read_text(os.path.join(directory, "memory.current")))
    if limit is None or usage is None:
        return None
    return max(0, limit - max(0, usage - _inactive_file(directory, "inactive_file"))), path


def _v1_headroom(directory: str) -> Limit | None:
    """memory.limit_in_bytes - (memory.usage_in_bytes - inactive file cache), or None when unlimited."""
    path = os.path.join(directory, "memory.limit_in_bytes")
    limit = _number(read_text(path))
    usage = _number(read_text(os.path.join(directory, "memory.usage_in_bytes")))
    if limit is None or usage is None or limit >= _V1_UNLIMITED:
        return None
    return max(0, limit - max(0, usage - _inactive_file(directory, "total_inactive_file"))), path


def memory_headroom(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> Limit | None:
    """(bytes this process's cgroups can still take before the tightest memory limit on its path,
    that limit's file), or None where no memory limit applies."""
    found = hierarchy("memory", ("memory",), proc_root, cgroup_root)
    if found is None:
        return None
    mount, rel, v2 = found
    return tightest_on_path(mount, rel, _v2_headroom if v2 else _v1_headroom)
