"""Runs whose process died without ending them (kill -9, the OOM killer, a lost node): found and ended.

A process killed outright cannot end its MLflow run, which would stay RUNNING for ever. In
training the run is kept by a tracking process (tracking.sidecar) that ends it when the training
process dies; this covers the rest: both killed, or a task that keeps its run in its own process.
Each job records, in its output folder, which run it opened and which process keeps it
(`mlflow_run.json`: run id, tracking URI without its password, host, pid, process start time). A later job in the same
folder, and `dlpipe sync`, read it: a run still RUNNING whose process is gone is ended KILLED, with
`dlpipe.end_reason` saying it was found abandoned. A process on another host cannot be checked
from here; it is taken as gone (an output folder is one job's at a time) and the reason says so.
"""

import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from dlpipe.errors import first_line
from dlpipe.redact import without_password
from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox
from dlpipe.tracking.sidecar import MODULE as SIDECAR_MODULE

log = logging.getLogger(__name__)

MARKER_FILE = "mlflow_run.json"
END_REASON_TAG = "dlpipe.end_reason"
PREVIOUS_WAIT_S = 120.0  # for an earlier job's tracking process to end its run (wait_for_previous_tracking)


@dataclass(frozen=True)
class Owner:
    """The process that opened a run."""

    host: str
    pid: int
    started: float  # the process's start time: a pid reused by another process is not the owner

    @classmethod
    def this_process(cls) -> "Owner":
        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time())

    @classmethod
    def from_dict(cls, data: dict) -> "Owner | None":
        try:
            return cls(str(data["host"]), int(data["pid"]), float(data["started"]))
        except (KeyError, TypeError, ValueError):
            return None  # written by an older dlpipe, or not at all

    def gone(self) -> str | None:
        """Why the process is known (or taken) to be gone; None while it runs."""
        here = socket.gethostname()
        if self.host != here:
            return f"its process {self.pid} ran on host {self.host}, which cannot be checked from {here}"
        try:
            proc = psutil.Process(self.pid)
            alive = proc.status() != psutil.STATUS_ZOMBIE and abs(proc.create_time() - self.started) < 1
        except psutil.NoSuchProcess:
            alive = False
        except psutil.AccessDenied:
            alive = True  # it exists, as another user's process: not ours to judge
        return None if alive else f"its process {self.pid} on {self.host} is gone"


def write_marker(folder: Path, run_id: str, uri: str) -> None:
    """Record that this process opened `run_id` (atomically: a kill mid-write leaves the old one).
    A record that cannot be written costs only that check later: the run goes on."""
    record = {"run_id": run_id, "uri": without_password(uri), **asdict(Owner.this_process())}
    tmp = folder / (MARKER_FILE + ".tmp")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record) + "\n")
        tmp.replace(folder / MARKER_FILE)
    except OSError as e:
        log.warning("cannot record MLflow run %s in %s (%s): if this job is killed outright, a later job "
                    "there will not end the run", run_id, folder, first_line(e))


def read_marker(folder: Path) -> dict | None:
    path = folder / MARKER_FILE
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("%s is unreadable (%s): the run it names is not checked", path, first_line(e))
        return None
    return record if isinstance(record, dict) and "run_id" in record else None


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
    writes wait in the folder's outbox for `dlpipe sync`, or it lives in another store."""
    from mlflow.exceptions import MlflowException

    marker = read_marker(folder)
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
        status, found = end_if_abandoned(client, run_id, Owner.from_dict(marker))
    except MlflowException as e:  # deleted from the store since
        log.info("MLflow run %s of an earlier job here: %s", run_id, first_line(e))
        return
    if status == "KILLED" and found:
        log.warning("MLflow run %s of an earlier job here was left RUNNING (%s): ended KILLED", run_id, found)
    elif status == "RUNNING":
        log.warning("MLflow run %s of an earlier job here is still RUNNING (%s): left as it is", run_id, found)


def wait_for_previous_tracking(owner: Owner | None, timeout_s: float = PREVIOUS_WAIT_S) -> None:
    """An earlier job's tracking process (tracking.sidecar) still at work here, ending the run of a
    training process that was killed (it waits up to tracking.offline_wait_s for an away server):
    wait for it to exit, so that two processes never write one run or one outbox."""
    if owner is None or owner.host != socket.gethostname() or owner.gone() is not None:
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
