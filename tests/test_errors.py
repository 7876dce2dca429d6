"""User-facing errors: one line each, intact across pickling, stripped of worker tracebacks."""

import pickle
import socket

import pytest
from conftest import runs_of
from hydra import compose, initialize_config_dir
from hydra.errors import MissingConfigException
from torch.utils.data import DataLoader, Dataset

from dlpipe.cli import multirun_first, resolve
from dlpipe.config.composition_errors import one_line
from dlpipe.config.paths import conf_dir
from dlpipe.config.resolvers import register_resolvers
from dlpipe.config.store import register_schemas
from dlpipe.config.targets import not_a_dataset
from dlpipe.config.validation import validate
from dlpipe.errors import ConfigError, DataError, user_message
from dlpipe.loader.faults import explain_loader_failure
from dlpipe.schema import LoaderConfig
from dlpipe.tasks.fit_checks import check_monitored
from dlpipe.tracking.outbox import connect_error


def test_config_error_survives_pickling():
    """Launchers pickle a failed job's exception: the problems must come back as they were."""
    err = ConfigError(["loader.num_workers=-1: must be >= 0", "trainer.epochs=0: must be >= 1"])
    back = pickle.loads(pickle.dumps(err))
    assert back.problems == err.problems and str(back) == str(err)


class _BadItem(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise DataError(f"dataset.root='/x': image {i} cannot be decoded")


def test_worker_error_becomes_one_line():
    """A DataError raised in a real DataLoader worker is shown as its own message plus the worker."""
    loader = DataLoader(_BadItem(), batch_size=2, num_workers=1)
    with pytest.raises(DataError) as err:
        next(iter(loader))
    assert "Original Traceback" in str(err.value)  # what PyTorch does to it
    [line] = user_message(err.value)
    assert line.startswith("dataset.root='/x': image 0 cannot be decoded (DataLoader worker process 0")


def test_plain_errors_keep_their_lines():
    """Errors raised in the main process are shown as they are, one line per problem."""
    assert user_message(ConfigError(["a=1: bad", "b=2: bad"])) == ["a=1: bad", "b=2: bad"]
    assert user_message(RuntimeError()) == ["RuntimeError"]


# The bad-input table, continued (tests/test_cli.py::BAD_INPUT has the first part): (overrides, environment,
# the one line expected). Checks that are pure logic run in-process here (compose, resolve, validate: what the
# CLI does first, with a CPU budget of 2); CLI_BAD_INPUT below runs the real command once per distinct path.
BAD_VALUES = [
    (["optim.lr=fast"], {}, "optim.lr=fast: must be a finite number > 0"),
    (["optim.lr=inf"], {}, "optim.lr=inf: must be a finite number > 0"),
    (["optim.lr=nan"], {}, "optim.lr=nan: must be a finite number > 0"),
    (["optim.lr=-0.1"], {}, "optim.lr=-0.1: must be a finite number > 0"),
    (["trainer.grad_clip=nan"], {}, "trainer.grad_clip=nan: must be a finite number >= 0 (0 disables clipping)"),
    (["trainer.grad_clip=inf"], {}, "trainer.grad_clip=inf: must be a finite number >= 0"),
    (["dataset._target_=torch.nn.Linear"], {}, "dataset._target_=torch.nn.Linear: a torch.nn.Module (a model"),
    (["dataset._target_=builtins.int"], {}, "dataset._target_=builtins.int: not a dataset (it has no __getitem__"),
    (["dataset._target_=collections.OrderedDict"], {},
     "dataset._target_=collections.OrderedDict: a mapping (looked up by key), not a dataset"),
    (["dataset._target_=os.getcwd"], {}, "dataset._target_=os.getcwd: takes none of the keys given (size, "),
    (["loader.num_workers=10000"], {}, "loader.num_workers=10000: at most 16 here (8 per CPU of this job's budget "
                                       "of 2, at least 16)"),
    (["tracking.uri=http://"], {}, "tracking.uri=http://: no host after http://; allowed: sqlite:///FILE.db"),
    (["tracking.uri=mlflow"], {}, "tracking.uri=mlflow: a bare word or path is MLflow's retired file store"),
    (["tracking.uri=foo://x"], {}, "tracking.uri=foo://x: unknown scheme 'foo'; allowed:"),
    ([], {"MLFLOW_TRACKING_URI": "garbage"},
     "tracking.uri=garbage (from the environment variable MLFLOW_TRACKING_URI): a bare word or path"),
    (["tracking.experiment="], {}, "tracking.experiment='': must be a name"),
    # null for a parameter the class types without None: what it takes, not the class's own TypeError
    (["optim=sgd", "optim.momentum=null"], {}, "optim.momentum=null: torch.optim.SGD takes a number as momentum, "
                                               "not null; set one, or remove the key (~optim.momentum) for its "
                                               "default 0"),
    (["+optim.betas=null"], {}, "optim.betas=null: torch.optim.AdamW takes a list as betas, not null; set one, or "
                                "remove the key (~optim.betas) for its default (0.9, 0.999)"),
    (["scheduler=step", "scheduler.gamma=null"], {}, "scheduler.gamma=null: torch.optim.lr_scheduler.StepLR takes a "
                                                     "number as gamma, not null; set one, or remove the key "
                                                     "(~scheduler.gamma) for its default 0.1"),
    (["scheduler=onecycle", "+scheduler.anneal_strategy=null"], {},
     "scheduler.anneal_strategy=null: torch.optim.lr_scheduler.OneCycleLR takes one of cos, linear as anneal_strategy"),
    (["scheduler=cosine", "scheduler.warmup_steps=null"], {},
     "scheduler.warmup_steps=null: dlpipe.training.schedule.warmup_cosine takes an integer as warmup_steps, not null"),
    (["scheduler=cosine", "scheduler.interval=null"], {}, "scheduler.interval=null: allowed: step (after every "),
    (["scheduler=plateau", "scheduler.factor=null"], {}, "scheduler.factor=null: torch.optim.lr_scheduler."
                                                         "ReduceLROnPlateau takes a number as factor, not null"),
    ([], {"MLFLOW_EXPERIMENT_NAME": " "}, "tracking.experiment=' ' (from the environment variable "
                                          "MLFLOW_EXPERIMENT_NAME): must be a name"),
]


@pytest.mark.parametrize("overrides, env, expected", BAD_VALUES, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else "")
def test_bad_value_is_one_problem_naming_key_value_and_what_is_allowed(monkeypatch, overrides, env, expected):
    register_resolvers()
    register_schemas()
    for name, value in env.items():  # conf/tracking/mlflow.yaml reads MLflow's variables
        monkeypatch.setenv(name, value)
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        _, resolved = resolve(compose("config", overrides=overrides))
    with pytest.raises(ConfigError) as err:
        validate(resolved, cpu_budget=2)
    assert len(err.value.problems) == 1 and expected in err.value.problems[0], err.value.problems


@pytest.fixture
def silent_server():
    """A port that accepts TCP connections (the kernel completes them into the backlog) and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    yield server.getsockname()[1]
    server.close()


def test_a_server_that_accepts_but_never_answers_is_found_by_the_probe(silent_server):
    assert connect_error(f"http://127.0.0.1:{silent_server}", 0.5) == (
        f"127.0.0.1:{silent_server} accepted the connection but sent no HTTP answer within 0.5 s (a hung server?)")


# One row per distinct path through the real command: refused in validation, a value from the environment, what
# a function returned, the dry forward pass, the monitored metric, a hung server, resuming without a checkpoint
# (each of the last four used to leave its output folder or a traceback behind). "{port}": a silent server.
CLI_BAD_INPUT = [
    (["+recipe=smoke", "optim.lr=fast"], {}, "optim.lr=fast: must be a finite number > 0 (e.g. optim.lr=1e-3)"),
    (["+recipe=smoke"], {"MLFLOW_TRACKING_URI": "garbage"},
     "tracking.uri=garbage (from the environment variable MLFLOW_TRACKING_URI): a bare word or path is MLflow's "
     "retired file store (allowed only with MLFLOW_ALLOW_FILE_STORE=true); allowed: sqlite:///FILE.db"),
    (["dataset=custom", "dataset._target_=os.getcwd"], {},
     "dataset._target_=os.getcwd: returned a str (a string, not a dataset); allowed: a dataset class (a map-style"),
    (["dataset=tokens", "model=cnn", "dataset.size=64"], {},
     "model._target_=dlpipe.models.cnn.SmallCNN cannot take a batch of dataset._target_=dlpipe.data.sequences."
     "TokenSequenceDataset (input [2, 64] int64, target [2, 64] int64): RuntimeError: "),
    (["+recipe=smoke", "checkpoint.monitor=val_acc", "trainer.val_fraction=0"], {},
     "checkpoint.monitor=val_acc: this run does not validate (trainer.val_fraction=0 or "
     "trainer.limit_val_batches=0), so it logs no val_ metric; allowed: train_loss"),
    (["+recipe=smoke", "tracking.uri=http://127.0.0.1:{port}", "tracking.request_timeout_s=1"], {},
     "tracking.uri=http://127.0.0.1:{port}: 127.0.0.1:{port} accepted the connection but sent no HTTP answer "
     "within 1 s"),
    (["+recipe=smoke", "checkpoint.resume=must"], {}, "checkpoint.resume=must: no checkpoint in "),
    (["+recipe=smoke", "optim.lr=null"], {}, "optim.lr=null: torch.optim.AdamW takes a number or Tensor as lr, not "
                                             "null; set one, or remove the key (~optim.lr) for its default 0.001"),
    (["+recipe=smoke", "scheduler=step", "scheduler.step_size=null"], {},
     "scheduler.step_size=null: torch.optim.lr_scheduler.StepLR takes an integer as step_size, not null; set one"),
]


@pytest.mark.parametrize("args, env, expected", CLI_BAD_INPUT, ids=lambda v: " ".join(v) if isinstance(v, list)
                         else "")
def test_bad_input_through_the_cli_is_one_line_and_leaves_nothing(dlpipe, tmp_path, mlflow_store, mlflow_client,
                                                                  silent_server, args, env, expected):
    """Exit 2, one line, no traceback, no MLflow run, no output folder."""
    args = [a.replace("{port}", str(silent_server)) for a in args]
    expected = expected.replace("{port}", str(silent_server))
    exp = f"refused-{abs(hash(tuple(args)))}"
    store = [] if any(a.startswith("tracking.uri") for a in args) or env else [f"tracking.uri={mlflow_store}"]
    r = dlpipe(*args, "trainer.progress=false", *store, f"tracking.experiment={exp}", env=env, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().startswith("dlpipe: error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert expected in r.stderr, r.stderr
    assert runs_of(mlflow_client, exp) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no outputs/, and no store either


def test_multirun_after_the_overrides_is_moved_before_them(dlpipe, tmp_path):
    """Hydra's parser rejects `a=1 --multirun b=2` ("unrecognized arguments: b=2"); dlpipe moves the flag."""
    assert multirun_first(["dlpipe", "a=1", "--multirun", "b=2"]) == ["dlpipe", "--multirun", "a=1", "b=2"]
    assert multirun_first(["dlpipe", "-m", "a=1"]) == ["dlpipe", "-m", "a=1"]
    both = ValueError("Only one of --run, --multirun, --cfg, --info and --shell_completion can be specified")
    assert one_line(both, []).endswith("--cfg and --info print the config of a single run; drop --multirun")
    r = dlpipe("+recipe=smoke", "trainer.epochs=1", "--multirun", "trainer.limit_train_batches=2", "tracking=none",
               "trainer.progress=false", "hydra.sweep.dir=sweep")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "sweep" / "0" / "resolved_config.yaml").is_file()


class _Rows:
    """Not a torch Dataset, but indexable with a length (Hugging Face's datasets.Dataset is such a class)."""

    def __getitem__(self, i):
        return i

    def __len__(self):
        return 3


def test_what_counts_as_a_dataset():
    assert not_a_dataset(_Rows) is None and not_a_dataset(_BadItem) is None
    assert not_a_dataset(dict).startswith("a mapping") and not_a_dataset(str).startswith("a string")


def test_a_monitor_must_be_a_metric_the_run_logs():
    """best.pt (and early stopping) need the monitored metric every epoch: one the run does not log is refused,
    except the default val_loss in a run without validation (which then keeps no best.pt)."""
    metrics = {"accuracy": object()}
    check_monitored("checkpoint", "val_loss", metrics, validates=False)
    check_monitored("checkpoint", "samples_per_s", metrics, validates=True)
    with pytest.raises(ConfigError, match="checkpoint.monitor=acc: this run logs no such epoch metric; allowed: "
                                          "train_loss, val_loss, val_accuracy"):
        check_monitored("checkpoint", "acc", metrics, validates=True)
    with pytest.raises(ConfigError, match="trainer.early_stopping.monitor=val_loss: this run does not validate"):
        check_monitored("trainer.early_stopping", "val_loss", metrics, validates=False)


_KILLED = RuntimeError("DataLoader worker (pid 7) is killed by signal: Killed.")


@pytest.mark.parametrize("loader, advice", [
    (LoaderConfig(num_workers=2), "try fewer loader.num_workers (now 2), loader.prefetch_factor=1 (now unset: "
                                  "PyTorch's default, 2 batches per worker) or a smaller loader.batch_size (now 64)"),
    (LoaderConfig(num_workers=2, prefetch_factor=1), "try fewer loader.num_workers (now 2) or a smaller "
                                                     "loader.batch_size (now 64)"),
    (LoaderConfig(num_workers=0, batch_size=8), "try a smaller loader.batch_size (now 8)"),
])
def test_worker_death_advice_names_only_settings_that_can_go_lower(loader, advice):
    line = explain_loader_failure(_KILLED, loader)
    assert line.endswith(advice) and "None" not in line, line


def test_worker_only_settings_without_workers_are_dropped_with_a_note():
    """PyTorch raises on a timeout or a prefetch_factor in the main process; dlpipe drops them and says
    so (a sweep over loader.num_workers=0,2 x loader.prefetch_factor=2,4 runs all its jobs)."""
    from dlpipe.loader.build import build_loader

    plan = build_loader(list(range(8)), batch_size=4, num_workers=0, pin_memory=False, prefetch_factor=4,
                        persistent_workers=False, shuffle=False, drop_last=False, timeout=5.0,
                        multiprocessing_context=None, seed=0, cuda=False)
    assert plan.notes == ["train: loader.prefetch_factor=4 ignored: it needs num_workers > 0",
                          "train: loader.timeout=5.0 ignored: it bounds the wait for a worker's batch (num_workers=0)"]
    assert [b.tolist() for b in plan.loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("exc, line", [
    # as Hydra raises them when the plugin's module is not installed (measured with it blocked)
    (MissingConfigException("In 'hydra/launcher/slurm': Could not load 'hydra/launcher/submitit_slurm'.\n\nConfig "
                            "search path: ...", missing_cfg_file="hydra/launcher/submitit_slurm"),
     "hydra/launcher=slurm: needs the Hydra plugin that provides hydra/launcher/submitit_slurm, which is not "
     "installed; pip install 'dlpipe[slurm]'"),
    (MissingConfigException("In 'hydra/config': Could not find 'hydra/sweeper/optuna'\n\nAvailable options in "
                            "'hydra/sweeper':\n\tbasic", missing_cfg_file="hydra/sweeper/optuna", options=["basic"]),
     "hydra/sweeper=optuna: needs the Hydra plugin that provides hydra/sweeper/optuna, which is not installed; "
     "pip install 'dlpipe[hpo]'"),
    (MissingConfigException("In 'hydra/config': Could not find 'hydra/launcher/nope'", options=["basic", "slurm"],
                            missing_cfg_file="hydra/launcher/nope"),
     "hydra/launcher=nope: no such hydra/launcher option; available: basic, slurm"),
])
def test_a_launcher_or_sweeper_without_its_plugin_names_the_extra_that_installs_it(exc, line):
    assert one_line(exc, []) == line
    # named as chosen: slurm_gpu builds on slurm, which Hydra names
    chosen = one_line(exc, ["--multirun", "hydra/launcher=slurm_gpu", "+recipe=smoke"])
    assert chosen == line.replace("hydra/launcher=slurm:", "hydra/launcher=slurm_gpu:")
