"""The job-to-tracking interface (tracking.protocols.JobRun): every run class a job may get takes
every call with the same signature, and the tracking process forwards exactly those calls."""

import ast
import inspect
from pathlib import Path

import pytest

from dlpipe.tracking import sidecar_run
from dlpipe.tracking.null_run import NullRun
from dlpipe.tracking.protocols import JobRun
from dlpipe.tracking.run import MlflowRun
from dlpipe.tracking.sidecar_run import SidecarRun

CALLS = sorted(name for name, member in vars(JobRun).items()
               if callable(member) and (not name.startswith("_") or name in ("__enter__", "__exit__")))


def parameters(function) -> list[tuple[str, object]]:
    """Names and defaults, annotations left out: NullRun's one-liners need none to match."""
    return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]


def test_the_protocol_declares_what_the_tasks_call():
    assert {"log_params", "log_metrics", "flush", "set_tags", "log_text", "log_inputs", "log_artifact",
            "log_pytorch_model", "watch_system", "end", "__enter__", "__exit__"} == set(CALLS)
    assert {"run_id", "status"} <= set(JobRun.__annotations__)


@pytest.mark.parametrize("implementation", [MlflowRun, SidecarRun, NullRun], ids=lambda c: c.__name__)
@pytest.mark.parametrize("call", CALLS)
def test_every_run_class_takes_every_call_alike(implementation, call):
    assert parameters(getattr(implementation, call)) == parameters(getattr(JobRun, call))


@pytest.mark.parametrize("implementation", [SidecarRun, NullRun], ids=lambda c: c.__name__)
def test_a_run_not_opened_has_no_id_and_no_status(implementation):
    """(MlflowRun opens in its constructor: its ids are checked on real runs in test_tracking.)"""
    assert implementation.run_id is None and implementation.status is None


def test_the_tracking_process_is_sent_only_calls_its_run_takes():
    """SidecarRun sends calls by name, and the tracking process runs getattr(MlflowRun, name): a
    name MlflowRun lacks would fail only at run time, in another process."""
    tree = ast.parse(Path(sidecar_run.__file__).read_text())
    sent = {node.args[0].value for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("_send", "_ask") and isinstance(node.args[0], ast.Constant)}
    handled_by_the_process = {"prepare", "open"}  # tracking.sidecar.Host answers these itself
    assert sent - handled_by_the_process <= {*CALLS, "write_rows"}
    assert all(callable(getattr(MlflowRun, name, None)) for name in sent - handled_by_the_process)
    assert {"log_params", "set_tags", "log_text", "log_inputs", "log_artifact", "log_pytorch_model",
            "watch_system", "write_rows", "end"} <= sent
