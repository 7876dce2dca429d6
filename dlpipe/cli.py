"""The `dlpipe` command: compose the config with Hydra, check it, then hand it to a task's `run`.

Only this module, `config/` and the sweep callback (`sweeps/callback.py`) touch Hydra's runtime.
"""

import importlib
import logging
import os
import shutil
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import CompactHydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dlpipe.config.composition_errors import one_line
from dlpipe.config.group_options import refuse_paths_as_options
from dlpipe.config.interpolations import unresolved
from dlpipe.config.output_folder import LOCK_FILE, remove_empty_parents
from dlpipe.config.paths import conf_dir
from dlpipe.config.resolvers import register_resolvers
from dlpipe.config.store import register_recipes, register_schemas
from dlpipe.errors import ConfigError, DlpipeError, user_message
from dlpipe.help import help_page, version_line
from dlpipe.machine import budget_share
from dlpipe.redact import redact_printed_config
from dlpipe.schema import CHOICES
from dlpipe.stop import Terminated, restore_handlers, stop_at_once
from dlpipe.sweeps.outcome import SweepEnded
from dlpipe.tasks.preflight import JobContext
from dlpipe.tasks.writable import check_writable, hydra_output_error
from dlpipe.tracking.given_run import refuse_outside_training
from dlpipe.training.distributed import (
    devices_requested,
    export_srun_env,
    export_submitit_env,
    ranks_from_env,
    sweep_across_ranks,
    torchrun_command,
)
from dlpipe.training.requeue import requeue_through_submitit

# Imported inside functions: the task modules (dlpipe.tasks.<task> through _task_module, and sync), each
# only when its command runs: most import torch, and `dlpipe --help`, `--version` and `--cfg job` must not.

log = logging.getLogger("dlpipe")


class JobFailed(CompactHydraException):
    """A sweep job stopped by a user-facing error (already printed as 'dlpipe: error: ...')."""


def resolve(cfg: DictConfig) -> tuple[dict, dict]:
    """(raw, resolved) plain containers of the job config; resolver failures become ConfigError."""
    raw = OmegaConf.to_container(cfg, resolve=False)
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError([unresolved(cfg, e)]) from None
    return raw, resolved


HYDRA_FILES = {"config.yaml", "hydra.yaml", "overrides.yaml"}
JOB_FILES = {LOCK_FILE}  # the folder's lock (config.output_folder), held by this job until it exits


def remove_if_half_made(output_dir: Path, job_name: str) -> None:
    """Remove a run directory that holds nothing but what Hydra wrote before our checks failed.

    A directory with anything else in it (a resolved config, checkpoints: an earlier run being
    resumed) is left alone. Empty parents inside the working directory (outputs/DATE) go too.
    """
    cwd = Path.cwd().resolve()
    output_dir = output_dir.resolve()
    # Never the working directory or a folder above it (hydra.run.dir=. or ..), and only when
    # Hydra's own record of this job is there.
    if not output_dir.is_dir() or output_dir == cwd or output_dir in cwd.parents:
        return
    if not (output_dir / ".hydra").is_dir():
        return
    for entry in output_dir.iterdir():
        if entry.name == ".hydra" and entry.is_dir() and {f.name for f in entry.iterdir()} <= HYDRA_FILES:
            continue
        if entry.is_file() and entry.name in {f"{job_name}.log", *JOB_FILES}:  # Hydra's log of this job, not any .log
            continue
        return
    shutil.rmtree(output_dir)
    remove_empty_parents(output_dir, cwd)


def _task_module(task: str):
    """The module whose run(ctx, raw, resolved) carries out `task` (validation names a bad one):
    dlpipe.tasks.<task>, imported only now."""
    return importlib.import_module(f"dlpipe.tasks.{task}")


def _job(cfg: DictConfig):
    """Hydra's task function: one training job (one per sweep point with --multirun)."""
    hc = HydraConfig.get()
    multirun = hc.mode == RunMode.MULTIRUN
    handlers = stop_at_once()  # every task's runs end KILLED on a signal, from the job's first moment
    try:
        ctx = JobContext(
            output_dir=Path(hc.runtime.output_dir),
            # as typed: an override like x=${oc.env:V} must not be resolved just to be listed
            overrides=OmegaConf.to_container(hc.overrides.task, resolve=False),
            recipe=hc.runtime.choices.get("recipe"),
            multirun=multirun,
            config_dir=next((s.path for s in hc.runtime.config_sources if s.provider == "command-line"), None),
            choices={group: option for group, option in hc.runtime.choices.items() if option is not None},
            job_num=int(hc.job.num) if multirun and hc.job.get("num") is not None else None,
        )
        # Before resolving: ${auto_workers:} divides the CPUs by the ranks on this node.
        export_submitit_env()
        task = _task_module(cfg.get("task", "train"))
        # A task that starts work before the config resolves (train: its tracking process) takes it in run().
        early = getattr(task, "start_early", None)
        sidecar = early(cfg) if early else None
        try:
            raw, resolved = resolve(cfg)
            if resolved.get("task") != "plan":  # a plan writes nothing
                check_writable(ctx, resolved)  # every folder the job writes, before anything is built
            return task.run(ctx, raw, resolved, sidecar) if early else task.run(ctx, raw, resolved)
        finally:
            if sidecar is not None:
                sidecar.close()
    except KeyboardInterrupt:
        print("dlpipe: interrupted (Ctrl-C)", file=sys.stderr)
        remove_if_half_made(Path(hc.runtime.output_dir), hc.job.name)
        sys.exit(130)
    except Terminated as e:
        # Under submitit, its signal (timeout or preemption) means "requeue me": the checkpoint is
        # written, so let submitit resubmit this job, which resumes it in the same output dir and run.
        requeue_through_submitit(str(e))
        print(f"dlpipe: terminated ({e})", file=sys.stderr)
        remove_if_half_made(Path(hc.runtime.output_dir), hc.job.name)
        sys.exit(143)  # 128 + SIGTERM, what schedulers expect of a job that was told to stop
    except DlpipeError as e:
        lines = user_message(e)
        ranks = ranks_from_env()
        where = f"rank {ranks.rank}: " if ranks.distributed else ""  # whose error, among N ranks' output
        for line in lines:
            print(f"dlpipe: error: {where}{line}", file=sys.stderr)
        if multirun:
            # Hydra records the job as failed, runs the others and exits 1; a compact exception
            # is reported as its message, without a traceback.
            raise JobFailed("; ".join(lines)) from None
        remove_if_half_made(Path(hc.runtime.output_dir), hc.job.name)
        sys.exit(2)
    finally:
        restore_handlers(handlers)
        budget_share.leave()  # a sweep may run its next job in this process: it must not count this one


def with_overrides(argv: list[str], extra: list[str]) -> list[str]:
    """argv with `extra` overrides placed right after the user's last override, so they win and
    stay next to the others: Hydra's parser rejects overrides split by an option (`a=1 --cfg job b=2`)."""
    overrides = [i for i, arg in enumerate(argv[1:], 1) if "=" in arg and not arg.startswith("-")]
    last = max(overrides, default=len(argv) - 1)
    return [*argv[: last + 1], *extra, *argv[last + 1 :]]


MULTIRUN_FLAGS = ("--multirun", "-m")


def multirun_first(argv: list[str]) -> list[str]:
    """argv with --multirun (-m) moved before the overrides: Hydra's parser takes the overrides as
    one run of positional arguments and rejects an option after them ("unrecognized arguments")."""
    flags = [a for a in argv[1:] if a in MULTIRUN_FLAGS]
    return [argv[0], *flags[:1], *(a for a in argv[1:] if a not in MULTIRUN_FLAGS)]


# `dlpipe bench|tune|eval ARGS` is `dlpipe ARGS task=...`; plan has its own overrides, sync is no Hydra app.
HYDRA_COMMANDS = tuple(task for task in CHOICES["task"] if task not in ("train", "plan"))

# A plan writes nothing: no output folder, no Hydra record, no log file (its lines go to stdout).
PLAN_OVERRIDES = ["task=plan", "hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]


def plan_argv(argv: list[str]) -> list[str]:
    """`dlpipe plan ARGS` as `dlpipe ARGS task=plan ...`; a sweep is refused (one job's plan at a time:
    a sweep would open its parent tracking run and folder)."""
    if set(MULTIRUN_FLAGS) & set(argv[2:]):
        print("dlpipe: error: plan with --multirun: a plan shows one job; drop --multirun and give one value "
              "per key", file=sys.stderr)
        sys.exit(2)
    return with_overrides([argv[0], *argv[2:]], PLAN_OVERRIDES)


def refuse_a_sweep_into_one_run(argv: list[str]) -> None:
    """MLFLOW_RUN_ID names one run: refused for a sweep here, before the sweep opens its parent run."""
    if set(MULTIRUN_FLAGS) & set(argv[1:]):
        try:
            refuse_outside_training("train", multirun=True)
        except ConfigError as e:
            print(f"dlpipe: error: {e.problems[0]}", file=sys.stderr)
            sys.exit(2)


def restart_under_torchrun(argv: list[str]) -> None:
    """`trainer.devices=N` (N > 1) outside torchrun: this process becomes torchrun with N ranks."""
    command = torchrun_command(argv[1:], os.environ)
    if command is None:
        return
    n = devices_requested(argv[1:])
    if set(MULTIRUN_FLAGS) & set(argv[1:]):
        print(f"dlpipe: error: trainer.devices={n} with --multirun: a sweep's jobs cannot "
              "each start torchrun here; use hydra/launcher=slurm_node (a task per GPU) or one torchrun per job",
              file=sys.stderr)
        sys.exit(2)
    # Restarted as torchrun's ranks. Restarts share no TCP store (they were unreliable with it).
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    print(f"dlpipe: trainer.devices={n}: running {n} ranks as "
          f"torchrun --standalone --nproc_per_node={n} -m dlpipe ...",
          file=sys.stderr, flush=True)
    os.execve(sys.executable, command, env)


def import_from_here() -> None:
    """Modules in the current folder import as they do under `python -m dlpipe` (the `dlpipe` script's
    own folder is on sys.path instead): `dataset._target_=mypkg.MyData` with ./mypkg/, no PYTHONPATH."""
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())


def main() -> None:
    """Console-script entry point (`dlpipe ...`, `python -m dlpipe ...`)."""
    import_from_here()
    if "--version" in sys.argv[1:]:  # before Hydra, whose own --version names Hydra's
        print(version_line())
        sys.exit(0)
    if sys.argv[1:2] == ["sync"]:
        from dlpipe.tasks import sync

        sys.exit(sync.main(sys.argv[2:]))
    if sys.argv[1:2] == ["plan"]:
        sys.argv = with_overrides(plan_argv(sys.argv), help_page("plan", sys.argv[2:]))
    if sys.argv[1:2] and sys.argv[1] in HYDRA_COMMANDS:
        # `dlpipe bench ARGS` is `dlpipe ARGS task=bench`: the same Hydra app, so recipes,
        # overrides and --multirun work unchanged (last, after any --config-dir option); with
        # --help, Hydra prints the command's own page
        task, args = sys.argv[1], sys.argv[2:]
        sys.argv = with_overrides([sys.argv[0], *args], [f"task={task}", *help_page(task, args)])
    sys.argv = multirun_first(sys.argv)
    # A task of a plain srun step of several tasks becomes a rank, as under torchrun, before anything
    # reads its rank or its CPU budget (${auto_workers:} divides by the ranks on the node).
    export_srun_env()
    refuse_a_sweep_into_one_run(sys.argv)
    restart_under_torchrun(sys.argv)
    # Before Hydra opens the sweep's folder and parent run: every rank (torchrun's, an srun step's
    # tasks) would run the whole sweep.
    refusal = sweep_across_ranks(sys.argv[1:])
    if refusal:
        print(f"dlpipe: error: {refusal}", file=sys.stderr)
        sys.exit(2)
    if ranks_from_env().rank > 0 and "SUBMITIT_EXECUTOR" not in os.environ:
        # A torchrun rank other than 0 writes nothing of its own: no run directory, Hydra record or
        # log file (its output directory comes from rank 0; see tasks/train.py). Last, so they win.
        sys.argv = with_overrides(sys.argv, ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"])
    # A full disk under the job's dlpipe.log must not print a logging traceback per record and bury
    # the one error line (Python's own advice for production code).
    logging.raiseExceptions = False
    # Registered before Hydra starts, so they are pickled with the task for launcher jobs.
    register_resolvers()
    register_schemas()
    try:
        register_recipes()
        refuse_paths_as_options(sys.argv[1:])  # before Hydra loads `dataset=../../x` from anywhere on disk
    except ConfigError as e:
        print(f"dlpipe: error: {e}", file=sys.stderr)
        sys.exit(2)
    redact_printed_config(sys.argv[1:])  # --cfg job, --info: no tracking.uri password on the screen
    app = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(_job)
    if os.environ.get("HYDRA_FULL_ERROR") == "1":
        app()  # the user asked for Hydra's full tracebacks
        return
    # Hydra prints its own errors over several lines; made to raise them, we print one line each.
    previous = os.environ.get("HYDRA_FULL_ERROR")
    os.environ["HYDRA_FULL_ERROR"] = "1"
    try:
        app()
    except SweepEnded as e:  # the launcher ended the sweep (its jobs cancelled, sbatch's refusal...): its line
        print(f"dlpipe: error: {e.line}", file=sys.stderr)
        sys.exit(e.exit_code)
    except JobFailed as e:  # a sweep job's error, already printed when the job ended
        print(f"dlpipe: error: a sweep job failed ({e}); the other jobs ran", file=sys.stderr)
        sys.exit(1)
    except BrokenPipeError:  # `dlpipe --help | head`: the reader left, which is no error of the job's folder
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # else the exit's flush fails again
        sys.exit(1)
    except Exception as e:
        # Hydra could not make the output folder, or its own error in one line
        line = hydra_output_error(e, sys.argv[1:]) or one_line(e, sys.argv[1:])
        if line is None:
            raise
        print(f"dlpipe: error: {line}", file=sys.stderr)
        sys.exit(2)
    finally:
        if previous is None:
            del os.environ["HYDRA_FULL_ERROR"]
        else:
            os.environ["HYDRA_FULL_ERROR"] = previous


if __name__ == "__main__":
    main()
