"""dlpipe's Slurm launcher, `_target_: hydra_plugins.dlpipe_submitit_launcher.SlurmLauncher`
(conf/hydra/launcher/slurm.yaml): Hydra's submitit SlurmLauncher (every key of its config works as
before) that never waits for ever and ends every submitter-side failure in one line. It lives here
because Hydra instantiates launchers only from classes defined in the hydra_plugins namespace package
(which it scans at every start); what it decides is in dlpipe.sweeps (slurm_watch, slurm_check).

Hydra's launcher ends in `[j.results()[0] for j in jobs]`: a job cancelled by scancel raised
submitit's UncompletedJobError (38-62 lines), a job whose end Slurm's accounting could not report was
waited for for ever, sbatch's refusal was a traceback, and a SIGTERM or Ctrl-C to the submitter left
every job running, unwatched, while the parent run ended. Here:

- sbatch's refusal is one line (`SweepEnded`), and the parent run ends FAILED saying no job ran;
- the jobs are watched by their result files and slurmctld (sweeps.slurm_watch): jobs that ended
  without a result end the sweep with one line naming them, how they ended and their logs, and jobs
  waiting in the queue are said to wait, with squeue's reason;
- a stop signal to the submitter cancels the sweep's unfinished jobs (each checkpoints on Slurm's
  SIGTERM and ends its run KILLED; the same command in the same hydra.sweep.dir resumes them): a
  sweep nobody watches would end its parent before its jobs, and its summary would never be written.

The parent run's end reason is handed to the sweep's callback (SweepTracking.ended_by).
"""

import contextlib
import io
import logging
import os
import signal
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import filter_overrides
from omegaconf import OmegaConf

from dlpipe.machine.slurm_queue import cancel
from dlpipe.stop import STOP_SIGNALS, Terminated, stop_error
from dlpipe.sweeps.callback import SweepTracking
from dlpipe.sweeps.outcome import SweepEnded
from dlpipe.sweeps.slurm_watch import Watched, lost_line, watch
from dlpipe.tracking.run import end_status

# Imported inside functions: submitit, only when a sweep submits: Hydra imports this module when it scans
# for plugins at every dlpipe start (Hydra's own launcher defers it the same way).

log = logging.getLogger("dlpipe")

try:
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher
    from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
except ImportError:
    # Without the slurm extra (hydra-submitit-launcher) there is nothing to extend. Hydra imports this
    # module at every start of every dlpipe command, and an ImportError here would print its
    # "plugin is incompatible or buggy" warning each time; based on object the class is no plugin at
    # all, and hydra/launcher=slurm stops where Hydra finds no submitit_slurm config.
    submitit_launcher = None

_HYDRAS = submitit_launcher.SlurmLauncher if submitit_launcher is not None else object


class SlurmLauncher(_HYDRAS):
    """Hydra's SlurmLauncher with its jobs watched and cancelled as the module says."""

    def launch(self, job_overrides, initial_job_idx: int):
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        handlers = {sig: signal.signal(sig, _raise) for sig in STOP_SIGNALS}
        jobs: list = []
        try:
            jobs = self._submit(job_overrides, initial_job_idx, sweep_dir)
            watched = [Watched(initial_job_idx + i, j.job_id, j.paths.stderr, j.paths.result_pickle.exists)
                       for i, j in enumerate(jobs)]
            lost = watch(watched, warn=lambda why: log.warning(
                "slurmctld does not answer (%s): judging the jobs by their results and sacct", why),
                tell=log.warning)
        except (Terminated, KeyboardInterrupt) as e:
            raise self._interrupted(e, jobs, sweep_dir) from None
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
        if lost:
            raise self._ended(*lost_line(lost), 1)
        return [self._result(num, job) for num, job in enumerate(jobs, initial_job_idx)]

    def _submit(self, job_overrides, initial_job_idx: int, sweep_dir: Path) -> list:
        """Hydra's launcher's submission (its executor, parameters and folder), with sbatch's refusal
        as SweepEnded."""
        import submitit
        from submitit.core.utils import FailedJobError

        params = self.params
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params["submitit_folder"],
                                         **{f"{self._EXECUTOR}_max_num_timeout": params["max_num_timeout"]}
                                         if "max_num_timeout" in params else {})
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()
                                      if k not in ("max_num_timeout", "submitit_folder")})
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        job_params = []
        for idx, overrides in enumerate(job_overrides, initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
        refused = io.StringIO()
        try:
            with contextlib.redirect_stderr(refused):  # submitit prints sbatch's stderr before raising it
                return executor.map_array(self, *zip(*job_params))
        except FailedJobError as e:
            why = (str(e).strip().splitlines() or ["no reason given"])[-1]
            raise self._ended("FAILED", f"no job ran: sbatch refused the sweep's {_jobs(len(job_params))} ({why})",
                              1) from None

    def _result(self, num: int, job) -> Any:
        """The job's JobReturn; a job that failed outside Hydra's job (its result an error) as SweepEnded."""
        from submitit.core.utils import FailedJobError, UncompletedJobError

        try:
            return job.results()[0]
        except (FailedJobError, UncompletedJobError) as e:
            last = next((ln for ln in reversed(str(e).splitlines()) if ln.strip() and not ln.startswith("-")), "")
            raise self._ended("FAILED", f"job #{num} (Slurm {job.job_id}) failed: {last.strip()[:300]}; "
                              f"its log: {job.paths.stderr}", 1) from None

    def _interrupted(self, e: BaseException, jobs: list, sweep_dir: Path) -> SweepEnded:
        """A stop signal to the submitter: cancel the jobs still without a result, say so. A signal
        repeated meanwhile (a second Ctrl-C, a scheduler's SIGTERM after the user's) is the same stop
        request: ignored until the launch's handlers are restored, or it would end the submitter in a
        traceback halfway through cancelling."""
        for sig in STOP_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        _, said = end_status(type(e), e)  # as a run says it: terminated (SIGTERM), interrupted (Ctrl-C)
        code = 130 if isinstance(e, KeyboardInterrupt) else 143
        unfinished = [j.job_id for j in jobs if not j.paths.result_pickle.exists()]
        if not jobs:
            what = "while submitting: no job known to have been submitted (squeue lists any that were)"
        elif not unfinished:
            what = "every job had ended"
        else:
            why = cancel(unfinished)
            if why:
                what = (f"cancelling the sweep's jobs failed ({why}): they still run; "
                        f"scancel {' '.join(unfinished)}")
            else:
                what = (f"cancelled the sweep's {_jobs(len(unfinished), 'unfinished Slurm job')} "
                        f"({' '.join(unfinished)}): each checkpoints and ends its run KILLED; run the same command "
                        f"with hydra.sweep.dir={sweep_dir} to resume them")
        return self._ended("KILLED", f"{said}: {what}; logs: {sweep_dir / '.submitit'}", code)

    def _ended(self, status: str, line: str, exit_code: int) -> SweepEnded:
        """SweepEnded for the CLI, with the parent run told why (status, line)."""
        for callback in getattr(self.hydra_context.callbacks, "callbacks", []):
            if isinstance(callback, SweepTracking):
                callback.ended_by(status, line)
        return SweepEnded(line, exit_code)


def _jobs(n: int, noun: str = "job") -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


def _raise(signum, frame) -> None:
    raise stop_error(signal.Signals(signum).name)
