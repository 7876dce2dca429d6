"""`dlpipe sync DIR...`: deliver what runs kept while their tracking server was away, and end the
runs that killed processes left RUNNING.

A run that ended with the server still unreachable leaves `mlflow_outbox.jsonl` in its output
directory: metrics, tags, artifacts and its end status, in order. This sends them to the run they
belong to and removes the file; a run left RUNNING on the server gets its real end status. A run
whose process was killed before it could queue its end is ended KILLED when that process is gone
(tracking.abandoned); one whose process still runs is named, and the exit status is 1.

Every folder that holds a run records it (`mlflow_run.json`: a job's run, a sweep's parent), so a
run left RUNNING with nothing to deliver (`kill -9` of a sweep, or of a job and its tracking
process, while the store was up) is found the same way and ended KILLED once its process is gone.
A record that is unreadable is named in one line; its run is looked for by its tags
(tracking.abandoned.runs_of_folder) in the stores this sync knows of.
"""

import argparse
import logging
import os
import socket
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from dlpipe.errors import DlpipeError, first_line
from dlpipe.redact import redact_logging, redact_text, without_password
from dlpipe.tracking.abandoned import MARKER_FILE, Owner, end_if_abandoned, load_marker, read_marker, runs_of_folder
from dlpipe.tracking.client import client_for
from dlpipe.tracking.outbox import OUTBOX_FILE, OUTBOX_GLOB, DamagedOutbox, Outbox, connect_error, unreachable
from dlpipe.tracking.store_lock import sqlite_path

# Imported inside functions: mlflow (seconds), only once there is a run to deliver or end: `dlpipe sync --help`
# and a bad argument answer without it.

log = logging.getLogger("dlpipe")


def outboxes(paths: list[Path]) -> list[Path]:
    """The outbox files in the given run directories (searched recursively: a sweep's folder works)."""
    found = []
    for path in paths:
        if path.is_file():
            found.append(path)
        else:
            # with the outboxes of other runs a later job in that folder moved aside (MlflowRun._take_over)
            found.extend(sorted(path.rglob(OUTBOX_GLOB)))
    return found


def recorded(paths: list[Path]) -> list[Path]:
    """The folders under the given ones that record a run (MARKER_FILE: jobs, a sweep's parent)."""
    found = []
    for path in paths:
        found.extend(sorted(m.parent for m in path.rglob(MARKER_FILE)) if path.is_dir() else [])
    return found


DESCRIPTION = f"""Deliver what runs kept while their tracking server was away.

A run that ends with its MLflow server unreachable leaves {OUTBOX_FILE} in its output directory:
metrics, tags, artifacts and its end status, in order. This sends every one found in the given
directories to the run it belongs to and removes the file; a run left RUNNING on the server gets its
real end status, and a run whose process was killed is ended KILLED once that process is gone: also
a run with nothing to send, found by the {MARKER_FILE} its folder holds (a job's, a sweep's parent)."""

EPILOG = """examples:
  dlpipe sync outputs/                          every run under outputs/ (a sweep's folder works too)
  dlpipe sync outputs/DATE/TIME --uri http://127.0.0.1:5000

exit status: 0 all sent and ended (or nothing to do), 1 an outbox or a run record not done (each is
named), 2 a directory missing.
Guide: docs/tracking.md, "When the server or the store goes away"."""


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dlpipe sync", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="+", type=Path, help="run (or sweep) output directories")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    parser.add_argument("--uri", help="tracking URI to send to, credentials included (default: the one each "
                        "run used, with MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_URI for its password)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    redact_logging()
    missing = [str(d) for d in args.dirs if not d.exists()]
    if missing:
        print(f"dlpipe sync: error: {', '.join(missing)}: no such directory", file=sys.stderr)
        return 2
    found, folders = outboxes(args.dirs), recorded(args.dirs)
    if not found and not folders:
        print(f"dlpipe sync: nothing to send (no {OUTBOX_FILE} under {', '.join(map(str, args.dirs))})")
        return 0
    stores = Stores(args.uri, args.timeout)
    results = [sync_one(path, stores) for path in found]  # one bad box stops no other
    failed = [f"{n} of {len(found)} outboxes" for n in [sum(not ok for ok, _ in results)] if n]
    done = {run_id for _, run_id in results if run_id}
    checked = [end_recorded(folder, stores, done) for folder in folders]
    failed += [f"{n} of {len(folders)} run records" for n in [sum(not ok for ok in checked)] if n]
    if failed:
        print(f"dlpipe sync: error: {' and '.join(failed)} not done (see above)", file=sys.stderr)
    elif not found:
        print(f"dlpipe sync: nothing to send (no {OUTBOX_FILE} under {', '.join(map(str, args.dirs))}); "
              f"{len(folders)} runs recorded there ({MARKER_FILE}) checked")
    return 1 if failed else 0


class Stores:
    """The store of each run, opened once per URI (`--uri` wins), with the password put back."""

    def __init__(self, option: str | None, timeout: float):
        self.option, self.timeout = option, timeout
        self.clients: dict[str, object] = {}
        self.seen: list[tuple[str, bool]] = []  # (URI without password, password removed): known stores

    def open(self, uri: str, password_removed: bool, path: Path):
        """(client, URI as shown): raises StoreAway with the line to print when it cannot be used."""
        self.seen.append((uri, password_removed))
        target, note = target_uri(uri, password_removed, self.option, os.environ)
        if note and target not in self.clients:
            print(f"dlpipe sync: {path}: {note}", file=sys.stderr)
        shown = redact_text(target)
        db = sqlite_path(target)
        why = "does not exist" if db is not None and not db.exists() else connect_error(target, self.timeout)
        if why:
            raise StoreAway(f"tracking server {shown} unreachable ({why})" if db is None else f"store {shown} {why}")
        if target not in self.clients:
            try:
                self.clients[target] = client_for(target, self.timeout, 2)
            except DlpipeError as e:  # a half-made store, a store lock given up: this box only
                raise StoreAway(f"store {shown}: {first_line(e)}") from None
        return self.clients[target], shown


class StoreAway(Exception):
    """A store that cannot be reached or does not exist (the message says which and why)."""


def sync_one(path: Path, stores: Stores) -> tuple[bool, str | None]:
    """Deliver one outbox and end its run: (True, its run) or (False, after one line saying why
    anything is left; its run when that is known)."""
    from mlflow.exceptions import MlflowException

    try:
        box = Outbox.load(path)
    except DamagedOutbox as e:
        return _error(f"{e}; the file is kept as it is: remove or repair that line, then sync again"), None
    except (OSError, ValueError, KeyError) as e:
        return _error(f"{path}: unreadable ({first_line(e)}); left as it is"), None
    writer = _owner(box, path.parent)
    has_end = any("end" in entry for entry in box.entries)  # the run's last write: nothing follows it
    if not has_end and writer is not None and writer.host == socket.gethostname() and writer.gone() is None:
        # sending rewrites the file: lines its job appended meanwhile would be lost
        return _error(f"{path}: its job's process {writer.pid} still writes it and sends it itself once the store "
                      "is back; left to it (sync again once it has ended)"), box.run_id
    try:
        client, shown = stores.open(box.uri, box.password_removed, path)
    except StoreAway as e:
        return _error(f"{path}: {e}; kept"), box.run_id
    counts = box.counts()
    try:
        ended = box.send(client)
        status, found = (ended, "") if ended else end_if_abandoned(client, box.run_id, writer, other_hosts=False)
    except Exception as e:
        if not (unreachable(e) or isinstance(e, MlflowException)):
            raise
        return _error(f"{path}: run {box.run_id} at {shown}: {redact_text(first_line(e))[:300]}; "
                      f"what was not sent is kept"), box.run_id
    end = f", run ended {status}" + (f" ({found})" if found else "") if status != "RUNNING" else ""
    print(f"{path.parent}: sent {counts['metrics']} metrics and {counts['other writes']} other writes "
          f"to run {box.run_id} at {shown}{end}")
    if status == "RUNNING":
        return _error(f"{path.parent}: run {box.run_id} is still RUNNING: {found}"), box.run_id
    return True, box.run_id


def end_recorded(folder: Path, stores: Stores, done: set[str]) -> bool:
    """End the run `folder` records (MARKER_FILE) if it is RUNNING and its process is gone, unless
    its outbox was just synced (`done`); False after one line saying why it was not checked."""
    from mlflow.exceptions import MlflowException

    try:
        marker = load_marker(folder)
    except ValueError as e:
        return _find_by_tags(folder, str(e), stores)
    if marker is None or marker["run_id"] in done:
        return True
    run_id = marker["run_id"]
    try:
        client, _ = stores.open(marker["uri"], bool(marker.get("password_removed")), folder / MARKER_FILE)
        status, found = end_if_abandoned(client, run_id, Owner.from_dict(marker), other_hosts=False)
    except StoreAway as e:
        return _error(f"{folder}: run {run_id}: {e}; not checked")
    except Exception as e:
        if getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST":
            print(f"{folder}: run {run_id} is not in {redact_text(marker['uri'])} (deleted?): nothing to end")
            return True
        if not (unreachable(e) or isinstance(e, MlflowException)):
            raise
        return _error(f"{folder}: run {run_id}: {redact_text(first_line(e))[:300]}; not checked")
    if found:
        print(f"{folder}: run {run_id} " + (f"ended KILLED (found abandoned: {found})" if status == "KILLED"
                                            else f"is still RUNNING ({found}): left as it is"))
    return True


def _find_by_tags(folder: Path, unreadable: str, stores: Stores) -> bool:
    """A record that cannot be read: look for the folder's runs by their tags in every store this
    sync knows of (`--uri`, the other records' and outboxes', MLFLOW_TRACKING_URI, ./mlflow.db), and
    end the RUNNING ones whose process (the run's own dlpipe.owner tag) is gone. One line either way."""
    from mlflow.exceptions import MlflowException

    candidates = [(stores.option, False)] if stores.option else []
    candidates += [*stores.seen, (os.environ.get("MLFLOW_TRACKING_URI", ""), False)]
    candidates += [(f"sqlite:///{Path('mlflow.db').absolute()}", False)] if Path("mlflow.db").exists() else []
    said = []
    for uri, password_removed in dict.fromkeys((u, r) for u, r in candidates if u):
        try:
            client, shown = stores.open(uri, password_removed, folder / MARKER_FILE)
        except StoreAway as e:
            said.append(str(e))
            continue
        try:
            runs = runs_of_folder(client, folder)
        except MlflowException as e:  # one store that cannot be searched stops no other
            said.append(f"{shown}: {redact_text(first_line(e))[:200]}")
            continue
        if runs:
            ends = [_end_found(client, run) for run in runs]
            print(f"dlpipe sync: {unreadable}; found by its tags in {shown}: {'; '.join(ends)}", file=sys.stderr)
            return True
        said.append(f"no run of this folder in {shown}")
    return _error(f"{unreadable}; {'; '.join(said) or 'no store known to look in'}: pass --uri with the store "
                  "its run used")


def _end_found(client, run) -> str:
    run_id = run.info.run_id
    status, found = end_if_abandoned(client, run_id, Owner.of_run(run), other_hosts=False)
    if status == "KILLED" and found:
        return f"run {run_id} ended KILLED (found abandoned: {found})"
    return f"run {run_id} " + (f"is still RUNNING ({found})" if status == "RUNNING" else f"had ended {status}")


def target_uri(uri: str, password_removed: bool, option: str | None, environ) -> tuple[str, str | None]:
    """(where to send, a note when the password is missing): `--uri`; else MLFLOW_TRACKING_URI
    when it names the run's server; else the URI the run used (kept without its password), with
    MLFLOW_TRACKING_PASSWORD put back in when it had one."""
    if option:
        return option, None
    env_uri = environ.get("MLFLOW_TRACKING_URI", "")
    if env_uri and without_password(env_uri) == uri:
        return env_uri, None
    if not password_removed:
        return uri, None
    password = environ.get("MLFLOW_TRACKING_PASSWORD")
    if password:
        return with_password(uri, password), None
    return uri, ("its tracking URI had a password, which is not stored: sending without it "
                     "(set MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_URI, or pass --uri)")


def with_password(uri: str, password: str) -> str:
    """`http://bob@host` and a password -> `http://bob:<password, URL-quoted>@host`."""
    parts = urlsplit(uri)
    user, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def _owner(box: Outbox, folder: Path) -> Owner | None:
    """The process that wrote the outbox: from its first line, or the folder's run record."""
    owner = Owner.from_dict(box.owner)
    marker = read_marker(folder)
    if owner is None and marker is not None and marker["run_id"] == box.run_id:
        owner = Owner.from_dict(marker)
    return owner


def _error(line: str) -> bool:
    print(f"dlpipe sync: error: {line}", file=sys.stderr)
    return False
