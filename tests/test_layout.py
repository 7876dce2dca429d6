"""The package's layout rules (README, Development): which layer may import which, and sizes.

Read from the source with `ast`, so a new import that breaks a rule fails here, naming the file.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dlpipe.schema import CHOICES

PACKAGE = Path(__file__).resolve().parent.parent / "dlpipe"

# The one layering of the package, top first, quoted in docs/development.md. A room (a package, or a
# module at the root) may import rooms of its own layer's row only if it is that room, and any room
# of a layer below; never one above. Read: the CLI runs tasks; tasks compose everything; sweep
# reporting reads tracking; tracking and config know nothing of torch; judging reads loader
# measurements; the loader runs training's batch and RNG helpers; training takes built objects and
# measures itself with telemetry; everything stands on the machine's facts and the base modules.
LAYERS = (
    ("entry", {"__main__"}),
    ("cli", {"cli"}),
    ("tasks", {"tasks"}),
    ("sweep reporting", {"sweeps"}),
    ("tracking, config", {"tracking", "config"}),
    ("judging", {"judging"}),
    ("loader", {"loader"}),
    ("training", {"training"}),
    ("measuring, components", {"telemetry", "data", "models"}),
    ("machine", {"machine"}),
    ("base", {"schema", "stop", "console", "redact", "sample_rng", "instantiate", "help"}),
    ("errors, version", {"errors", "__init__"}),
)
LAYER_OF = {room: depth for depth, (_, rooms) in enumerate(LAYERS) for room in rooms}
TASKS = {*CHOICES["task"], "sync"}  # sync: the one command that is no Hydra app


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


def room_of(module: str) -> str:
    """`dlpipe.loader.build` -> `loader`; `dlpipe.errors` -> `errors`; `dlpipe` (its __init__) -> `__init__`."""
    return module.split(".")[1] if "." in module else "__init__"


def own_imports(path: Path) -> set[str]:
    """The dlpipe modules `path` imports (`from dlpipe.loader import policy` counts as dlpipe.loader.policy)."""
    found = set()
    for name in imported_from(path, "dlpipe."):
        found.add(name if (PACKAGE.parent / name.replace(".", "/")).with_suffix(".py").exists()
                  or (PACKAGE.parent / name.replace(".", "/")).is_dir() else name.rpartition(".")[0])
    return found


def test_every_room_has_a_layer():
    rooms = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in modules()}
    assert rooms == set(LAYER_OF), "add the room to LAYERS (and to docs/development.md), or remove it there"


@pytest.mark.parametrize("path", modules(), ids=name_of)
def test_imports_point_down_the_layers(path):
    me = name_of(path)
    mine = room_of(me)
    against = sorted(m for m in own_imports(path)
                     if room_of(m) != mine and LAYER_OF[room_of(m)] <= LAYER_OF[mine])
    assert against == [], (f"{me} ({LAYERS[LAYER_OF[mine]][0]}) imports {against}: a room imports only rooms on "
                           "layers below its own (tests/test_layout.py LAYERS)")


def test_no_module_imports_itself_back():
    """No circle between dlpipe's modules, at the top or inside a function: each is a knot a reader
    must untie, and an import order that works only by luck."""
    graph = {name_of(p): {m for m in own_imports(p) if m != name_of(p) and not m.endswith("__init__")}
             for p in modules()}
    graph = {k.removesuffix(".__init__"): v for k, v in graph.items()}
    done, path, circles = set(), [], []

    def visit(node):
        if node in path:
            circles.append(" -> ".join(path[path.index(node):] + [node]))
            return
        if node in done:
            return
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt)
        path.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)
    assert circles == [], circles


@pytest.mark.parametrize("task", sorted(TASKS))
def test_tasks_do_not_import_each_other(task):
    others = tuple(f"dlpipe.tasks.{t}" for t in TASKS - {task})
    assert imported_from(PACKAGE / "tasks" / f"{task}.py", *others) == []


def test_only_the_cli_config_builders_and_the_sweep_callbacks_touch_hydra():
    allowed = {"dlpipe.cli", "dlpipe.tasks.build", "dlpipe.sweeps.callback", "dlpipe.tasks.objective_check",
               "dlpipe.sweeps.slurm_check", "dlpipe.instantiate"}
    users = {name_of(p) for p in modules() if imported_from(p, "hydra")}
    assert {u for u in users if not u.startswith("dlpipe.config.")} <= allowed


def test_tracking_and_the_config_layer_never_import_torch():
    code = ("import sys, dlpipe.tracking.run, dlpipe.tracking.outbox, dlpipe.sweeps.report, dlpipe.stop, "
            "dlpipe.tracking.sidecar, dlpipe.tracking.sidecar_run, dlpipe.tracking.pytorch_model, "
            "dlpipe.config.decisions, dlpipe.config.validation, dlpipe.loader.policy, dlpipe.loader.decisions, "
            "dlpipe.loader.lint; "
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


def test_the_development_guide_quotes_the_layers():
    """docs/development.md's table of rooms and layers is LAYERS, row for row."""
    import re

    page = (PACKAGE.parent / "docs" / "development.md").read_text()
    table = page.split("## Rooms and layers", 1)[1].split("\n\n| layer |", 1)[1].split("\n\n", 1)[0]
    rows = [line.split("|")[1:3] for line in table.splitlines()[2:]]  # past the header's rest and the rule
    quoted = [(layer.strip(), set(re.findall(r"`([\w_]+)`", rooms))) for layer, rooms in rows]
    assert quoted == [(name, rooms) for name, rooms in LAYERS]


# Modules that import inside a function without saying why yet: the engineer who owns them is writing
# each one's `# Imported inside functions:` line (or moving its imports to the top) and removes it here.
NOT_YET_EXPLAINED = {
}
EXPLAINED = "# Imported inside functions:"


def imports_inside_functions(tree: ast.Module) -> bool:
    return any(isinstance(node, (ast.Import, ast.ImportFrom))
               for function in ast.walk(tree) if isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
               for node in ast.walk(function))


def test_imports_inside_functions_say_why_once_per_module():
    """An import sits inside a function only where import time demands it (`dlpipe --help`, the config
    layer and the tracking process stay free of torch and mlflow; a task module loads when its command
    runs), and the module says so once, in a top-level comment line starting `# Imported inside functions:`."""
    said = {name_of(p): sum(line.startswith(EXPLAINED) for line in p.read_text().splitlines()) for p in modules()}
    inside = {name_of(p) for p in modules() if imports_inside_functions(ast.parse(p.read_text()))}
    assert sorted(m for m in inside if not said[m] and m not in NOT_YET_EXPLAINED) == [], (
        f"import at the top of the module, or say why not in one `{EXPLAINED}` line")
    assert sorted(m for m in NOT_YET_EXPLAINED if said.get(m) or m not in inside) == [], (
        "explained now, or no import inside a function left: remove it from NOT_YET_EXPLAINED")
    assert sorted(m for m, n in said.items() if n and m not in inside) == [], (
        f"no import inside a function left: drop the `{EXPLAINED}` line")
    assert sorted(m for m, n in said.items() if n > 1) == [], f"one `{EXPLAINED}` line per module"


def test_the_sweep_checks_run_before_the_folder_and_the_parent_run_are_made():
    """Hydra calls the callbacks in conf/config.yaml's order: a check that refuses a sweep must come
    before OutputFolders claims its folder and SweepTracking opens its parent run, or it leaves them."""
    import yaml

    order = list(yaml.safe_load((PACKAGE.parent / "conf" / "config.yaml").read_text())["hydra"]["callbacks"])
    checks = ["sweep_check", "objective_check", "slurm_check"]
    assert set(checks) <= set(order)
    assert max(order.index(c) for c in checks) < order.index("output_folder") < order.index("sweep_tracking")
