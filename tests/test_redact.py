"""Secrets never reach params, tags, artifacts, the store, the output folder or the logs."""

import io
import logging

import pytest
import yaml
from conftest import runs_of

from dlpipe.redact import (
    MASK,
    is_secret_key,
    redact_logging,
    redact_overrides,
    redact_text,
    redact_tree,
    without_password,
)


@pytest.mark.parametrize("key", ["token", "hf_token", "db_password", "passwd", "aws_secret_access_key",
                                 "api_key", "API-KEY", "apiKey", "credentials", "dataset.auth"])
def test_secret_keys(key):
    """Keys named like secrets are recognised, including with prefixes and in dotted paths."""
    assert is_secret_key(key)


@pytest.mark.parametrize("key", ["batch_size", "num_workers", "vocab_size", "uri", "max_tokens", "tokenizer", "author"])
def test_ordinary_keys(key):
    """Ordinary keys are left alone."""
    assert not is_secret_key(key)


def test_uri_passwords_are_masked_everywhere_in_a_string():
    """The password part of a URI is masked; user, host, path and other text survive."""
    text = "tracking.uri=https://alice:s3cr3t@mlflow.example:5000/x and postgresql://bob:pw@db/mlflow"
    out = redact_text(text)
    assert "s3cr3t" not in out and ":pw@" not in out
    assert f"https://alice:{MASK}@mlflow.example:5000/x" in out and f"postgresql://bob:{MASK}@db/mlflow" in out
    assert redact_text("sqlite:///mlflow.db") == "sqlite:///mlflow.db"


def test_tree_masks_values_under_secret_keys():
    """Nested config: secret keys masked, URIs cleaned, everything else unchanged, input not modified."""
    tree = {"dataset": {"root": "s3://bucket/x", "token": "abc", "opts": [{"password": "p"}]},
            "tracking": {"uri": "http://u:p@host"}, "n": 3, "empty_token": None}
    out = redact_tree(tree)
    assert out == {"dataset": {"root": "s3://bucket/x", "token": MASK, "opts": [{"password": MASK}]},
                   "tracking": {"uri": f"http://u:{MASK}@host"}, "n": 3, "empty_token": None}
    assert tree["dataset"]["token"] == "abc"


def test_secrets_stay_out_of_the_mlflow_run(dlpipe, tmp_path):
    """A secret and a URI password in a config file and a password in an override never reach
    params, tags or artifacts, nor any byte of the SQLite store, the artifact folder, the output
    folder (Hydra's .hydra record aside: docs/configuration.md, "Secrets and security") or the printed
    output."""
    from mlflow import MlflowClient

    conf = tmp_path / "conf" / "dataset"
    conf.mkdir(parents=True)
    (conf / "secret.yaml").write_text(
        "_target_: faulty_data.TokenizedDataset\nsize: 32\napi_token: hunter2\nmirror: https://me:hunter3@data.example/x\n"
    )
    store = f"sqlite:///{tmp_path / 'store.db'}"
    r = dlpipe("--config-dir", str(tmp_path / "conf"), "dataset=secret", "model=mlp", "model.in_features=4",
               "trainer.progress=false", "trainer.epochs=1", f"tracking.uri={store}", "tracking.experiment=secrets",
               "tracking.run_name=http://bob:hunter4@x", "hydra.run.dir=out")
    assert r.returncode == 0, r.stderr
    client = MlflowClient(tracking_uri=store)
    [run] = runs_of(client, "secrets")
    assert run.data.params["dataset.api_token"] == MASK and run.info.run_name == f"http://bob:{MASK}@x"
    artifact = open(client.download_artifacts(run.info.run_id, "config/resolved.yaml")).read()
    assert "mirror: https://me:***@data.example/x" in artifact
    skipped = {"conf", ".hydra"}  # the config file itself, and Hydra's record of the job
    files = [p for p in tmp_path.rglob("*") if p.is_file() and not skipped & set(p.relative_to(tmp_path).parts)]
    assert {"store.db", "dlpipe.log", "resolved.yaml"} <= {p.name for p in files}
    written = b"".join(p.read_bytes() for p in files)
    for secret in ("hunter2", "hunter3", "hunter4"):
        assert secret.encode() not in written and secret not in r.stdout + r.stderr


def test_overrides_lose_secret_values_and_passwords():
    """Run names and the overrides tag: a secret key's value masked (with + or ~ prefixes), a URI
    password masked under any key, everything else as typed."""
    overrides = ["+dataset.api_key=SECRET123", "dataset.hf_token=abc", "tracking.run_name=http://bob:hunter2@x",
                 "loader.batch_size=64", "~dataset.password"]
    assert redact_overrides(overrides) == ["+dataset.api_key=***", "dataset.hf_token=***",
                                           "tracking.run_name=http://bob:***@x", "loader.batch_size=64",
                                           "~dataset.password"]


def test_a_dict_value_holding_a_secret_key_is_masked_whole():
    """`+dataset.storage_options={key:AKIA,secret:S3CR3T}` names its secret inside the value; a dict
    without one stays as typed. A token-only URI (no user) loses its token too."""
    assert redact_overrides(["+dataset.storage_options={key:AKIA,secret:S3CR3T}",
                             "+dataset.headers={Authorization: Bearer X}", "+dataset.opts={max_tokens:5}",
                             "trainer.devices=[0,1]"]) == [
        "+dataset.storage_options=***", "+dataset.headers=***", "+dataset.opts={max_tokens:5}", "trainer.devices=[0,1]"]
    assert redact_text("https://:TOKEN@host/api") == "https://:***@host/api"


def test_uri_on_disk_keeps_the_user_but_not_the_password():
    assert without_password("http://bob:hunter2@host:5000/x") == "http://bob@host:5000/x"
    assert without_password("http://host:5000") == "http://host:5000"


def test_log_records_are_redacted_by_the_handlers_filter():
    """Whatever logs a URI (MLflow, urllib3, dlpipe), in the message, its arguments or a traceback,
    the job's handlers write it masked; installing twice adds one filter."""
    stream = io.StringIO()
    logger = logging.getLogger("test_redact.filter")
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        redact_logging(logger)
        redact_logging(logger)
        assert len(handler.filters) == 1
        logger.warning("request to %s failed", "http://alice:pw1@h/api")
        try:
            raise ConnectionError("http://alice:pw2@h/api refused")
        except ConnectionError:
            logger.exception("it failed")
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "pw1" not in text and "pw2" not in text
    assert "http://alice:***@h/api refused" in text and "request to http://alice:***@h/api failed" in text


PRINTED_SECRETS = ["tracking.uri=http://alice:PRINTPW@mlflow.example", "+dataset.api_key=PRINTKEY",
                   "+dataset.credentials.user=bob", "+dataset.credentials.pin=PRINTPIN",
                   "+dataset.storage_options={region:eu,secret:PRINTSEC}"]
# The same config with each secret already as dlpipe masks it: what --cfg job must print, key for key.
AS_MASKED = ["tracking.uri='http://alice:***@mlflow.example'", "+dataset.api_key='***'", "+dataset.credentials='***'",
             "+dataset.storage_options={region:eu,secret:'***'}"]


@pytest.mark.parametrize("flags", [["--cfg", "job"], ["--cfg", "job", "--resolve"], ["--cfg", "all"], ["--info"],
                                   ["--help"]], ids=" ".join)
def test_printed_config_masks_secrets_and_stays_yaml(dlpipe, tmp_path, flags):
    """--cfg, --info and --help print the composed config: secrets masked as in the run's record, nothing
    else changed (--cfg job loads as YAML equal to the same config with the masks typed in), nothing made."""
    r = dlpipe("+recipe=tabular", *PRINTED_SECRETS, *flags)
    assert r.returncode == 0, r.stderr
    assert not any(s in r.stdout + r.stderr for s in ("PRINTPW", "PRINTKEY", "PRINTPIN", "PRINTSEC")), r.stdout
    assert list(tmp_path.iterdir()) == []
    if flags[:2] == ["--cfg", "job"]:
        typed = dlpipe("+recipe=tabular", *AS_MASKED, *flags)
        assert typed.returncode == 0, typed.stderr
        assert yaml.safe_load(r.stdout) == yaml.safe_load(typed.stdout)
    elif flags == ["--cfg", "all"]:
        printed = yaml.safe_load(r.stdout)
        assert printed["hydra"]["overrides"]["task"] == [
            "+recipe=tabular", "tracking.uri=http://alice:***@mlflow.example", "+dataset.api_key=***",
            "+dataset.credentials.user=***", "+dataset.credentials.pin=***", "+dataset.storage_options=***"]
        assert printed["dataset"]["credentials"] == MASK and printed["tracking"]["uri"].endswith(":***@mlflow.example")


def test_an_override_that_reads_a_secret_from_the_environment_is_kept():
    """`${oc.env:HF_TOKEN}` holds no secret (the advice in docs/configuration.md, "Secrets and security"):
    kept in tags and printed commands, which then still work; a default after the name may be one, so that
    is masked."""
    assert redact_overrides(["+dataset.token=${oc.env:HF_TOKEN}", "+dataset.token=${oc.env:HF_TOKEN,hf_abc}"]) == [
        "+dataset.token=${oc.env:HF_TOKEN}", "+dataset.token=***"]
