"""Config composition through Hydra's compose API: every group option, every recipe, resolvers, validation."""


import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from dlpipe.cli import resolve
from dlpipe.config import decisions
from dlpipe.config.paths import conf_dir
from dlpipe.config.resolvers import RESOLVERS, register_resolvers
from dlpipe.config.store import find_recipes, register_recipes, register_schemas
from dlpipe.config.validation import validate
from dlpipe.errors import ConfigError
from dlpipe.loader import decisions as loader_decisions
from dlpipe.loader.fitting import build_loaders
from dlpipe.tasks.build import build_data_and_model, build_scheduler

# Small sizes so building every option stays fast; values only, nothing structural.
SMALL = {
    "vision": ["dataset.size=32", "dataset.image_size=32", "dataset.crop_size=28"],
    "tokens": ["dataset.size=32"],
    "tokens_ragged": ["dataset.size=32"],
    "tabular": ["dataset.size=32"],
}
PAIRS = [("vision", "cnn"), ("tokens", "transformer"), ("tokens_ragged", "transformer"), ("tabular", "mlp")]


@pytest.fixture(scope="module", autouse=True)
def registered():
    register_resolvers()
    register_schemas()
    register_recipes()


def make(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def group_options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


def test_every_conf_file_belongs_to_a_tested_option():
    """Each YAML in conf/ is either the primary config or a group option that the tests below compose."""
    for path in conf_dir().rglob("*.yaml"):
        assert path.name == "config.yaml" or path.parent.name in {
            "dataset", "model", "loader", "optim", "loss", "trainer", "tracking", "telemetry", "checkpoint", "bench",
            "sweep",
            "launcher", "scheduler", "val_dataset", "help",  # help: the --help pages, tests/test_help.py shows each
        }, path


@pytest.mark.parametrize("option", group_options("val_dataset"))
def test_val_dataset_options_compose_and_validate(option):
    """val_dataset=none (no data of its own: the val_fraction split) or custom (a `_target_` like dataset's)."""
    given = ["val_dataset._target_=dlpipe.data.tabular.TabularDataset", "+val_dataset.size=16"]
    cfg = make(f"val_dataset={option}", *SMALL["tabular"], "dataset=tabular", "model=mlp",
               *(given if option == "custom" else []))
    _, resolved = resolve(cfg)
    job = validate(resolved)
    if option == "none":
        assert job.val_dataset is None
    else:
        assert job.val_dataset == {"_target_": "dlpipe.data.tabular.TabularDataset", "size": 16}


@pytest.mark.parametrize("preset", group_options("hydra/launcher"))
def test_slurm_presets_compose_onto_the_submitit_launcher(preset):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose("config", overrides=[f"hydra/launcher={preset}"], return_hydra_config=True)
    launcher = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    assert launcher["_target_"].endswith("submitit_launcher.SlurmLauncher")
    assert launcher["max_num_timeout"] > 0 and launcher["signal_delay_s"] >= 60  # requeue with time to save
    for key in ("partition", "timeout_min", "cpus_per_task", "mem_gb", "gpus_per_node"):
        assert key in launcher
    gpus, tasks = cfg.hydra.launcher.gpus_per_node, cfg.hydra.launcher.tasks_per_node
    assert {"slurm": (None, 1), "slurm_gpu": (1, 1), "slurm_node": (8, 8)}[preset] == (gpus, tasks)


@pytest.mark.parametrize("dataset, model", PAIRS)
@pytest.mark.parametrize("optim", group_options("optim"))
def test_dataset_model_optim_build(dataset, model, optim):
    """Every dataset with its model and every optimizer composes, resolves, validates and instantiates."""
    cfg = make(f"dataset={dataset}", f"model={model}", f"optim={optim}", *SMALL[dataset])
    _, resolved = resolve(cfg)
    train, val, net, opt = build_data_and_model(validate(resolved))
    assert len(train) + len(val) == 32
    assert sum(p.numel() for p in net.parameters()) > 0
    assert opt.param_groups[0]["lr"] == resolved["optim"]["lr"]


@pytest.mark.parametrize("loader", group_options("loader"))
@pytest.mark.parametrize("tracking", group_options("tracking"))
def test_loader_and_tracking_options_build(loader, tracking):
    """Every loader preset builds working DataLoaders; every tracking option validates."""
    cfg = make(f"loader={loader}", f"tracking={tracking}", *SMALL["vision"], "loader.batch_size=8")
    _, resolved = resolve(cfg)
    job = validate(resolved)
    train, val, _, _ = build_data_and_model(job)
    train_plan, val_plan = build_loaders(job, train, val)
    images, labels, *_ = next(iter(train_plan.loader))  # loader=padded appends the lengths
    assert images.shape[0] == labels.shape[0] == 8
    assert train_plan.notes == [] and val_plan.notes == []  # shipped presets are consistent as they are


# Every scheduler option (step: decaying within this short run), and a torch class of the user's own.
# (plateau: no patience, so the metric-less steps here, which never improve, move it at once)
QUICKER = {"step": ["scheduler.step_size=1"], "plateau": ["scheduler.patience=0"]}
SCHEDULERS = [[f"scheduler={name}", *QUICKER.get(name, [])] for name in group_options("scheduler")]
SCHEDULERS += [["+scheduler._target_=torch.optim.lr_scheduler.ExponentialLR", "+scheduler.gamma=0.9"]]


@pytest.mark.parametrize("optim", group_options("optim"))
@pytest.mark.parametrize("scheduler", SCHEDULERS, ids=lambda args: args[0].split("=")[-1])
def test_every_scheduler_option_builds_and_steps(scheduler, optim):
    """Each schedule composes, validates and builds on each optimizer, its span derived from the run
    (3 epochs x 4 optimizer steps, capped by max_steps=10), and steps through the whole run."""
    cfg = make("dataset=tabular", "model=mlp", f"optim={optim}", "trainer.epochs=3", "trainer.max_steps=10",
               *scheduler, *SMALL["tabular"])
    _, resolved = resolve(cfg)
    job = validate(resolved)
    _, _, _, opt = build_data_and_model(job)
    schedule = build_scheduler(job, opt, steps_per_epoch=4)
    if scheduler == ["scheduler=none"]:
        assert schedule is None and job.scheduler == {}
        return
    assert schedule.interval == resolved["scheduler"].get("interval", "epoch")
    span = getattr(schedule.scheduler, "total_steps", None)
    assert span in (None, 10)  # onecycle: optimizer steps, capped by max_steps
    lrs = []
    for step in range(1, 11):
        opt.step()
        schedule.after_step(opt)
        if step % 4 == 0:
            schedule.end_epoch(opt)
        lrs.append(opt.param_groups[0]["lr"])
    assert all(lr >= 0 for lr in lrs) and len(set(lrs)) > 1  # it moved, and never below 0


def test_a_warmup_longer_than_the_run_is_said_not_refused(caplog):
    """A quick run of a recipe with warm-up (trainer.limit_train_batches=3) is legitimately that short."""
    cfg = make("dataset=tabular", "model=mlp", "scheduler=cosine", "scheduler.warmup_steps=20", *SMALL["tabular"])
    job = validate(resolve(cfg)[1])
    with caplog.at_level("WARNING", logger="dlpipe"):
        schedule = build_scheduler(job, build_data_and_model(job)[3], steps_per_epoch=3)
    assert schedule is not None
    assert "scheduler.warmup_steps=20: the schedule spans only 9 optimizer steps in this run" in caplog.text


@pytest.mark.parametrize("task", ["train", "bench", "tune", "eval"])
def test_bench_options_compose_for_every_task(task):
    cfg = make(f"task={task}", *SMALL["vision"])
    _, resolved = resolve(cfg)
    validate(resolved)
    assert resolved["task"] == task and resolved["bench"]["batches"] >= 1 and resolved["loader"]["tuned_on"] is None


def test_image_folder_option(tmp_path):
    """dataset=image_folder with a real folder of images builds, and the model gets num_classes from it."""
    from PIL import Image

    for cls, colour in (("cat", (200, 30, 30)), ("dog", (30, 30, 200)), ("fox", (30, 200, 30))):
        (tmp_path / cls).mkdir()
        for i in range(4):
            Image.new("RGB", (40, 40), colour).save(tmp_path / cls / f"{i}.jpg")
    cfg = make("dataset=image_folder", f"dataset.root={tmp_path}", "dataset.image_size=32", "dataset.crop_size=28")
    _, resolved = resolve(cfg)
    job = validate(resolved)
    assert job.model["num_classes"] is None  # the vision dataset's key is gone
    train, val, net, _ = build_data_and_model(job)
    logits = net(next(iter(build_loaders(job, train, val)[0].loader))[0])
    assert logits.shape[-1] == 3
    gray = validate(resolve(make("dataset=image_folder", f"dataset.root={tmp_path}", "dataset.image_size=32",
                                 "dataset.crop_size=28", "dataset.channels=1"))[1])
    train, val, net, _ = build_data_and_model(gray)
    images = next(iter(build_loaders(gray, train, val)[0].loader))[0]
    assert images.shape[1] == 1 and net(images).shape[-1] == 3  # the CNN's in_channels followed the dataset


def test_validation_split_is_not_augmented():
    """Validation scores the same inputs every time; training keeps its random augmentation."""
    _, resolved = resolve(make(*SMALL["vision"]))
    train, val, _, _ = build_data_and_model(validate(resolved))
    assert torch.equal(val[0][0], val[0][0])
    assert any(not torch.equal(train[0][0], train[0][0]) for _ in range(5))


def test_auto_amp_follows_the_device():
    """AMP is decided for the device actually used: off whenever the device is not CUDA."""
    assert make("trainer.device=cpu").trainer.amp == "off"
    assert decisions.amp("cpu").value == "off" and decisions.amp("mps").value == "off"


@pytest.mark.parametrize("recipe", sorted(find_recipes()))
def test_every_recipe_composes_and_validates(recipe):
    """Each recipe composes over the defaults, overrides its groups and passes validation."""
    cfg = make(f"+recipe={recipe}")
    raw, resolved = resolve(cfg)
    validate(resolved)
    assert OmegaConf.select(cfg, "dataset._target_")
    # Hydra reads `# @package` only from the leading `# @` lines; the command that runs it comes next.
    header = (find_recipes()[recipe]).read_text().splitlines()[:2]
    assert header == ["# @package _global_", f"# dlpipe +recipe={recipe}"]


def test_recipes_override_groups():
    """nlp and tabular switch dataset, model and loader; values from the recipe win over group defaults."""
    nlp = make("+recipe=nlp")
    assert nlp.dataset._target_.endswith("TokenSequenceDataset")
    assert nlp.model._target_.endswith("TinyTransformer")
    assert nlp.loader.num_workers == 0  # in-memory tensors: the main process is fastest
    tab = make("+recipe=tabular", "trainer.epochs=7")
    assert tab.model._target_.endswith("MLP") and tab.trainer.epochs == 7  # command line wins over recipe


def test_typo_and_wrong_type_fail_at_composition():
    """Closed schemas reject unknown keys and values of the wrong type, naming the key."""
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="num_workerz"):
        make("loader.num_workerz=2")
    with pytest.raises(ConfigCompositionException, match="batch_size"):
        make("loader.batch_size=abc")


def test_validation_collects_every_problem():
    """One ConfigError lists each bad key with its value and the allowed range."""
    _, resolved = resolve(make("loader.num_workers=-1", "loader.batch_size=0", "trainer.accumulate=0",
                               "trainer.val_fraction=1.5", "optim.lr=-1"))
    with pytest.raises(ConfigError) as err:
        validate(resolved)
    problems = err.value.problems
    for expected in ("loader.num_workers=-1", "loader.batch_size=0", "trainer.accumulate=0",
                     "trainer.val_fraction=1.5", "optim.lr=-1"):
        assert any(p.startswith(expected) for p in problems), (expected, problems)
    assert len(problems) == 5


def test_missing_mandatory_value_is_a_config_error():
    """An unset ??? value is reported with its key, not as an OmegaConf traceback."""
    with pytest.raises(ConfigError, match="dataset.root"):
        resolve(make("dataset=image_folder"))


def test_resolvers_register_idempotently():
    """Registering twice (multirun, launcher jobs) is harmless, and every resolver is there."""
    register_resolvers()
    register_resolvers()
    for name in RESOLVERS:
        assert OmegaConf.has_resolver(name)


def test_auto_values_follow_the_machine(monkeypatch):
    """auto_workers follows the CPU budget (here: SLURM_CPUS_PER_TASK and LOCAL_WORLD_SIZE)."""
    from dlpipe.machine import hardware

    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    budget = hardware.cpu_budget()
    cfg = make()
    assert cfg.loader.num_workers == hardware.recommended_workers(budget.budget)
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    cfg = make()
    assert cfg.loader.num_workers == 0 and cfg.loader.prefetch_factor is None
    assert cfg.loader.persistent_workers is False


@pytest.mark.parametrize(
    "workers, epochs, size, expected",
    [(0, 10, 10**6, False), (2, 1, 10**6, False), (2, 3, 500, False), (2, 3, 5000, True), (2, 3, 0, True)],
)
def test_persistent_workers_decision(workers, epochs, size, expected):
    """persistent_workers: only with workers, more than one epoch and at least 10 batches per worker per
    epoch (500 items in batches of 64 make 8); an unknown size is settled once the data is built."""
    assert loader_decisions.persistent(workers, epochs, size, 64, 0.1).value is expected


def test_explain_marks_auto_and_user_values():
    """Every hardware-aware key is explained: its reason when automatic, its source otherwise
    (tests/test_sources.py: every kind of source)."""
    from dlpipe.config.sources import Origin

    cfg = make("loader.num_workers=3")
    raw, resolved = resolve(cfg)
    why = decisions.explain(raw, resolved, Origin(("loader.num_workers=3",), {"loader": "auto"}))
    assert why["loader.num_workers"] == "3 (user override)"
    assert why["loader.prefetch_factor"].startswith("2 (auto: 3 workers")
    assert why["loader.pin_memory"].startswith("False (auto:") or why["loader.pin_memory"].startswith("True (auto:")
    assert set(why) == {"loader.num_workers", "loader.pin_memory", "loader.prefetch_factor",
                        "loader.persistent_workers", "trainer.device", "trainer.amp", "trainer.torch_threads"}


def test_shipped_folders_are_found():
    """conf/ and recipes/ are found from a checkout or inside an installed wheel."""
    assert (conf_dir() / "config.yaml").is_file()
    assert {"vision", "nlp", "tabular", "smoke"} <= set(find_recipes())


def test_user_recipe_dir_shadows_and_extends(tmp_path, monkeypatch):
    """$DLPIPE_RECIPE_PATH folders add recipes and may replace a shipped one."""
    (tmp_path / "vision.yaml").write_text("# @package _global_\ntrainer:\n  epochs: 42\n")
    (tmp_path / "extra.yaml").write_text("# @package _global_\ntrainer:\n  epochs: 9\n")
    monkeypatch.setenv("DLPIPE_RECIPE_PATH", str(tmp_path))
    found = find_recipes()
    assert found["vision"] == tmp_path / "vision.yaml" and "extra" in found and "nlp" in found
    register_recipes()
    try:
        assert make("+recipe=vision").trainer.epochs == 42
        assert make("+recipe=extra").trainer.epochs == 9
    finally:
        monkeypatch.delenv("DLPIPE_RECIPE_PATH")
        register_recipes()  # put the shipped vision recipe back for the other tests
    assert make("+recipe=vision").trainer.epochs == 3
