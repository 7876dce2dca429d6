"""What a run could not send to its tracking server, kept in order until the server is back.

A tracking server that goes away mid-run must not stop training or lose a metric. MlflowRun puts
every write it could not deliver here; each one is also appended to a JSON-lines file in the run's
output directory, so even a process that dies while the server is away leaves a complete record.
`dlpipe sync DIR` replays that file once the server is reachable again.
"""

# Imported inside functions: mlflow (1-2 s), requests, sqlite3: off a training process using sidecar_run.
import json
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from dlpipe.errors import causes, first_line
from dlpipe.machine.disk import write_atomic, write_failure
from dlpipe.redact import without_password
from dlpipe.tracking.dataset_input import log_inputs
from dlpipe.tracking.http_probe import http_silence

log = logging.getLogger(__name__)

OUTBOX_FILE = "mlflow_outbox.jsonl"
OUTBOX_GLOB = "mlflow_outbox*.jsonl"  # and mlflow_outbox.<run id>.jsonl: an earlier run's, moved aside
MAX_METRICS_PER_BATCH = 1000  # MLflow's log_batch limits
MAX_PARAMS_PER_BATCH = 100
# SQLite's words for a store that cannot take a write now but can later, once space is freed,
# another process lets go of its lock or the mount is writable again: an outage, like a server's.
LOCAL_STORE_FAULTS = ("database or disk is full", "database is locked", "attempt to write a readonly database",
                      "disk I/O error", "unable to open database file")


def unreachable(exc: BaseException) -> bool:
    """True when `exc` means the store could not take the write now (a server refused, timed out,
    reset, 5xx after retries; a SQLite store full, locked or read-only), as opposed to the store
    answering that a request is wrong."""
    import sqlite3

    import requests
    from mlflow.exceptions import MlflowException, RestException

    if isinstance(exc, RestException):
        return False  # the server answered: the request itself is at fault
    for seen in causes(exc):
        if isinstance(seen, (OSError, requests.RequestException)):
            return True
        if isinstance(seen, sqlite3.OperationalError) and any(fault in str(seen) for fault in LOCAL_STORE_FAULTS):
            return True
    # MLflow wraps a failed request in a bare MlflowException without chaining it in some paths
    return isinstance(exc, MlflowException) and str(exc).startswith("API request to")


def outage_reason(exc: BaseException) -> str:
    """The line that says why a write failed: SQLite's own words when a local store refused it
    (MLflow wraps them in a paragraph whose first line is about autoflush), else the first line."""
    import sqlite3

    refused = next((e for e in causes(exc) if isinstance(e, sqlite3.OperationalError)), None)
    return f"{type(refused).__name__}: {refused}" if refused is not None else first_line(exc)


def set_aside(path: Path) -> Path:
    """Move an outbox that cannot be read out of a new run's way, under a name `dlpipe sync` still
    finds (OUTBOX_GLOB) and reports every time, never over one set aside before."""
    for n in range(1, 10_000):
        aside = path.with_name(f"{path.stem}.unreadable-{n}{path.suffix}")
        if not aside.exists():
            path.replace(aside)
            return aside
    raise FileExistsError(f"{path}: 9999 unreadable outboxes set aside beside it already")


def set_aside_for(path: Path, run_id: str) -> Path:
    """Move another run's outbox out of this run's way, as mlflow_outbox.<run id>.jsonl, which
    `dlpipe sync` sends to that run: two runs' writes never share a file."""
    aside = path.with_name(f"{path.stem}.{run_id}{path.suffix}")
    path.replace(aside)
    return aside


class DamagedOutbox(ValueError):
    """A line before an outbox's last is no complete write: the file was damaged, not cut by a kill."""


MAX_PARAM_CHARS = 6000  # MLflow 3's param value limit (tags are cut to it too)


def clipped(values: dict[str, object]) -> dict[str, str]:
    """Param or tag values as MLflow takes them: text, cut to MAX_PARAM_CHARS."""
    texts = {k: str(v) for k, v in values.items()}
    return {k: t if len(t) <= MAX_PARAM_CHARS else t[: MAX_PARAM_CHARS - 3] + "..." for k, t in texts.items()}


def compared_params(values: dict[str, str], resumed: bool,
                    compared: dict[str, list[str]] | None) -> dict[str, list[str]] | None:
    """What send_params compares: nothing on a new run; on a reopened run `compared`, by default
    every key under dlpipe.resumed_changed_params."""
    if not resumed:
        return None
    return {"dlpipe.resumed_changed_params": list(values)} if compared is None else compared


def send_params(client, run_id: str, params: dict[str, str], compared: dict[str, list[str]] | None) -> None:
    """Log `params` (values already clipped to MLflow's limit), in MLflow-sized batches, each batch's
    keys removed from `params` once sent (a retry after a failure part-way sends only the rest).

    With `compared` (a reopened run: tag -> keys), the run's params are read first: MLflow params
    cannot change, so only new ones are logged, and each tag names those of its keys whose values
    differ from the run's first attempt. Done here, when the params are delivered, rather than when
    they were logged: a run reopened while its server is away is compared once it is back, since a
    changed value sent blind would be refused and stop the whole delivery.
    """
    from mlflow.entities import Param, RunTag

    if compared is not None:
        logged = client.get_run(run_id).data.params
        changed = {tag: sorted(k for k in keys if k in logged and k in params and logged[k] != params[k])
                   for tag, keys in compared.items()}
        if any(changed.values()):
            client.log_batch(run_id, tags=[RunTag(tag, ", ".join(keys)) for tag, keys in changed.items() if keys])
        for key in [k for k in params if k in logged]:
            del params[key]
    while params:
        batch = sorted(params)[:MAX_PARAMS_PER_BATCH]
        client.log_batch(run_id, params=[Param(k, params[k]) for k in batch])
        for key in batch:
            del params[key]


def connect_error(uri: str, timeout_s: float) -> str | None:
    """Why an http(s) tracking URI cannot be reached (None when it answers HTTP: tracking.http_probe).

    A connect costs nothing when the port is closed and at most `timeout_s` when packets go
    nowhere, so it answers long before an MLflow request with retries would. Other stores (SQLite,
    files) are local: None.
    """
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=timeout_s) as conn:
            return http_silence(conn, parts, timeout_s)
    except TimeoutError:
        return f"no answer from {parts.hostname}:{port} within {timeout_s:g} s"
    except OSError as e:
        return f"{parts.hostname}:{port}: {e.strerror or e}"


def described(counts: dict[str, int]) -> str:
    """Outbox.counts() in words: `3 metrics, 2 other writes`."""
    return ", ".join(f"{n} {what}" for what, n in counts.items())


@dataclass
class Outbox:
    """Undelivered writes of one run, in the order they were made."""

    uri: str  # as given; the file keeps it without its password
    run_id: str
    path: Path | None = None
    entries: list[dict] = field(default_factory=list)
    owner: dict = field(default_factory=dict)  # the writing process (tracking.abandoned.Owner's fields)
    password_removed: bool = False  # loaded from a file whose URI had a password: `dlpipe sync` needs it
    file_error: str | None = None  # why the file could not be written last time (see add)

    def head(self) -> dict:
        """The file's first line: where the entries belong and who wrote them (no password)."""
        uri = without_password(self.uri)
        return {"uri": uri, "run_id": self.run_id, "password_removed": self.password_removed or uri != self.uri,
                **self.owner}

    def add(self, entry: dict) -> None:
        """Keep `entry` in memory and append it to the file. A file that cannot be written (its disk
        is full too) must not stop training: the entries stay in memory, and the next add rewrites
        the whole file, since the append that failed may have left a torn line."""
        self.entries.append(entry)
        if self.path is None:
            return
        try:
            if self.file_error is not None:
                self._rewrite()
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                # owner-only (0600): the entries may be as private as the run itself
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                with os.fdopen(fd, "a") as f:
                    if f.tell() == 0:  # the first line says where the entries belong
                        f.write(json.dumps(self.head()) + "\n")
                    f.write(json.dumps(entry) + "\n")
        except OSError as e:
            self.path.with_suffix(".tmp").unlink(missing_ok=True)  # a rewrite that failed half-way
            if self.file_error is None:
                log.warning("%s cannot be written (%s): the writes not yet delivered are kept in memory and "
                            "written there once it can be", self.path, write_failure(e, self.path))
            self.file_error = str(e)
            return
        if self.file_error is not None:
            log.warning("%s written again: it holds every write not yet delivered", self.path)
            self.file_error = None

    def metrics(self, metrics: list) -> None:
        if metrics:
            self.add({"metrics": [[m.key, m.value, m.timestamp, m.step] for m in metrics]})

    def params(self, params: dict[str, str], compared: dict[str, list[str]] | None) -> None:
        """Params not yet delivered; `compared`: see send_params (a reopened run's comparison, made at delivery)."""
        self.add({"params": params, **({"compared": compared} if compared is not None else {})})

    def tags(self, tags: dict[str, str]) -> None:
        self.add({"tags": tags})

    def text(self, text: str, artifact_file: str) -> None:
        self.add({"text": text, "artifact_file": artifact_file})

    def inputs(self, described: dict) -> None:
        self.add({"inputs": described})

    def artifact(self, path, artifact_path: str | None) -> None:
        self.add({"artifact": str(path), "artifact_path": artifact_path})

    def end(self, status: str) -> None:
        self.add({"end": status})

    def counts(self) -> dict[str, int]:
        return {
            "metrics": sum(len(e["metrics"]) for e in self.entries if "metrics" in e),
            "other writes": sum(1 for e in self.entries if "metrics" not in e),
        }

    def kept_for_sync(self, status: str) -> str:
        """The end of a job's last line when the run's end (`status`) is kept here, with its other
        writes: what is kept, where, and the command that sends them."""
        return (f"{described(self.counts())} and the run's end ({status}) are kept in {self.kept_where()}; "
                f"send them with: dlpipe sync {self.path.parent if self.path else ''}")

    def kept_where(self) -> str:
        if self.path is None:
            return "memory (lost at exit)"
        if self.file_error is not None:
            return f"memory only, lost at exit ({self.path} cannot be written: {self.file_error})"
        return str(self.path)

    def send(self, client) -> str | None:
        """Deliver every entry in order with `client`; return the end status if one was queued.

        Entries are dropped as they are delivered, so a failure part-way through (the server went
        away again) leaves exactly the undelivered ones, and the file is rewritten to match.
        """
        from mlflow.entities import Metric, RunTag

        ended = None
        try:
            while self.entries:
                entry = self.entries[0]
                if "metrics" in entry:
                    while entry["metrics"]:
                        batch = entry["metrics"][:MAX_METRICS_PER_BATCH]
                        client.log_batch(self.run_id, metrics=[Metric(*row) for row in batch])
                        # a batch sent is removed, so a retry after a failure never repeats it
                        entry["metrics"] = entry["metrics"][MAX_METRICS_PER_BATCH:]
                elif "params" in entry:
                    send_params(client, self.run_id, entry["params"], entry.get("compared"))
                elif "tags" in entry:
                    client.log_batch(self.run_id, tags=[RunTag(k, v) for k, v in entry["tags"].items()])
                elif "text" in entry:
                    client.log_text(self.run_id, entry["text"], entry["artifact_file"])
                elif "inputs" in entry:
                    log_inputs(client, self.run_id, entry["inputs"])
                elif "artifact" in entry:
                    if Path(entry["artifact"]).exists():
                        client.log_artifact(self.run_id, entry["artifact"], entry["artifact_path"])
                    else:
                        log.warning("%s no longer exists: not sent", entry["artifact"])
                elif "end" in entry:
                    client.set_terminated(self.run_id, entry["end"])
                    ended = entry["end"]
                self.entries.pop(0)
        finally:
            self._rewrite()
        return ended

    def _rewrite(self) -> None:
        if self.path is None:
            return
        if not self.entries:
            self.path.unlink(missing_ok=True)
            return
        lines = [self.head(), *self.entries]
        write_atomic(self.path, "".join(json.dumps(line) + "\n" for line in lines), mode=0o600)  # holds a URI

    @classmethod
    def load(cls, path: Path) -> "Outbox":
        """The outbox a run left in `path`. A torn last line is what a kill mid-write leaves: skipped,
        with a note. A bad line before it is damage to the file: DamagedOutbox."""
        lines = path.read_text().splitlines()
        if not lines:
            raise ValueError(f"{path} is empty")
        head = json.loads(lines[0])
        entries = []
        for number, line in enumerate(lines[1:], start=2):
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                if number < len(lines):  # sending around it would deliver the run's writes with a hole
                    raise DamagedOutbox(f"{path}:{number} is damaged ({first_line(e)}): not a write dlpipe made, "
                                        "and not the last line") from None
                log.warning("%s:%d is incomplete (the process was killed while writing it): skipped", path, number)
        owner = {k: head[k] for k in ("host", "pid", "started") if k in head}
        return cls(head["uri"], head["run_id"], path, entries, owner, bool(head.get("password_removed")))
