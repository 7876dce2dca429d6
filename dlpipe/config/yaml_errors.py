"""A config file that is not YAML dlpipe can read, as one line: `FILE:LINE: what is wrong; fix ...`.

PyYAML's errors carry the file and line (its marks) over several lines; Hydra raises them as they
are for a file under --config-dir (or --config-name's), and OmegaConf.load for a recipe.
"""

import yaml


def _yaml_fix(problem: str) -> str:
    if "constructor for the tag" in problem:  # !!python/object and the like: PyYAML's safe loader refuses them
        return "remove the tag: config files are plain YAML (a class is named by _target_, built by dlpipe)"
    if problem.startswith("found duplicate key"):
        return "keep one of them"
    return "fix the YAML there (indentation, a missing ':' or a bracket or quote left open)"


def yaml_problem(error: yaml.YAMLError) -> str:
    """`FILE:LINE: what PyYAML found (while ... from line N); fix ...` for a config file that does not parse."""
    mark = getattr(error, "problem_mark", None) or getattr(error, "context_mark", None)
    where = f"{mark.name}:{mark.line + 1}" if mark else "a config file"
    problem = getattr(error, "problem", None) or str(error).splitlines()[0]
    context, since = getattr(error, "context", None), getattr(error, "context_mark", None)
    if context and since is not None and mark is not None and since.line != mark.line:
        problem += f" ({context} from line {since.line + 1})"
    elif context:
        problem += f" ({context})"
    return f"{where}: {problem}; {_yaml_fix(problem)}"
