"""What a Slurm partition can give one job, read from slurmctld before a sweep submits to it.

A job asking for more than a partition can ever give (more CPUs than its largest node has, more
memory, a longer time than MaxTime, more nodes than MaxNodes) is not refused by Slurm 22.05: sbatch
takes it and it stays PENDING for ever. `scontrol show partition -o` and `scontrol show node -o`
(one record a line, `Key=Value` fields) say what each partition allows:

- the partition's MaxTime (`UNLIMITED`, `INFINITE`, `MM`, `HH:MM:SS`, `D-HH:MM:SS`), MaxNodes,
  MaxCPUsPerNode, MaxMemPerNode (MB), TotalNodes, Default=YES for the default partition;
- each node's CPUTot, RealMemory (MB) and Partitions (a node's record names its partitions, so
  Slurm's hostlist expressions in the partition's Nodes= never need expanding).

A leaf module: no Hydra, nothing read at import.
"""

import subprocess
from dataclasses import dataclass, field

from dlpipe.machine.slurm import command, fields, last_line

_UNLIMITED = ("UNLIMITED", "INFINITE", "NONE", "N/A", "")


@dataclass(frozen=True)
class Node:
    name: str
    cpus: int
    mem_mb: int


@dataclass
class Partition:
    """One partition's limits for a single job; None where the partition sets none."""

    name: str
    default: bool = False
    max_time_min: float | None = None
    max_nodes: int | None = None
    max_cpus_per_node: int | None = None
    max_mem_per_node_mb: int | None = None
    total_nodes: int | None = None
    nodes: list[Node] = field(default_factory=list)

    def largest_cpus(self) -> int | None:
        """The CPUs one node of this partition can give a job (its MaxCPUsPerNode applied)."""
        if not self.nodes:
            return self.max_cpus_per_node
        most = max(n.cpus for n in self.nodes)
        return most if self.max_cpus_per_node is None else min(most, self.max_cpus_per_node)

    def largest_mem_mb(self) -> int | None:
        """The memory (MB) one node of this partition can give a job (its MaxMemPerNode applied)."""
        if not self.nodes:
            return self.max_mem_per_node_mb
        most = max(n.mem_mb for n in self.nodes)
        return most if self.max_mem_per_node_mb is None else min(most, self.max_mem_per_node_mb)


def _limit(value: str) -> int | None:
    return None if value.upper() in _UNLIMITED or not value.isdigit() else int(value)


def minutes(value: str) -> float | None:
    """Slurm's time limit in minutes (None: no limit): `30`, `MM:SS`, `HH:MM:SS`, `D-HH`,
    `D-HH:MM`, `D-HH:MM:SS` (sbatch --time's forms, which scontrol prints as D-HH:MM:SS)."""
    if value.upper() in _UNLIMITED:
        return None
    days, _, rest = value.rpartition("-")
    parts = [float(p) for p in rest.split(":")]
    if days:  # D-HH, D-HH:MM, D-HH:MM:SS
        parts += [0.0] * (3 - len(parts))
        h, m, s = parts
        return float(days) * 1440 + h * 60 + m + s / 60
    if len(parts) == 1:
        return parts[0]
    if len(parts) == 2:
        return parts[0] + parts[1] / 60
    h, m, s = parts
    return h * 60 + m + s / 60


def records(text: str) -> list[dict[str, str]]:
    """`scontrol show ... -o` output as one {field: value} per line."""
    return [fields(line) for line in text.splitlines() if "=" in line]


def parse(partitions_text: str, nodes_text: str) -> dict[str, Partition]:
    """Partitions by name, each with the nodes whose record lists it."""
    found: dict[str, Partition] = {}
    for r in records(partitions_text):
        name = r.get("PartitionName")
        if not name:
            continue
        found[name] = Partition(
            name=name, default=r.get("Default") == "YES", max_time_min=minutes(r.get("MaxTime", "UNLIMITED")),
            max_nodes=_limit(r.get("MaxNodes", "")), max_cpus_per_node=_limit(r.get("MaxCPUsPerNode", "")),
            max_mem_per_node_mb=_limit(r.get("MaxMemPerNode", "")), total_nodes=_limit(r.get("TotalNodes", "")))
    for r in records(nodes_text):
        cpus, mem = _limit(r.get("CPUTot", "")), _limit(r.get("RealMemory", ""))
        if cpus is None or mem is None:
            continue
        for name in r.get("Partitions", "").split(","):
            if name in found:
                found[name].nodes.append(Node(r.get("NodeName", "?"), cpus, mem))
    return found


def _scontrol(*args: str, run=subprocess.run) -> str:
    """scontrol's stdout; OSError with why it did not answer."""
    r = command(["scontrol", *args], run)
    if isinstance(r, str):
        raise OSError(r)
    if r.returncode != 0:
        raise OSError(f"scontrol {' '.join(args)} exited {r.returncode}: {last_line(r.stderr)}")
    return r.stdout


def read_partitions(run=subprocess.run) -> dict[str, Partition]:
    """Every partition slurmctld knows, with its nodes; OSError when slurmctld cannot be asked."""
    return parse(_scontrol("show", "partition", "-o", run=run), _scontrol("show", "node", "-o", run=run))
