"""`dlpipe sync DIR...`: deliver what runs kept while their tracking server was away.

A run that ended with the server still unreachable leaves `mlflow_outbox.jsonl` in its output
directory: metrics, tags, artifacts and its end status, in order. This sends them to the run they
belong to and removes the file; a run left RUNNING on the server gets its real end status. A run
whose process was killed before it could queue its end is ended KILLED when that process is gone
(tracking.abandoned); one whose process still runs is named, and the exit status is 1.
"""

import argparse
import logging
import os
import sys
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from dlpipe.errors import first_line
from dlpipe.redact import redact_logging, redact_text, without_password
from dlpipe.tracking.abandoned import Owner, end_if_abandoned, read_marker
from dlpipe.tracking.outbox import OUTBOX_FILE, OUTBOX_GLOB, Outbox, connect_error, unreachable

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


DESCRIPTION = f"""Deliver what runs kept while their tracking server was away.

A run that ends with its MLflow server unreachable leaves {OUTBOX_FILE} in its output directory:
metrics, tags, artifacts and its end status, in order. This sends every one found in the given
directories to the run it belongs to and removes the file; a run left RUNNING on the server gets its
real end status, and a run whose process was killed is ended KILLED once that process is gone."""

EPILOG = """examples:
  dlpipe sync outputs/                          every run under outputs/ (a sweep's folder works too)
  dlpipe sync outputs/DATE/TIME --uri http://127.0.0.1:5000

exit status: 0 all sent (or nothing to send), 1 an outbox not done (each is named), 2 a directory missing.
Guide: README.md, "Tracking"."""


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
    found = outboxes(args.dirs)
    if not found:
        print(f"dlpipe sync: nothing to send (no {OUTBOX_FILE} under {', '.join(map(str, args.dirs))})")
        return 0
    failed = [path for path in found if not sync_one(path, args.uri, args.timeout)]  # one bad box stops no other
    if failed:
        print(f"dlpipe sync: error: {len(failed)} of {len(found)} outboxes not done (see above)", file=sys.stderr)
    return 1 if failed else 0


def sync_one(path: Path, uri_option: str | None, timeout: float) -> bool:
    """Deliver one outbox and end its run; False (after one line saying why) when anything is left."""
    from mlflow.exceptions import MlflowException

    from dlpipe.tracking.client import client_for

    try:
        box = Outbox.load(path)
    except (OSError, ValueError, KeyError) as e:
        return _error(f"{path}: unreadable ({first_line(e)}); left as it is")
    uri, note = target_uri(box, uri_option, os.environ)
    if note:
        print(f"dlpipe sync: {path}: {note}", file=sys.stderr)
    shown = redact_text(uri)
    why = connect_error(uri, timeout)
    if why:
        return _error(f"{path}: tracking server {shown} unreachable ({why}); kept")
    counts = box.counts()
    try:
        client = client_for(uri, timeout, 2)
        ended = box.send(client)
        status, found = (ended, "") if ended else end_if_abandoned(client, box.run_id, _owner(box, path.parent),
                                                                   other_hosts=False)
    except Exception as e:
        if not (unreachable(e) or isinstance(e, MlflowException)):
            raise
        return _error(f"{path}: run {box.run_id} at {shown}: {redact_text(first_line(e))[:300]}; "
                      f"what was not sent is kept")
    end = f", run ended {status}" + (f" ({found})" if found else "") if status != "RUNNING" else ""
    print(f"{path.parent}: sent {counts['metrics']} metrics and {counts['other writes']} other writes "
          f"to run {box.run_id} at {shown}{end}")
    if status == "RUNNING":
        return _error(f"{path.parent}: run {box.run_id} is still RUNNING: {found}")
    return True


def target_uri(box: Outbox, option: str | None, environ) -> tuple[str, str | None]:
    """(where to send, a note when the password is missing): `--uri`; else MLFLOW_TRACKING_URI
    when it names the run's server; else the URI the run used (kept without its password), with
    MLFLOW_TRACKING_PASSWORD put back in when it had one."""
    if option:
        return option, None
    env_uri = environ.get("MLFLOW_TRACKING_URI", "")
    if env_uri and without_password(env_uri) == box.uri:
        return env_uri, None
    if not box.password_removed:
        return box.uri, None
    password = environ.get("MLFLOW_TRACKING_PASSWORD")
    if password:
        return with_password(box.uri, password), None
    return box.uri, ("its tracking URI had a password, which is not stored: sending without it "
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
