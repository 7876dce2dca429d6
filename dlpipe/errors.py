"""Errors a user can cause: each carries a one-line message naming the key, the value and what is allowed.

The CLI prints these without a traceback and exits non-zero before any training or tracking starts;
anything else is a bug and keeps its traceback.
"""


class DlpipeError(Exception):
    """Base class for user-facing errors (bad config, unusable data, unreachable tracking)."""


class ConfigError(DlpipeError):
    """One or more config values are invalid; the message lists every problem, one per line."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class DataError(DlpipeError):
    """A dataset cannot be built or read (missing folder, unreadable image, bad parameters)."""
