"""The package's layout rules (README, Development): which layer may import which, and sizes.

Read from the source with `ast`, so a new import that breaks a rule fails here, naming the file.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "dlpipe"
LEAVES = {"errors", "hardware", "cgroups", "budget_share", "gpu", "redact", "console", "stop", "schema", "disk"}
TASKS = {"train", "bench", "tune", "eval", "sync"}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def name_of(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, at the top or inside a function (dlpipe.x.y and third-party alike)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def imported_from(path: Path, *prefixes: str) -> list[str]:
    return sorted(m for m in imports(path) if m.startswith(prefixes))


@pytest.mark.parametrize("path", [p for p in modules() if p.parent.name == "training"], ids=name_of)
def test_training_takes_built_objects_not_config_or_trackers(path):
    assert imported_from(path, "dlpipe.tracking", "dlpipe.config", "dlpipe.tasks", "hydra", "omegaconf", "mlflow") == []


@pytest.mark.parametrize("path", [PACKAGE / f"{leaf}.py" for leaf in sorted(LEAVES)], ids=name_of)
def test_leaf_modules_import_only_other_leaves(path):
    ours = {m.split(".")[1] for m in imported_from(path, "dlpipe.")}
    assert ours <= LEAVES, f"{name_of(path)} imports {sorted(ours - LEAVES)}"


@pytest.mark.parametrize("task", sorted(TASKS))
def test_tasks_do_not_import_each_other(task):
    others = tuple(f"dlpipe.tasks.{t}" for t in TASKS - {task})
    assert imported_from(PACKAGE / "tasks" / f"{task}.py", *others) == []


def test_only_the_cli_config_build_and_the_sweep_callback_touch_hydra():
    allowed = {"dlpipe.cli", "dlpipe.tasks.build", "dlpipe.tracking.sweep"}
    users = {name_of(p) for p in modules() if imported_from(p, "hydra")}
    assert {u for u in users if not u.startswith("dlpipe.config.")} <= allowed


def test_tracking_and_the_config_layer_never_import_torch():
    code = ("import sys, dlpipe.tracking.run, dlpipe.tracking.outbox, dlpipe.tracking.sweep_report, dlpipe.stop, "
            "dlpipe.tracking.sidecar, dlpipe.tracking.sidecar_run, dlpipe.tracking.pytorch_model, "
            "dlpipe.config.decisions, dlpipe.config.validation, dlpipe.loader.policy, dlpipe.loader.lint; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("path", modules(), ids=name_of)
def test_modules_and_functions_stay_readable(path):
    source = path.read_text()
    assert len(source.splitlines()) <= 350, f"{name_of(path)}: split it by concern"
    long = [f"{node.name} ({node.end_lineno - node.lineno + 1} lines)" for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80]
    assert long == []
