"""The lowest versions pyproject.toml allows, one exact pin per direct dependency:

    python tools/floors.py [pyproject.toml] > floors.txt && pip install -r floors.txt ".[test-tools]"

CI (.ci/run) installs these in a venv of their own and runs a smoke subset of the tests, so a floor
the code outgrew fails CI instead of a user's install. Read from pyproject.toml each time, so the pins
cannot drift from the ranges. Every dependency must have a `>=` floor naming a real release (`==6`
matches 6.0 but `==12.535` matches no nvidia-ml-py release): pip then refuses a floor that is not one.
Standard library only, so it runs before any venv exists.
"""

import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
# name, optional [extras], optional environment marker after ';' (PEP 508, the subset used here)
REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;]*)(;.*)?$")


def floor_pin(requirement: str) -> str:
    """`torch>=2.3` -> `torch==2.3`; a ValueError for a requirement without a `>=` floor."""
    match = REQUIREMENT.match(requirement)
    if not match:
        raise ValueError(f"{requirement!r}: not a requirement this script reads")
    name, extras, specifiers, marker = match.groups()
    floors = [s.strip()[2:].strip() for s in specifiers.split(",") if s.strip().startswith(">=")]
    if len(floors) != 1:
        raise ValueError(f"{requirement!r}: needs exactly one '>=' floor, so CI can install and test it")
    return f"{name}{extras or ''}=={floors[0]}{marker or ''}"


def floor_pins(pyproject: Path = PYPROJECT) -> list[str]:
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return [floor_pin(d) for d in dependencies]


def main(argv: list[str]) -> int:
    try:
        pins = floor_pins(Path(argv[0]) if argv else PYPROJECT)
    except ValueError as e:
        print(f"floors: error: {e}", file=sys.stderr)
        return 1
    print("\n".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
