"""What a sweep's jobs are ranked by: the objective, and the metric their checkpoints monitored.

The objective comes from the children, first found wins:
1. the tags `dlpipe.objective` (its MLflow name, e.g. `val/r2`) and `dlpipe.objective_direction`
   (`min` or `max`, as decided: `auto` made one), which every training job with an objective carries:
   `sweep.objective`, or by default the metric checkpoint.monitor names (its param `sweep.objective`,
   null, says which);
2. from runs older than those tags, the param `checkpoint.monitor` where its direction is known (the
   param `checkpoint.mode` when it is min or max, or a name ending in `loss`);
3. `val_loss` (min), where the children logged it;
otherwise there is none, and the sweep names no best job (the fastest is named apart anyway).
No Hydra or MLflow imports: the inputs are MLflow `Run`-like objects.
"""

from dataclasses import dataclass

from dlpipe.tracking.metric_names import dlpipe_name

# The tags are read here and written by the job (tasks.tracking_run), which imports these names.
OBJECTIVE_TAG = "dlpipe.objective"
DIRECTION_TAG = "dlpipe.objective_direction"
MONITOR_PARAM, MODE_PARAM, OBJECTIVE_PARAM = "checkpoint.monitor", "checkpoint.mode", "sweep.objective"
UNSET = ("null", "None", "")  # how MLflow holds a null param
DIRECTIONS = ("min", "max")


@dataclass(frozen=True)
class Objective:
    metric: str
    """dlpipe's name of the metric (`val_r2`), as Job.metrics holds it."""
    direction: str
    """min or max."""
    source: str
    """Where it came from, for the summary: `sweep.objective`, `checkpoint.monitor` or `default`."""

    @property
    def higher(self) -> bool:
        return self.direction == "max"


def monitored(run) -> str | None:
    """The metric the run's checkpoints monitored (dlpipe's name), or None (`checkpoint.monitor=null`)."""
    name = run.data.params.get(MONITOR_PARAM, "val_loss")
    return None if name in UNSET else dlpipe_name(name)


def _monitor_direction(run, metric: str) -> str | None:
    stated = run.data.params.get(MODE_PARAM)
    if stated in DIRECTIONS:
        return stated
    return "min" if metric.endswith("loss") else None


def sweep_objective(children) -> Objective | None:
    """The objective the sweep ranks its jobs by (see the module's docstring), or None."""
    for run in children:
        tags = run.data.tags
        if tags.get(OBJECTIVE_TAG) and tags.get(DIRECTION_TAG) in DIRECTIONS:
            given = run.data.params.get(OBJECTIVE_PARAM, "null") not in UNSET
            return Objective(dlpipe_name(tags[OBJECTIVE_TAG]), tags[DIRECTION_TAG],
                             "sweep.objective" if given else "checkpoint.monitor")
    for run in children:
        metric = monitored(run)
        direction = metric and _monitor_direction(run, metric)
        if direction and any(_logged(c, metric) for c in children):
            return Objective(metric, direction, "checkpoint.monitor")
    if any(_logged(c, "val_loss") for c in children):
        return Objective("val_loss", "min", "default")
    return None


def _logged(run, metric: str) -> bool:
    """Whether the run logged `metric` (dlpipe's name) under any of its names."""
    return any(dlpipe_name(k) == metric for k in run.data.metrics)


def monitored_metrics(children) -> list[str]:
    """Every metric the children's checkpoints monitored, in the children's order, once each."""
    return list(dict.fromkeys(m for m in map(monitored, children) if m))
