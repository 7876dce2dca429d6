"""The guide and the reference pages hold: README.md and every docs/*.md page (found by glob, so a new
page is covered the day it is added).

- every ```yaml block parses, and one that is a recipe (`# @package _global_`) composes as a recipe;
- every relative link `[text](path)` and `[text](path#anchor)` points at a file that exists and, for
  an anchor, at a heading of that page (GitHub's anchor for it);
- every `dlpipe ...` command in a ```bash block composes in-process with Hydra's compose API against
  the package's conf/ and recipes, so a key or option renamed in code fails here. Subcommands are
  mapped to the config the `dlpipe` command gives them; Hydra's flags are dropped; a sweep composes
  once per swept value. What cannot be composed is skipped with the reason;
- every dotted name `dlpipe.a.b` (three parts or more: two-part names such as `dlpipe.verdict` are
  MLflow tags) imports, so a module moved in code fails here;
- README.md links every docs page.

A block that is deliberately not checked (a YAML fragment, say) carries the marker line
`<!-- docs-test: skip (REASON) -->` right above its opening fence. Use it sparingly.

In-process and fast: no `dlpipe` or `mlflow` subprocess.
"""

import importlib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType

from dlpipe.config.paths import conf_dir
from dlpipe.config.resolvers import register_resolvers
from dlpipe.config.store import register_recipes, register_schemas

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
SKIP_MARKER = re.compile(r"<!--\s*docs-test:\s*skip\s*\((?P<reason>[^)]+)\)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w+-]*)")


@dataclass
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    skip: str | None  # the marker's reason, when the block is marked

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a page."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, start = m["fence"], i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i])
            i += 1
        above = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = SKIP_MARKER.search(above)
        found.append(Block(page, start + 1, m["lang"].lower(), "\n".join(body), marker["reason"] if marker else None))
        i += 1
    return found


def prose(page: Path) -> str:
    """The page without its fenced blocks and inline code: where links and headings live."""
    lines, inside, fence = [], False, ""
    for line in page.read_text(encoding="utf-8").splitlines():
        m = FENCE.match(line)
        if m and (not inside or line.strip().startswith(fence)):
            inside, fence = (not inside), m["fence"]
            lines.append("")
            continue
        lines.append("" if inside else line)
    return "\n".join(lines)


# -- YAML ---------------------------------------------------------------------------------------

YAML_BLOCKS = [b for page in PAGES for b in blocks(page) if b.lang in ("yaml", "yml")]


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=lambda b: b.where)
def test_yaml_blocks_parse(block):
    if block.skip:
        pytest.skip(block.skip)
    yaml.safe_load(block.text)


# -- links and anchors --------------------------------------------------------------------------

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\((?P<target>[^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(?P<text>.+?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, lower case, punctuation but - and _ dropped,
    spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(page).splitlines():
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m["text"])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def relative_links(page: Path) -> list[str]:
    text = re.sub(r"`[^`\n]*`", "", prose(page))  # `[x](y)` in inline code is not a link
    return [m["target"] for m in LINK.finditer(text) if not re.match(r"[a-z][a-z0-9+.-]*:", m["target"])]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: broken links:\n" + "\n".join(broken)


def test_readme_links_every_docs_page():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in relative_links(README)}
    missing = [str(p.relative_to(ROOT)) for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"README.md does not link: {', '.join(missing)}"


# -- dotted names -------------------------------------------------------------------------------

DOTTED = re.compile(r"(?<![\w./-])dlpipe(?:\.[A-Za-z_]\w*){2,}")


def importable(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_dotted_dlpipe_names_import(page):
    names = sorted(set(DOTTED.findall(page.read_text(encoding="utf-8"))))
    missing = [n for n in names if not importable(n)]
    assert not missing, f"{page.relative_to(ROOT)} names what does not import: {', '.join(missing)}"


# -- dlpipe commands ----------------------------------------------------------------------------

SHELL_LANGS = ("bash", "sh", "shell", "console")
SEPARATORS = {"&&", "||", ";", "|", "&"}
# Hydra's flags that print or pick what to print, never change the config: dropped. Value: whether
# the flag takes the next word (`--cfg job`; `--info` takes one only when it is not an override).
PRINT_FLAGS = {"--cfg": True, "-c": True, "--resolve": False, "--info": None, "-i": None, "--help": False,
               "-h": False, "--hydra-help": False, "--version": False, "--multirun": False, "-m": False}
CONFIG_FLAGS = ("--config-dir", "-cd", "--config-path", "-cp", "--config-name", "-cn")
# `dlpipe COMMAND ARGS` is `dlpipe ARGS task=COMMAND` (dlpipe/cli.py: main); plan also writes nothing.
TASKS = ("bench", "tune", "eval")


def plan_overrides() -> list[str]:
    from dlpipe.cli import PLAN_OVERRIDES

    return list(PLAN_OVERRIDES)


@dataclass
class Command:
    block: Block
    offset: int  # the command's first line in the block, from 1
    line: str
    args: list[str]

    @property
    def where(self) -> str:
        return f"{self.block.page.relative_to(ROOT)}:{self.block.line + self.offset}"

    @property
    def id(self) -> str:
        return f"{self.where}: {self.line.strip()[:70]}"


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(first line in the block, line) with `\\` continuations joined and `$ ` prompts dropped."""
    out, pending, start = [], "", 1
    for n, raw in enumerate(text.splitlines(), 1):
        if not pending:
            start = n
        line = pending + raw
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        out.append((start, re.sub(r"^\s*\$\s+", "", line)))
    return out


def words(line: str) -> list[list[str]]:
    """The simple commands of a shell line, each as its words (comments dropped)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
    lexer.whitespace_split = True
    commands, current = [], []
    for word in lexer:
        if word in SEPARATORS:
            commands.append(current)
            current = []
        else:
            current.append(word)
    return [c for c in [*commands, current] if c]


def dlpipe_args(argv: list[str]) -> list[str] | None:
    """The arguments given to dlpipe by one simple command, or None when it does not run dlpipe."""
    while argv and re.match(r"^[A-Za-z_]\w*=", argv[0]):  # VAR=value dlpipe ...
        argv = argv[1:]
    if not argv:
        return None
    if argv[0] == "dlpipe":
        return argv[1:]
    for i, word in enumerate(argv[:-1]):  # python -m dlpipe, torchrun ... -m dlpipe
        if word == "-m" and argv[i + 1] == "dlpipe":
            return argv[i + 2:]
    if argv[:2] == ["docker", "run"] and "dlpipe" in argv:  # the image's entry point is dlpipe
        return argv[len(argv) - argv[::-1].index("dlpipe"):]
    return None


def commands() -> list[Command]:
    found = []
    for page in PAGES:
        for block in blocks(page):
            if block.lang not in SHELL_LANGS:
                continue
            for offset, line in logical_lines(block.text):
                try:
                    simple = words(line)
                except ValueError:  # an unbalanced quote: not a command line (console output)
                    continue
                for argv in simple:
                    args = dlpipe_args(argv)
                    if args is not None:
                        found.append(Command(block, offset, line, args))
    return found


def overrides_of(args: list[str]) -> tuple[list[str] | None, str | None]:
    """(Hydra overrides a `dlpipe ARGS` line composes, None) or (None, why it cannot be composed)."""
    args = [a for a in args if a != "..."]  # an ellipsis in prose: "and so on"
    extra = []
    if args[:1] == ["sync"]:
        return None, "dlpipe sync takes output folders, not config overrides"
    if args[:1] == ["plan"]:
        args, extra = args[1:], plan_overrides()
    elif args[:1] and args[0] in TASKS:
        args, extra = args[1:], [f"task={args[0]}"]
    overrides, i = [], 0
    while i < len(args):
        arg = args[i]
        flag = arg.split("=", 1)[0]
        if flag in CONFIG_FLAGS:
            return None, f"{flag} names a config folder of the reader's own"
        if flag in PRINT_FLAGS:
            takes = PRINT_FLAGS[flag]
            if "=" not in arg and (takes or (takes is None and i + 1 < len(args) and "=" not in args[i + 1])):
                i += 1
            i += 1
            continue
        if arg.startswith("-"):
            return None, f"{arg}: a flag this test does not know"
        overrides.append(arg)
        i += 1
    return overrides + extra, None


def swept_values(override) -> list[str | None]:
    """The values a swept key takes: each of a choice or range, both ends of an interval (Optuna's
    search space: `tag(log,interval(1e-4,1e-1))`); [None] for a key that is not swept."""
    if not override.is_sweep_override():
        return [None]
    if override.value_type == ValueType.INTERVAL_SWEEP:
        return [str(override.value().start), str(override.value().end)]
    return list(override.sweep_string_iterator())


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """One override list per swept value: every value of each swept key, the others at their first."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    values = [swept_values(o) for o in parsed]
    first = [o.input_line if v[0] is None else f"{o.get_key_element()}={v[0]}" for o, v in zip(parsed, values)]
    points = [first]
    for k, (o, vs) in enumerate(zip(parsed, values)):
        for v in vs[1:]:
            points.append([*first[:k], f"{o.get_key_element()}={v}", *first[k + 1:]])
    return points


@pytest.fixture(scope="module")
def hydra_conf():
    """Hydra initialised on the package's conf/, with dlpipe's resolvers, schema and recipes."""
    register_resolvers()
    register_schemas()
    register_recipes()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        yield


def composes(overrides: list[str]):
    return compose("config", overrides=overrides, return_hydra_config=any(o.startswith("hydra") for o in overrides))


COMMANDS = commands()


def test_the_docs_hold_commands():
    """The parser finds the commands (a broken parser would pass every page vacuously)."""
    assert len(COMMANDS) >= 40, [c.id for c in COMMANDS]
    assert any(c.args[:1] == ["plan"] for c in COMMANDS) and any("--multirun" in c.args for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: c.id)
def test_dlpipe_commands_compose(command, hydra_conf):
    overrides, why_not = overrides_of(command.args)
    if overrides is None:
        pytest.skip(why_not)
    if any(o.startswith("hydra/launcher=") for o in overrides):
        pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    multirun = bool({"--multirun", "-m"} & set(command.args))
    for point in sweep_points(overrides) if multirun else [overrides]:
        try:
            composes(point)
        except Exception as e:  # noqa: BLE001 (whatever Hydra raises, the line is the message)
            pytest.fail(f"{command.where}: `{command.line.strip()}` does not compose "
                        f"(overrides {point}): {type(e).__name__}: {e}")


RECIPE_BLOCKS = [b for b in YAML_BLOCKS if b.text.lstrip().startswith("# @package _global_") and not b.skip]


@pytest.mark.parametrize("block", RECIPE_BLOCKS, ids=lambda b: b.where)
def test_recipe_blocks_compose(block, hydra_conf, tmp_path):
    """A recipe shown in the docs composes as one, from a folder of its own (as on DLPIPE_RECIPE_PATH)."""
    name = f"docs_{block.page.stem}_{block.line}"
    (tmp_path / f"{name}.yaml").write_text(block.text + "\n", encoding="utf-8")
    register_recipes([tmp_path])
    composes([f"+recipe={name}"])
