"""Where an epoch's time goes: step timing (data wait vs compute) and a resource sampler thread.

The step clock costs two perf_counter() calls per micro-batch. The sampler runs on its own thread
every `interval` seconds (psutil and NVML calls release the GIL while they read /proc or the
driver), so the training loop never waits for it.
"""

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import psutil

from dlpipe.machine import gpu, hardware
from dlpipe.telemetry.contention import ContentionMeter, sibling_ranks

log = logging.getLogger(__name__)


@dataclass
class EpochClock:
    """Accumulates one epoch's timing. Call `waited` after each next(loader), `stepped` after each step."""

    # looked up at each call (not bound here), so the clock a test puts in its place applies throughout
    started: float = field(default_factory=lambda: time.perf_counter())
    data_wait_s: float = 0.0
    h2d_s: float | None = None
    """Seconds blocked in host-to-device copies; None when not measured (CPU training)."""
    first_batch_s: float | None = None
    samples: int = 0
    batches: int = 0
    step_times: list[float] = field(default_factory=list)
    cpu_s: Callable[[], float | None] | None = None
    """The job's cumulative CPU seconds (ResourceSampler.tree_cpu_s), for `cpu_s_per_sample`."""
    _mark: float = 0.0
    _cpu_start: float | None = None

    def __post_init__(self):
        self._mark = self.started
        self._cpu_start = self.cpu_s() if self.cpu_s is not None else None

    def waited(self) -> None:
        """The loader just handed over a batch: everything since the last mark was waiting."""
        now = time.perf_counter()
        wait = now - self._mark
        if self.first_batch_s is None:
            # includes worker start-up (fork + dataset pickling) when workers are not persistent
            self.first_batch_s = wait
        self.data_wait_s += wait

    def stepped(self, samples: int) -> None:
        now = time.perf_counter()
        self.step_times.append(now - self._mark)  # one whole micro-step: wait + compute
        self.samples += samples
        self.batches += 1
        self._mark = now

    def rates(self) -> tuple[float, float]:
        """(samples/s, data-wait share) so far: cheap enough for a progress bar."""
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        return self.samples / elapsed, min(self.data_wait_s / elapsed, 1.0)

    def summary(self) -> dict[str, float]:
        elapsed = max(time.perf_counter() - self.started, 1e-9)
        out = {
            "epoch_time_s": elapsed,
            "samples_per_s": self.samples / elapsed,
            "data_wait_s": self.data_wait_s,
            "data_wait_frac": min(self.data_wait_s / elapsed, 1.0),
            "first_batch_s": self.first_batch_s or 0.0,
        }
        if self.h2d_s is not None:
            out["h2d_s"] = self.h2d_s
            out["h2d_frac"] = min(self.h2d_s / elapsed, 1.0)
        cpu_end = self.cpu_s() if self._cpu_start is not None else None
        if cpu_end is not None and self.samples:
            # CPU per sample holds on a machine where others take CPUs: samples/s does not
            out["cpu_s_per_sample"] = max(cpu_end - self._cpu_start, 0.0) / self.samples
        if len(self.step_times) >= 2:
            q = statistics.quantiles(self.step_times, n=20)  # 5% steps: q[9] = p50, q[18] = p95
            out["step_time_p50_ms"] = q[9] * 1e3
            out["step_time_p95_ms"] = q[18] * 1e3
        return out


# CPU times tick at 10 ms (/proc reports clock ticks), so a span of a few ticks reads 0% or 200%.
# A window shorter than this is divided as if it were this long: it under-reads instead of
# inventing a 500% spike (the runner only gets such windows from toy epochs).
MIN_CPU_SPAN_S = 0.1

# Levels read at a sampling instant; window() gives their means weighted by the span each sample
# closes, so the tiny sample taken inside window() counts for as little time as it covers.
LEVEL_KEYS = ("rss_mb", "workers_rss_mb", "worker_rss_max_mb", "workers_alive", "sys_mem_used_pct", "shm_used_mb",
              "gpu_util", "gpu_mem_used_mb")


# How multiprocessing starts its helper processes: `python -c 'from multiprocessing.<name> import main...'`.
HELPER_MARK = "from multiprocessing."
TRACKING_MARK = "dlpipe.tracking.sidecar"  # `python -m` of dlpipe's tracking process (tracking.sidecar.MODULE)


class ResourceSampler:
    """Samples CPU (this process and its DataLoader workers), RSS, system memory and GPU on a thread.

    `window()` returns the figures since the previous call, so each epoch gets its own numbers.
    "Workers" are all descendant processes, including those that exited since the last sample, and
    thread workers: `thread_cpu` gives the CPU seconds they have spent so far (cumulative; the
    loader's threads count their own), which is moved from this process's CPU to the workers'.
    GPU metrics appear only when NVML works; otherwise `gpu_status` says why, once.
    """

    def __init__(
        self, interval_s: float = 0.5, cpu_budget: int | None = None, gpu_index: int | str | None = None,
        thread_cpu: Callable[[], float] | None = None, contention: ContentionMeter | None = None,
    ):
        self.interval_s = interval_s
        self._thread_cpu = thread_cpu
        self.cpu_budget = cpu_budget or hardware.cpu_budget().budget
        self._proc = psutil.Process()
        self._main_cpu_s = 0.0  # this process's own cumulative CPU at the last sample
        self._workers_cpu_s = 0.0  # high-water mark of the descendants' cumulative CPU (see _sample)
        self._helpers: dict[int, bool] = {}  # pid -> is a multiprocessing helper (see _is_helper)
        self._tracking: dict[int, bool] = {}  # pid -> is dlpipe's tracking process (_is_tracking)
        self._last_t = time.monotonic()
        self._samples: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._gpu_index = gpu_index  # an NVML index or UUID, passed through to gpu.Nvml
        self.gpu_status = "not requested"
        self.contention = contention or ContentionMeter()
        self._siblings = sibling_ranks(self._proc)  # the job's other ranks here: their CPU is the job's

    def start(self) -> "ResourceSampler":
        if self._gpu_index is not None:
            try:
                self._nvml = gpu.Nvml.open()
                self.gpu_status = "measured"
            except gpu.NvmlUnavailable as e:
                self.gpu_status = f"not available: {e}"
        # Baseline: CPU already spent (ours, live children's, reaped children's) is not ours to report.
        self._sample()
        self.contention.start()  # after the sample: the threads' waits so far are not this run's either
        with self._lock:
            self._samples.clear()
        self._thread = threading.Thread(target=self._run, name="dlpipe-sampler", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def _read_tree(self) -> tuple[float, float, int, int, int, dict[str, list[int]]]:
        """Cumulative CPU seconds of (this process, its descendants and worker threads), the
        descendants' total and largest RSS in bytes, how many of them are DataLoader workers, and the
        tree's pids by contention.GROUPS.

        A descendant's CPU is in exactly one place: its own times while it is listed, its reaper's
        children times once it was reaped (DataLoader joins its workers; forkserver workers are
        reaped by the forkserver, a descendant too). Summing both counts every worker's whole life,
        including one born and gone between two samples, with no per-pid bookkeeping.
        """
        threads = self._thread_cpu() if self._thread_cpu is not None else 0.0
        t = self._proc.cpu_times()
        main = t.user + t.system - threads
        descendants = t.children_user + t.children_system + threads
        rss = biggest = workers = 0
        pids: dict[str, list[int]] = {"main": [self._proc.pid], "workers": [], "other": []}
        for p in self._proc.children(recursive=True):
            try:
                if self._is_tracking(p):
                    pids["other"].append(p.pid)
                    continue  # dlpipe's tracking process: neither the loader's CPU nor its memory
                c = p.cpu_times()
                helper = self._is_helper(p)
                own = 0 if helper else p.memory_info().rss
            except psutil.Error:
                continue  # exited after the listing: _sample's high-water mark covers the gap
            # A helper's CPU still counts: the forkserver's children times hold its reaped workers'.
            descendants += c.user + c.system + c.children_user + c.children_system
            pids["workers"].append(p.pid)
            if not helper:
                rss += own
                biggest = max(biggest, own)
                workers += 1
        for sibling in self._siblings:
            try:
                pids["other"] += [sibling.pid, *(c.pid for c in sibling.children(recursive=True))]
            except psutil.Error:
                continue  # a rank that ended first
        return main, descendants, rss, biggest, workers, pids

    def tree_cpu_s(self) -> float | None:
        """CPU seconds the main process and its workers (live or reaped) have used so far; None if unread."""
        try:
            with self._sample_lock:
                main, descendants, *_ = self._read_tree()
        except psutil.Error:
            return None
        return main + descendants

    def _is_tracking(self, p: psutil.Process) -> bool:
        """dlpipe's tracking process (tracking.sidecar), told by its command line. Cached by pid."""
        known = self._tracking.get(p.pid)
        if known is None:
            known = TRACKING_MARK in p.cmdline()
            self._tracking[p.pid] = known
        return known

    def _is_helper(self, p: psutil.Process) -> bool:
        """multiprocessing's resource tracker or forkserver (spawn/forkserver start them): children
        of ours that live all run long but are not DataLoader workers. Cached by pid."""
        known = self._helpers.get(p.pid)
        if known is None:
            known = any(HELPER_MARK in part for part in p.cmdline())
            self._helpers[p.pid] = known
        return known

    def _sample(self) -> None:
        # The thread and window() both sample; the CPU-time deltas must not interleave.
        with self._sample_lock:
            self._sample_locked()

    def _sample_locked(self) -> None:
        now = time.monotonic()
        try:
            main_total, workers_total, rss_workers, rss_biggest, n_workers, pids = self._read_tree()
            rss = self._proc.memory_info().rss
        except psutil.Error as e:
            # Not expected for our own process; skipping is safe: the next sample's deltas cover this span.
            log.debug("resource sample skipped: %s", e)
            return
        self.contention.sample(pids)
        elapsed = max(now - self._last_t, 1e-6)
        self._last_t = now
        # The process's times tick at 10 ms and the threads' count in nanoseconds, so the main
        # process's share can dip by a tick: a high-water mark as for the workers below.
        main = max(main_total - self._main_cpu_s, 0.0)
        self._main_cpu_s = max(main_total, self._main_cpu_s)
        # A worker that exited but is not reaped yet (or is reaped between our reads) is in neither
        # sum for a moment, so the total can dip. Counting only growth above the high-water mark
        # keeps the dip from being counted a second time when the worker shows up in our children times.
        workers = max(workers_total - self._workers_cpu_s, 0.0)
        self._workers_cpu_s = max(workers_total, self._workers_cpu_s)
        s = {
            "elapsed_s": elapsed,
            "main_cpu_s": main,
            "workers_cpu_s": workers,
            "rss_mb": rss / 2**20,
            "workers_rss_mb": rss_workers / 2**20,
            # the largest single worker: a leaking persistent worker shows here even while
            # short-lived validation workers come and go in the sum above
            "worker_rss_max_mb": rss_biggest / 2**20,
            "workers_alive": float(n_workers),
            "sys_mem_used_pct": psutil.virtual_memory().percent,
        }
        shm_total, shm_free = hardware.shm_bytes(), hardware.shm_free_bytes()
        if shm_total is not None and shm_free is not None:
            # workers hand batches over through /dev/shm: Docker's 64 MB default fills up fast
            s["shm_used_mb"] = (shm_total - shm_free) / 2**20
        if self._nvml is not None:
            try:
                s["gpu_util"] = self._nvml.utilization(self._gpu_index)
                s["gpu_mem_used_mb"] = self._nvml.memory_used_bytes(self._gpu_index) / 2**20
            except gpu.NvmlUnavailable as e:
                # the GPU went away (reset, lost driver): say so once, never report a fake 0%
                self.gpu_status = f"not available: {e}"
                self._nvml = None
        with self._lock:
            self._samples.append(s)

    def window(self) -> dict[str, float]:
        """CPU use, mean memory/GPU levels and peak RSS since the last call.

        Takes one sample now, so an epoch shorter than the interval still gets numbers. CPU
        percentages are total CPU-seconds over total wall seconds, not a mean of per-sample ratios.
        """
        self._sample()
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return {}
        span = max(sum(s["elapsed_s"] for s in samples), MIN_CPU_SPAN_S)
        main = sum(s["main_cpu_s"] for s in samples)
        workers = sum(s["workers_cpu_s"] for s in samples)
        out = {
            # share of the CPU budget used by the whole process tree, in percent
            "cpu_util": 100.0 * (main + workers) / (span * self.cpu_budget),
            "cpu_main_pct": 100.0 * main / span,
            "cpu_workers_pct": 100.0 * workers / span,
            # how much the job was starved of CPU, and by whom (telemetry.contention)
            **self.contention.window(sum(s["elapsed_s"] for s in samples), main + workers),
        }
        for key in LEVEL_KEYS:
            weighted = [(s[key], s["elapsed_s"]) for s in samples if key in s]
            if weighted:
                out[key] = sum(v * w for v, w in weighted) / sum(w for _, w in weighted)
        out["rss_peak_mb"] = max(s["rss_mb"] for s in samples)
        # the whole tree at its largest: what a loader setting costs in RAM, workers included
        out["tree_rss_peak_mb"] = max(s["rss_mb"] + s["workers_rss_mb"] for s in samples)
        if out.get("workers_alive", 0) >= 0.5:
            # per worker, for comparing settings with different worker counts
            out["cpu_per_worker_pct"] = out["cpu_workers_pct"] / out["workers_alive"]
            out["worker_rss_mean_mb"] = out["workers_rss_mb"] / out["workers_alive"]
        return out
