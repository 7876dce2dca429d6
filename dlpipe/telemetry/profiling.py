"""Opt-in deep looks at a run: torch.profiler over a few micro-steps, tracemalloc at the end.

Both write plain files into an output folder (the caller decides whether to log them as
artifacts). Nothing starts at import: each object starts its tool in `start()` and stops it in
`finish()`, which is idempotent so a `finally:` can call it after an early one.
"""

import logging
import pathlib
import tracemalloc

import torch
import torch.profiler

log = logging.getLogger(__name__)

TABLE_NAME = "profile_table.txt"
TRACE_NAME = "profile_trace.json"
TRACEMALLOC_NAME = "tracemalloc_top.txt"


class StepProfiler:
    """Runs torch.profiler over a few training steps and writes its results to files."""

    def __init__(self, out_dir: pathlib.Path, steps: int, wait: int = 5, device_type: str = "cpu"):
        if steps < 0 or wait < 0:
            raise ValueError(f"profile window needs steps >= 0 and wait >= 0, got steps={steps}, wait={wait}")
        self.out_dir = pathlib.Path(out_dir)
        self.steps = steps
        self.wait = wait
        self.enabled = steps > 0
        # Without a CUDA activity the table has no device times to sort by.
        self.cuda = device_type == "cuda" and torch.cuda.is_available()
        self._prof: torch.profiler.profile | None = None
        self._started = False
        self._taken = 0  # step() calls: micro-steps the runner finished while profiling
        self._written: list[pathlib.Path] | None = None  # set by on_trace_ready
        self._result: list[pathlib.Path] | None = None  # set by finish()
        if not self.enabled:
            return  # steps=0: no profiler object at all, so nothing can cost time
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(
            activities=activities,
            # Skip `wait` micro-steps: worker start-up and first-iteration allocations would
            # dominate otherwise; one warm-up step lets the profiler's own start-up cost settle.
            schedule=torch.profiler.schedule(wait=wait, warmup=1, active=steps, repeat=1),
            # Called when the active window completes (or at stop() inside it), so the files exist
            # even if training goes on for hours afterwards.
            on_trace_ready=self._write,
            record_shapes=True,
            profile_memory=True,
            with_stack=False,  # stack capture is slow and makes the trace huge
        )

    def start(self) -> None:
        """Enter the profiler; call before the first micro-step."""
        if self._prof is None or self._started:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._prof.__enter__()
        self._started = True

    def step(self) -> None:
        """Mark the end of one micro-step."""
        if self._prof is None or not self._started:
            return
        self._prof.step()
        self._taken += 1
        if self._written is not None:
            # The window is written: leave the profiler now rather than keep its per-step
            # bookkeeping (and its hold on the recorded events) for the rest of training.
            self._close()

    def finish(self) -> list[pathlib.Path]:
        """Stop the profiler if still running and return the files written (idempotent)."""
        if self._result is not None:
            return self._result
        if self._prof is not None and self._started:
            # Stopping inside the active window still calls on_trace_ready: a run that ended early
            # writes the steps it had; one that stopped before the window writes nothing.
            self._close()
        if self.enabled and self._written is None:
            log.warning(
                "trainer/telemetry profile window (wait=%d, steps=%d) was never reached: "
                "the run had only %d micro-steps",
                self.wait, self.steps, self._taken,
            )
        self._result = [p for p in self._written or [] if p.exists()]
        return self._result

    def _close(self) -> None:
        prof, self._prof = self._prof, None  # cleared first: a failing exit must not be retried
        prof.__exit__(None, None, None)

    def _write(self, prof: torch.profiler.profile) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        table_path, trace_path = self.out_dir / TABLE_NAME, self.out_dir / TRACE_NAME
        sort_by = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table_path.write_text(prof.key_averages().table(sort_by=sort_by, row_limit=30) + "\n", encoding="utf-8")
        prof.export_chrome_trace(str(trace_path))
        self._written = [table_path, trace_path]
        log.info("profile of %d micro-steps written to %s and %s", self.steps, table_path, trace_path)


class AllocationSnapshot:
    """tracemalloc: the top Python allocations at the end of a run."""

    def __init__(self, out_dir: pathlib.Path, enabled: bool, top: int = 25):
        self.out_dir = pathlib.Path(out_dir)
        self.enabled = enabled
        self.top = top
        self._started = False
        self._was_tracing = False
        self._result: list[pathlib.Path] | None = None

    def start(self) -> None:
        if not self.enabled or self._started:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        # Someone else (python -X tracemalloc) may already trace: then it is theirs to stop.
        self._was_tracing = tracemalloc.is_tracing()
        tracemalloc.start(10)  # 10 frames: enough to see the caller in user code
        self._started = True

    def finish(self) -> list[pathlib.Path]:
        """Write the top allocations by line to tracemalloc_top.txt and stop tracing (idempotent)."""
        if self._result is not None:
            return self._result
        if not self.enabled:
            self._result = []
            return self._result
        if not self._started or not tracemalloc.is_tracing():
            log.warning("tracemalloc snapshot skipped: tracing was not running at the end of the run")
            self._result = []
            return self._result
        snapshot = tracemalloc.take_snapshot()
        if not self._was_tracing:
            tracemalloc.stop()  # frees tracemalloc's own memory, which grows with every allocation
        # tracemalloc's and the import machinery's own allocations are noise, not the run's.
        snapshot = snapshot.filter_traces([
            tracemalloc.Filter(False, tracemalloc.__file__),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
            tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
        ])
        lines = []
        for stat in snapshot.statistics("lineno")[: self.top]:
            frame = stat.traceback[0]
            lines.append(f"{stat.size / 1024:12.1f} KiB {stat.count:9d}  {frame.filename}:{frame.lineno}\n")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / TRACEMALLOC_NAME
        path.write_text("".join(lines), encoding="utf-8")
        self._result = [path]
        return self._result
