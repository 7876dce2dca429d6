"""Runs whose process died without ending them (kill -9, the OOM killer, a lost node): found and ended.

A process killed outright cannot end its MLflow run, which would stay RUNNING for ever. In
training the run is kept by a tracking process (tracking.sidecar) that ends it when the training
process dies; this covers the rest: both killed, or a task that keeps its run in its own process.
Each job records, in its output folder, which run it opened and which process keeps it
(`mlflow_run.json`: run id, tracking URI without its password, host, pid, process start time). A later job in the same
folder, and `dlpipe sync`, read it: a run still RUNNING whose process is gone is ended KILLED, with
`dlpipe.end_reason` saying it was found abandoned. A process on another host cannot be checked
from here; it is taken as gone (an output folder is one job's at a time) and the reason says so.

The record is written atomically and synced to disk, so a kill or a full disk leaves the previous
one (or none), never a torn one; a crash of the machine itself or a damaged disk still can. The run
keeps a second copy of the facts: its folder (`dlpipe.output_dir`, or `dlpipe.sweep_dir` for a
sweep's parent) and the process that keeps it (`dlpipe.owner`), so a run whose record is unreadable
is found in its store by its tags and judged the same way (runs_of_folder).

A run whose tracking process died while its training process goes on is the training process's
from then on: its writes go to the folder's outbox under its name (continue_outbox, keep_call).
"""

# Imported inside functions: mlflow (1-2 s), which a training process using sidecar_run never loads.
import json
import logging
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from dlpipe.errors import first_line
from dlpipe.machine.disk import write_atomic
from dlpipe.machine.lock_file import ProcessId
from dlpipe.redact import without_password
from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox, clipped, compared_params, set_aside, set_aside_for

log = logging.getLogger(__name__)

MARKER_FILE = "mlflow_run.json"
END_REASON_TAG = "dlpipe.end_reason"
OWNER_TAG = "dlpipe.owner"  # the process that keeps the run (Owner's fields, JSON): the run's own copy
FOLDER_TAGS = ("dlpipe.output_dir", "dlpipe.sweep_dir")  # the folder a run records itself in (absolute)
# The tracking process's `python -m` name (tracking.sidecar.MODULE), written out: the tracking process
# runs MlflowRun, which reads this module, so importing it here would close a circle (test_sidecar
# holds the copies equal).
SIDECAR_MODULE = "dlpipe.tracking.sidecar"
PREVIOUS_WAIT_S = 120.0  # for an earlier job's tracking process to end its run (wait_for_previous_tracking)


@dataclass(frozen=True)
class Owner(ProcessId):
    """The process that opened a run (its start time: a pid reused by another process is not the owner)."""

    @classmethod
    def from_dict(cls, data: dict) -> "Owner | None":
        try:
            return cls(str(data["host"]), int(data["pid"]), float(data["started"]))
        except (KeyError, TypeError, ValueError):
            return None  # written by an older dlpipe, or not at all

    def gone(self) -> str | None:
        """Why the process is known (or taken) to be gone; None while it runs."""
        running, here = self.running(), socket.gethostname()
        if running is None:
            return f"its process {self.pid} ran on host {self.host}, which cannot be checked from {here}"
        return None if running else f"its process {self.pid} on {self.host} is gone"

    def tag(self) -> dict[str, str]:
        """The run's own record of this owner (OWNER_TAG)."""
        return {OWNER_TAG: json.dumps(asdict(self))}

    @classmethod
    def of_run(cls, run) -> "Owner | None":
        """The owner a run's OWNER_TAG names (None without one)."""
        try:
            return cls.from_dict(json.loads(run.data.tags.get(OWNER_TAG, "")))
        except ValueError:
            return None


def write_marker(folder: Path, run_id: str, uri: str) -> None:
    """Record that this process opened `run_id`: written to a temporary file, synced to disk and
    renamed over the old record, so a kill or a full disk mid-write leaves the old one, never a torn
    one. A record that cannot be written costs only that check later: the run goes on."""
    bare = without_password(uri)
    record = {"run_id": run_id, "uri": bare, "password_removed": bare != uri, **asdict(Owner.this_process())}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        write_atomic(folder / MARKER_FILE, json.dumps(record) + "\n")
    except OSError as e:
        log.warning("cannot record MLflow run %s in %s (%s): if this job is killed outright, a later job "
                    "there will not end the run", run_id, folder, first_line(e))


def read_marker(folder: Path) -> dict | None:
    """The folder's record, or None (missing, or unreadable after a warning: see load_marker)."""
    try:
        return load_marker(folder)
    except ValueError as e:
        log.warning("%s", e)
        return None


def load_marker(folder: Path) -> dict | None:
    """The folder's record; None when it has none; ValueError (one line) when it is unreadable."""
    path = folder / MARKER_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} is unreadable ({first_line(e)})") from None
    if not isinstance(record, dict) or not isinstance(record.get("run_id"), str):
        raise ValueError(f"{path} is unreadable (no run id in it)")
    return record


def runs_of_folder(client, folder: Path) -> list:
    """The runs of every experiment of the store that record `folder` as theirs (FOLDER_TAGS),
    newest first: how a run is found when its folder's record is unreadable."""
    experiments = [e.experiment_id for e in client.search_experiments()]
    value = str(folder.absolute())
    quoted = f"'{value}'" if "'" not in value else f'"{value}"'
    runs = []
    for tag in FOLDER_TAGS:
        runs += client.search_runs(experiments, filter_string=f"tags.`{tag}` = {quoted}", max_results=1000)
    return sorted(runs, key=lambda r: r.info.start_time, reverse=True)


def end_if_abandoned(client, run_id: str, owner: Owner | None, other_hosts: bool = True) -> tuple[str, str]:
    """(status, what was found): a RUNNING run whose process is gone is ended KILLED here. With
    `other_hosts=False` (`dlpipe sync`, run anywhere, e.g. on a login node while the jobs run on
    compute nodes) a run whose process ran on another host is left RUNNING: it may still be running."""
    status = client.get_run(run_id).info.status
    if status != "RUNNING":
        return status, ""
    if owner is None:
        return status, "no record of the process that ran it"
    if not other_hosts and owner.host != socket.gethostname():
        return status, f"its process {owner.pid} runs or ran on host {owner.host}: run `dlpipe sync` there to end it"
    why = owner.gone()
    if why is None:
        return status, f"its process {owner.pid} on {owner.host} is still running"
    client.set_tag(run_id, END_REASON_TAG, f"found abandoned: {why}")
    client.set_terminated(run_id, "KILLED")
    return "KILLED", why


def close_previous(client, folder: Path, uri: str, resuming: str | None) -> None:
    """End the run an earlier job in `folder` left RUNNING, unless this job resumes it, its
    writes wait in the folder's outbox for `dlpipe sync`, or it lives in another store. With the
    folder's record unreadable, the runs of this store that record the folder as theirs are judged
    by their own tags instead (runs_of_folder)."""
    from mlflow.exceptions import MlflowException

    try:
        marker = load_marker(folder)
    except ValueError as e:
        log.warning("%s: looking for its run in the store by its tags", e)
        for run in runs_of_folder(client, folder):
            if run.info.status == "RUNNING" and run.info.run_id != resuming:
                _close(client, run.info.run_id, Owner.of_run(run))
        return
    if marker is None:
        return
    wait_for_previous_tracking(Owner.from_dict(marker))
    if marker["run_id"] == resuming:
        return
    run_id = marker["run_id"]
    if marker.get("uri") != without_password(uri):
        return  # another store's run: this job cannot see it
    if _outbox_run(folder) == run_id:
        log.warning("MLflow run %s of an earlier job here has writes waiting in %s: run `dlpipe sync %s` "
                    "to deliver them and end it", run_id, OUTBOX_FILE, folder)
        return
    try:
        _close(client, run_id, Owner.from_dict(marker))
    except MlflowException as e:  # deleted from the store since
        log.info("MLflow run %s of an earlier job here: %s", run_id, first_line(e))


def _close(client, run_id: str, owner: Owner | None) -> None:
    status, found = end_if_abandoned(client, run_id, owner)
    if status == "KILLED" and found:
        log.warning("MLflow run %s of an earlier job here was left RUNNING (%s): ended KILLED", run_id, found)
    elif status == "RUNNING":
        log.warning("MLflow run %s of an earlier job here is still RUNNING (%s): left as it is", run_id, found)


def wait_for_previous_tracking(owner: Owner | None, timeout_s: float = PREVIOUS_WAIT_S) -> None:
    """An earlier job's tracking process (tracking.sidecar) still at work here, ending the run of a
    training process that was killed (it waits up to tracking.offline_wait_s for an away server):
    wait for it to exit, so that two processes never write one run or one outbox."""
    if owner is None or not owner.running():  # gone, or on another host
        return
    try:
        proc = psutil.Process(owner.pid)
        if SIDECAR_MODULE not in proc.cmdline():
            return  # a training process of an older dlpipe, or another job's: close_previous decides
        log.info("waiting for the earlier job's tracking process (pid %d) to end its run", owner.pid)
        proc.wait(timeout_s)
    except psutil.NoSuchProcess:
        return  # it exited meanwhile
    except (psutil.AccessDenied, psutil.TimeoutExpired) as e:
        log.warning("the earlier job's tracking process (pid %d) is still running (%s): going on", owner.pid,
                    type(e).__name__)


def _outbox_run(folder: Path) -> str | None:
    path = folder / OUTBOX_FILE
    if not path.exists():
        return None
    try:
        return Outbox.load(path).run_id
    except (OSError, ValueError, KeyError):
        return None  # unreadable: `dlpipe sync` reports it


def continue_outbox(path: Path | None, uri: str, run_id: str) -> Outbox:
    """This process's outbox for the run: what the tracking process kept there in an outage of its
    own comes first (a last line torn by its death is dropped: that call was never answered, so it
    is kept again), then this process's writes, under this process's name, so `dlpipe sync` judges
    the run by this process. Written beside and renamed over the old file: a kill leaves one whole."""
    box = Outbox(uri, run_id, path, owner=asdict(Owner.this_process()))
    if path is None:
        return box
    earlier = []
    if path.exists():
        try:
            left = Outbox.load(path)
        except (OSError, ValueError, KeyError) as e:  # kept aside as it is, for whoever can read it
            log.warning("%s is unreadable (%s): moved to %s", path, first_line(e), set_aside(path))
        else:
            if left.run_id == run_id:
                earlier = left.entries
            else:  # another run's, as MlflowRun._take_over leaves it: for `dlpipe sync`
                set_aside_for(path, left.run_id)
    box.path = path.with_name(path.name + ".takeover")
    box.path.unlink(missing_ok=True)
    for entry in earlier:
        box.add(entry)
    box.tags(Owner.this_process().tag())  # the run's own record of its owner, updated by `dlpipe sync`
    if box.path.exists():
        box.path.replace(path)
    box.path = path
    return box


def keep_call(box: Outbox, call: str, args: tuple, resumed: bool) -> None:
    """A tracking-process call (tracking.sidecar) of a process that died, kept in `box` as the outbox
    entry `dlpipe sync` sends (Outbox.send) in its place; `resumed`: the run was reopened, so its
    params are compared with the first attempt's when delivered, as MlflowRun.log_params does."""
    if call == "write_rows":
        box.add({"metrics": [list(row) for row in args[0]]})  # (key, value, ms, step): Metric's order
    elif call == "set_tags":
        box.tags(clipped(args[0]))
    elif call in ("log_text", "log_inputs", "log_artifact"):
        getattr(box, {"log_text": "text", "log_inputs": "inputs", "log_artifact": "artifact"}[call])(*args)
    elif call == "end":
        if args[1]:
            box.tags({END_REASON_TAG: args[1]})
        box.end(args[0])
    elif call == "log_params":
        values = clipped(args[0])
        box.params(values, compared_params(values, resumed, args[1] if len(args) > 1 else None))
    elif call == "log_pytorch_model":
        Path(args[0]).unlink(missing_ok=True)
        log.warning("tracking.log_model: the MLflow PyTorch model was not logged (its tracking process died); "
                    "the run's checkpoints/ artifact holds its weights")
    # watch_system: MLflow's monitor ran in the process that died; open and prepare came before
