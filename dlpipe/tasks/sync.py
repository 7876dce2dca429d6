"""`dlpipe sync DIR...`: deliver what runs kept while their tracking server was away.

A run that ended with the server still unreachable leaves `mlflow_outbox.jsonl` in its output
directory: metrics, tags, artifacts and its end status, in order. This sends them to the run they
belong to and removes the file; a run left RUNNING on the server gets its real end status.
"""

import argparse
import logging
import sys
from pathlib import Path

from dlpipe.redact import redact_text
from dlpipe.tracking.outbox import OUTBOX_FILE, Outbox, connect_error

log = logging.getLogger("dlpipe")


def outboxes(paths: list[Path]) -> list[Path]:
    """The outbox files in the given run directories (searched recursively: a sweep's folder works)."""
    found = []
    for path in paths:
        if path.is_file():
            found.append(path)
        else:
            found.extend(sorted(path.rglob(OUTBOX_FILE)))
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="dlpipe sync", description=__doc__.splitlines()[0])
    parser.add_argument("dirs", nargs="+", type=Path, help="run (or sweep) output directories")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(levelname)s] %(message)s")
    from dlpipe.tracking.run import client_for

    missing = [str(d) for d in args.dirs if not d.exists()]
    if missing:
        print(f"dlpipe sync: error: {', '.join(missing)}: no such directory", file=sys.stderr)
        return 2
    found = outboxes(args.dirs)
    if not found:
        print(f"dlpipe sync: nothing to send (no {OUTBOX_FILE} under {', '.join(map(str, args.dirs))})")
        return 0
    failed = 0
    for path in found:
        box = Outbox.load(path)
        uri = redact_text(box.uri)
        why = connect_error(box.uri, args.timeout)
        if why:
            print(f"dlpipe sync: error: {path}: tracking server {uri} unreachable ({why}); kept", file=sys.stderr)
            failed += 1
            continue
        counts = box.counts()
        ended = box.send(client_for(box.uri, args.timeout, 2))
        end = f", run ended {ended}" if ended else ""
        print(f"{path.parent}: sent {counts['metrics']} metrics and {counts['other writes']} other writes "
              f"to run {box.run_id} at {uri}{end}")
    return 1 if failed else 0
