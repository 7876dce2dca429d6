"""The benchmark scripts' command line: --rounds and --out, and the one-line refusal of a number out
of range. No torch here: the scripts that only start `dlpipe` processes (startup, the GPU case
study) import it too."""

import argparse
from pathlib import Path


def arguments(doc: str, rounds: int, rounds_help: str) -> argparse.ArgumentParser:
    """A benchmark's command line, described by its docstring's first paragraph, with --rounds and
    --out; the script adds its own options."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (default {rounds})")
    p.add_argument("--out", type=Path, help="also write the markdown report to this file")
    return p


def checked(p: argparse.ArgumentParser, argv, counts: tuple[str, ...] = (), positive: tuple[str, ...] = (),
            non_negative: tuple[str, ...] = ()) -> argparse.Namespace:
    """The parsed arguments; --rounds and the `counts` below 1, `positive` values not above 0 and
    `non_negative` ones below 0 are refused in one line naming the option (an option not given, None,
    is left alone)."""
    args = p.parse_args(argv)
    rules = ((("rounds", *counts), lambda v: v >= 1, ">= 1"), (positive, lambda v: v > 0, "> 0"),
             (non_negative, lambda v: v >= 0, ">= 0"))
    for names, allowed, rule in rules:
        for name in names:
            value = getattr(args, name)
            if value is not None and not allowed(value):
                p.error(f"--{name.replace('_', '-')}={value}: must be {rule}")
    return args


def worker_counts(p: argparse.ArgumentParser, text: str, least: int, example: str) -> list[int]:
    """--workers as a list of counts (comma-separated, each >= `least`), or a one-line refusal."""
    try:
        counts = [int(w) for w in text.split(",")]
    except ValueError:
        p.error(f"--workers={text}: comma-separated counts, e.g. {example}")
    if any(w < least for w in counts):
        p.error(f"--workers={text}: counts must be >= {least}")
    return counts
