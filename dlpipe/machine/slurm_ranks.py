"""The ranks of a plain `srun` step: one dlpipe process per Slurm task, no torchrun, no submitit.

`srun --ntasks-per-node=N dlpipe ...` starts N x nodes processes that only Slurm's variables tell
apart. Read as torch.distributed's (what torchrun would have set), they make one data-parallel job:

| torch.distributed | from Slurm (read in a step's task, measured on Slurm 22.05) |
|---|---|
| RANK | SLURM_PROCID |
| WORLD_SIZE | SLURM_STEP_NUM_TASKS (SLURM_NTASKS) |
| LOCAL_RANK | SLURM_LOCALID |
| LOCAL_WORLD_SIZE | this node's entry of SLURM_STEP_TASKS_PER_NODE (`2(x3),1`), by SLURM_NODEID |
| MASTER_ADDR | the first host of SLURM_STEP_NODELIST (SLURM_JOB_NODELIST): task 0 runs there |
| MASTER_PORT | 20000-60000, drawn from the job and step ids as submitit draws it from the job id |

Only inside a step (SLURM_STEP_ID: a batch script's own process has none, with SLURM_NTASKS of
the whole allocation) of several tasks, and never where a launcher already set the ranks (torchrun:
WORLD_SIZE; submitit exports its own from the same variables: SUBMITIT_EXECUTOR). MASTER_ADDR and
MASTER_PORT already in the environment are kept: the way out where node names do not resolve.

A leaf module: no torch, nothing read at import.
"""

import os
import random
import re
from collections.abc import Mapping

# submitit's range for the port it draws from the job id (submitit.helpers.TorchDistributedEnvironment)
MIN_PORT, MAX_PORT = 20000, 60000

_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")
_HOST = re.compile(r"[\w.-]+")


class StepError(ValueError):
    """Slurm's variables do not describe this task's place in its step: one line naming the variable."""


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's compressed count list, one entry per node: '2(x3),1' -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in spec.split(","):
        m = _COUNT.fullmatch(part.strip())
        if m is None:
            raise ValueError(part)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def first_host(nodelist: str) -> str:
    """The first host of a Slurm hostlist, as `scontrol show hostnames` lists it first:
    'gpu[007-009,12],cpu1' -> 'gpu007' (zero padding kept), 'rack[1-2]-n[3-4]' -> 'rack1-n3'."""
    depth, head = 0, []
    for ch in nodelist.strip():
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:  # a comma inside brackets separates ranges, outside it hosts
            break
        head.append(ch)
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[,-]", m.group(1))[0], "".join(head))
    if depth != 0 or not _HOST.fullmatch(host):
        raise ValueError(nodelist)
    return host


def in_step_of_several(environ: Mapping[str, str]) -> bool:
    """Whether this process is one task of a Slurm step of several tasks that no launcher has made
    ranks of yet: the case this module is for."""
    if "WORLD_SIZE" in environ or "SUBMITIT_EXECUTOR" in environ or "SLURM_STEP_ID" not in environ:
        return False
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or ""
    return tasks.isdigit() and int(tasks) > 1


def master_port(environ: Mapping[str, str]) -> int:
    """The same port in every task of a step, from the job id as submitit draws it (an array task's
    id as ARRAY_TASK), with the step id mixed in: two steps of one job running at once (`srun ... &`
    twice) on one node must not both listen on it."""
    array = environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{environ.get('SLURM_ARRAY_TASK_ID')}" if array else environ.get("SLURM_JOB_ID", "")
    return random.Random(f"{job}.{environ.get('SLURM_STEP_ID', '')}").randint(MIN_PORT, MAX_PORT)


def _number(environ: Mapping[str, str], *keys: str) -> int:
    """The first of `keys` that is set, as a number; StepError naming it (or them) otherwise."""
    for key in keys:
        if key in environ:
            value = environ[key]
            if not value.isdigit():
                raise StepError(f"{key}={value!r}: not a task count or id; is this a Slurm step's environment?")
            return int(value)
    raise StepError(f"{' or '.join(keys)} not set in a Slurm step of several tasks: cannot tell this task's rank")


def _parsed(environ: Mapping[str, str], keys: tuple[str, ...], parse, missing: str, unreadable: str):
    """(key, parse(value)) for the first of `keys` set; StepError saying `missing` or `unreadable` otherwise."""
    key = next((k for k in keys if environ.get(k)), None)
    if key is None:
        raise StepError(f"{keys[0]} not set in a Slurm step of several tasks: {missing}")
    try:
        return key, parse(environ[key])
    except ValueError:
        raise StepError(f"{key}={environ[key]!r}: {unreadable}") from None


def step_ranks(environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """torch.distributed's variables for this task of a plain srun step of several tasks; None
    outside one (see `in_step_of_several`). StepError when Slurm's variables contradict each other."""
    env = os.environ if environ is None else environ
    if not in_step_of_several(env):
        return None
    world = _number(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    rank = _number(env, "SLURM_PROCID")
    local_rank = _number(env, "SLURM_LOCALID")
    node = _number(env, "SLURM_NODEID")
    spec_key, counts = _parsed(env, ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"), tasks_per_node,
                               "cannot tell how many ranks share this node", "not Slurm's task counts (e.g. 2(x3),1)")
    if node >= len(counts) or sum(counts) != world or rank >= world or local_rank >= counts[node]:
        raise StepError(f"SLURM_PROCID={rank}, SLURM_LOCALID={local_rank}, SLURM_NODEID={node}, {spec_key}="
                        f"{env[spec_key]!r} and {world} tasks do not fit together: not one step's environment")
    address = env.get("MASTER_ADDR") or _parsed(
        env, ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"), first_host,
        "cannot tell on which node rank 0 listens; set MASTER_ADDR to its address",
        "not a Slurm node list; set MASTER_ADDR to the first node's address")[1]
    return {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(counts[node]), "MASTER_ADDR": address,
            "MASTER_PORT": env.get("MASTER_PORT") or str(master_port(env))}
