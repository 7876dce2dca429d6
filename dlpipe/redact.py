"""Keep secrets out of what a run records: params, tags, the resolved-config artifact and logs.

A config may hold a token or password (a dataset reading from object storage, a tracking URI with
credentials). Values under secret-looking keys are masked, and so is the password part of any
`scheme://user:password@host` URI, wherever it appears in a string (log records too, through
RedactingFilter). On disk a URI is kept without its password (`without_password`).
"""

import logging
import re

MASK = "***"
# Whole words of a key (split at _ - . and case changes), so `hf_token` is a secret and
# `max_tokens` or `tokenizer` are not.
_SECRET_WORDS = {"token", "password", "passwd", "pwd", "secret", "apikey", "credential", "credentials", "auth",
                 "authorization"}
_SECRET_PAIRS = {("api", "key"), ("private", "key"), ("access", "key")}
# The user part may be empty: `https://:TOKEN@host` is token-only authentication.
_URI_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)(?P<pw>[^@\s/]+)(?P<at>@)")
# The keys of a dict value on the command line (`+dataset.storage_options={key:X,secret:Y}`).
_VALUE_KEYS = re.compile(r"[{,]\s*['\"]?([A-Za-z_][\w\-]*)['\"]?\s*:")


def is_secret_key(key: str) -> bool:
    """True for keys like `token`, `db_password`, `aws_secret_access_key`, `api-key`, `apiKey`."""
    name = key.rsplit(".", 1)[-1]
    words = re.split(r"[_\-\s]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower())
    return any(w in _SECRET_WORDS for w in words) or any(pair in _SECRET_PAIRS for pair in zip(words, words[1:]))


def redact_text(text: str) -> str:
    """Mask the password of every `scheme://user:password@host` in a string."""
    return _URI_PASSWORD.sub(lambda m: m["head"] + MASK + m["at"], text)


def redact_overrides(overrides: list[str]) -> list[str]:
    """Command-line overrides with secret keys' values masked (`+dataset.api_key=***`) and URI
    passwords removed: for run names, tags and printed commands."""
    masked = []
    for override in overrides:
        key, eq, value = override.partition("=")
        # a secret key, or a dict value holding one (the whole value: its other entries may be keys too)
        keys = [key.lstrip("+~"), *_VALUE_KEYS.findall(value)]
        secret = eq and value and any(map(is_secret_key, keys))
        masked.append(f"{key}={MASK}" if secret else redact_text(override))
    return masked


def without_password(uri: str) -> str:
    """The URI with its password left out (`http://bob:pw@host` -> `http://bob@host`): what is
    stored on disk, where a mask would read as a real password."""
    return _URI_PASSWORD.sub(lambda m: m["head"][:-1] + m["at"], uri)


class RedactingFilter(logging.Filter):
    """Masks URI passwords in every record a handler writes (message, arguments and traceback):
    MLflow and its HTTP libraries put the tracking URI in their own messages."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact_text(message)
        if clean != message:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        return True


def redact_logging(logger: logging.Logger | None = None) -> None:
    """Put a RedactingFilter on every handler of `logger` (default: the root logger, where the
    console and the job's log file are); calling it again adds none twice."""
    for handler in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


def redact_tree(tree):
    """A copy of a plain config tree with secret keys masked and URI passwords removed."""
    if isinstance(tree, dict):
        return {k: MASK if is_secret_key(str(k)) and v is not None else redact_tree(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [redact_tree(v) for v in tree]
    if isinstance(tree, str):
        return redact_text(tree)
    return tree
