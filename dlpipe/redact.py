"""Keep secrets out of what a run records: params, tags, the resolved-config artifact and logs.

A config may hold a token or password (a dataset reading from object storage, a tracking URI with
credentials). Values under secret-looking keys are masked, and so is the password part of any
`scheme://user:password@host` URI, wherever it appears in a string (log records too, through
RedactingFilter). On disk a URI is kept without its password (`without_password`).
"""

import logging
import re
import sys

MASK = "***"
# Whole words of a key (split at _ - . and case changes), so `hf_token` is a secret and
# `max_tokens` or `tokenizer` are not.
_SECRET_WORDS = {"token", "password", "passwd", "pwd", "secret", "apikey", "credential", "credentials", "auth",
                 "authorization"}
_SECRET_PAIRS = {("api", "key"), ("private", "key"), ("access", "key")}
# The user part may be empty: `https://:TOKEN@host` is token-only authentication.
_URI_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s:@]*:)(?P<pw>[^@\s/]+)(?P<at>@)")
_ENV_READ = re.compile(r"\$\{oc\.env:[A-Za-z_]\w*\}")
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
        # a secret key or one under a secret key (`+dataset.credentials.user`: redact_tree masks the whole
        # node), or a dict value holding one (the whole value: its other entries may be keys too)
        keys = [*key.lstrip("+~").split("."), *_VALUE_KEYS.findall(value)]
        # `${oc.env:HF_TOKEN}` holds no secret, only where to read one (docs/configuration.md's advice): kept, so a
        # printed command that carries it still works
        secret = eq and value and not _ENV_READ.fullmatch(value) and any(map(is_secret_key, keys))
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


# The flags that make Hydra print the composed config (and exit) instead of running the job.
PRINTS_CONFIG = ("--cfg", "-c", "--info", "-i", "--help", "-h")
_YAML_KEY = re.compile(r"^(?P<lead>\s*(?:-\s+)?)(?P<key>[A-Za-z_][\w\-]*):(?P<rest>\s.*)?$")
_YAML_ITEM = re.compile(r"^(?P<lead>\s*-\s+)(?P<item>'?[+~]*[A-Za-z_][\w.\-/]*=.*)$")
_ASSIGNED_KEYS = re.compile(r"([A-Za-z_][\w\-]*)\s*[=:]")


class RedactingStream:
    """Stdout for Hydra's `--cfg`, `--info` and `--help`: the config's secrets masked line by line as
    redact_tree masks them (a secret key's value, a whole nested one included, and URI passwords), so
    `--cfg job` stays YAML that loads, with '***' as the values. Interpolations are shown: they hold
    no secret, only where to read one."""

    def __init__(self, stream):
        self._stream, self._pending = stream, ""
        self._masked_at: int | None = None  # the indent of a secret key whose nested value is left out

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        for line in lines:
            clean = self._line(line)
            if clean is not None:
                self._stream.write(clean + "\n")
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._line(self._pending) or "")
            self._pending = ""
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)

    def _line(self, line: str) -> str | None:
        """The line with its secret masked, or None for a line of a masked nested value."""
        indent = len(line) - len(line.lstrip())
        if self._masked_at is not None and line.strip():
            # nested under the key, or a list at its indent (PyYAML does not indent a mapping's lists)
            if indent > self._masked_at or (indent == self._masked_at and line.lstrip().startswith("- ")):
                return None
            self._masked_at = None
        key, item = _YAML_KEY.match(line), _YAML_ITEM.match(line)
        if key and is_secret_key(key["key"]):
            value = (key["rest"] or "").strip()
            if value in ("null", "~") or value.lstrip("'\"").startswith("${"):
                return line
            if not value:
                self._masked_at = len(key["lead"])
            return f"{key['lead']}{key['key']}: '{MASK}'"
        if key and "=" in (key["rest"] or "") and any(map(is_secret_key, _ASSIGNED_KEYS.findall(key["rest"]))):
            return f"{key['lead']}{key['key']}: '{MASK}'"  # overrides joined in one value (override_dirname)
        if item:  # an override in Hydra's record (`--cfg all`): masked as in the run's tags
            text = item["item"]
            quoted = len(text) > 1 and text[0] == text[-1] == "'"
            masked = redact_overrides([text[1:-1].replace("''", "'") if quoted else text])[0]
            return item["lead"] + ("'" + masked.replace("'", "''") + "'" if quoted else masked)
        return redact_text(line)


def redact_printed_config(argv: list[str]) -> None:
    """When argv asks Hydra to print the config instead of running, print it through a RedactingStream."""
    if any(arg.partition("=")[0] in PRINTS_CONFIG for arg in argv):
        sys.stdout = RedactingStream(sys.stdout)
