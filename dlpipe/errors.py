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

    def __reduce__(self):
        # Launchers (submitit, joblib) pickle a failed job's exception; the default reduce would
        # call ConfigError(message) and split the message into characters.
        return (type(self), (self.problems,))


class DataError(DlpipeError):
    """A dataset cannot be built or read (missing folder, unreadable image, bad parameters)."""


def causes(exc: BaseException | None):
    """`exc` and the exceptions behind it (`__cause__`, else `__context__`), outermost first; each
    once, so a cycle in the chain ends the walk."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


def user_message(exc: BaseException) -> list[str]:
    """The lines to show a user for `exc`, without the worker traceback PyTorch wraps around it.

    An exception raised in a DataLoader worker is re-raised in the main process as the same type
    with the message "Caught X in DataLoader worker process N.\\nOriginal Traceback ...\\nX: msg".
    """
    text = str(exc)
    if text.startswith("Caught ") and "Original Traceback" in text:
        where = text.splitlines()[0].removeprefix("Caught ").rstrip(".")
        last = text.rstrip().splitlines()[-1]
        name = type(exc).__module__ + "." + type(exc).__name__
        for prefix in (name + ": ", type(exc).__name__ + ": "):
            last = last.removeprefix(prefix)
        return [f"{last} ({where.split(' in ', 1)[-1]})"]
    return text.splitlines() or [type(exc).__name__]
