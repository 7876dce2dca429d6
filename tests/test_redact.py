"""Secrets never reach params, tags or the config artifact."""

import pytest
from conftest import runs_of

from dlpipe.redact import MASK, is_secret_key, redact_text, redact_tree


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


def test_secrets_stay_out_of_the_mlflow_run(dlpipe, tmp_path, mlflow_store, mlflow_client):
    """A secret in the config and a password in an override never reach params, tags or artifacts."""
    conf = tmp_path / "conf" / "dataset"
    conf.mkdir(parents=True)
    (conf / "secret.yaml").write_text(
        "_target_: faulty_data.TokenizedDataset\nsize: 32\napi_token: hunter2\nmirror: https://me:hunter3@data.example/x\n"
    )
    r = dlpipe("--config-dir", str(tmp_path / "conf"), "dataset=secret", "model=mlp", "model.in_features=4",
               "trainer.progress=false", "trainer.epochs=1", f"tracking.uri={mlflow_store}",
               "tracking.experiment=secrets")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "secrets")
    recorded = " ".join([*run.data.params.values(), *run.data.tags.values()])
    artifact = open(mlflow_client.download_artifacts(run.info.run_id, "config/resolved.yaml")).read()
    for text in (recorded, artifact, r.stdout, r.stderr):
        assert "hunter2" not in text and "hunter3" not in text
    assert run.data.params["dataset.api_token"] == MASK
