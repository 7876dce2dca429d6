"""Where an epoch's time goes: step timing (data wait vs compute) and a resource sampler thread.

The step clock costs two perf_counter() calls per micro-batch. The sampler runs on its own thread
every `interval` seconds (psutil and NVML calls release the GIL while they read /proc or the
driver), so the training loop never waits for it.
"""

import statistics
import threading
import time
from dataclasses import dataclass, field

import psutil

from dlpipe import gpu, hardware


@dataclass
class EpochClock:
    """Accumulates one epoch's timing. Call `waited` after each next(loader), `stepped` after each step."""

    started: float = field(default_factory=time.perf_counter)
    data_wait_s: float = 0.0
    first_batch_s: float | None = None
    samples: int = 0
    batches: int = 0
    step_times: list[float] = field(default_factory=list)
    _mark: float = 0.0

    def __post_init__(self):
        self._mark = self.started

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
        if len(self.step_times) >= 2:
            q = statistics.quantiles(self.step_times, n=20)  # 5% steps: q[9] = p50, q[18] = p95
            out["step_time_p50_ms"] = q[9] * 1e3
            out["step_time_p95_ms"] = q[18] * 1e3
        return out


class ResourceSampler:
    """Samples CPU (this process and its DataLoader workers), RSS, system memory and GPU on a thread.

    `window()` returns the means since the previous call, so each epoch gets its own numbers.
    GPU metrics appear only when NVML works; otherwise `gpu_status` says why, once.
    """

    def __init__(self, interval_s: float = 0.5, cpu_budget: int | None = None, gpu_index: int | None = None):
        self.interval_s = interval_s
        self.cpu_budget = cpu_budget or hardware.cpu_budget().budget
        self._proc = psutil.Process()
        self._last_cpu: dict[int, float] = {}
        self._last_t = time.monotonic()
        self._samples: list[dict[str, float]] = []
        self._lock = threading.Lock()
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml = None
        self._gpu_index = gpu_index
        self.gpu_status = "not requested"

    def start(self) -> "ResourceSampler":
        if self._gpu_index is not None:
            try:
                self._nvml = gpu.Nvml.open()
                self.gpu_status = "measured"
            except gpu.NvmlUnavailable as e:
                self.gpu_status = f"not available: {e}"
        self._sample()  # baseline for the CPU-time deltas
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

    def _cpu_seconds(self) -> tuple[float, float, float, int]:
        """(main cpu-seconds delta, workers cpu-seconds delta, workers RSS bytes, worker count)."""
        main = workers = rss_workers = 0.0
        procs = [self._proc]
        try:
            procs += self._proc.children(recursive=True)
        except psutil.Error:
            pass  # the process table changed under us; the next sample catches up
        seen = {}
        for p in procs:
            try:
                t = p.cpu_times()
                total = t.user + t.system
                rss = p.memory_info().rss if p is not self._proc else 0
            except psutil.Error:
                continue  # a worker that exited between listing and reading
            seen[p.pid] = total
            delta = total - self._last_cpu.get(p.pid, total if p is not self._proc else 0.0)
            if p is self._proc:
                main = delta
            else:
                workers += delta
                rss_workers += rss
        self._last_cpu = seen
        return main, workers, rss_workers, len(procs) - 1

    def _sample(self) -> None:
        # The thread and window() both sample; the CPU-time deltas must not interleave.
        with self._sample_lock:
            self._sample_locked()

    def _sample_locked(self) -> None:
        now = time.monotonic()
        elapsed = max(now - self._last_t, 1e-6)
        self._last_t = now
        main, workers, rss_workers, n_workers = self._cpu_seconds()
        s = {
            # share of the CPU budget used by the whole process tree, in percent
            "cpu_util": 100.0 * (main + workers) / (elapsed * self.cpu_budget),
            "cpu_main_pct": 100.0 * main / elapsed,
            "cpu_workers_pct": 100.0 * workers / elapsed,
            "rss_mb": self._proc.memory_info().rss / 2**20,
            "workers_rss_mb": rss_workers / 2**20,
            "workers_alive": float(n_workers),
            "sys_mem_used_pct": psutil.virtual_memory().percent,
        }
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
        """Means of the samples since the last call, plus the peak RSS.

        Takes one sample now, so an epoch shorter than the interval still gets numbers.
        """
        self._sample()
        with self._lock:
            samples, self._samples = self._samples, []
        if not samples:
            return {}
        out = {k: statistics.fmean(s[k] for s in samples if k in s) for k in samples[0]}
        out["rss_peak_mb"] = max(s["rss_mb"] for s in samples)
        return out
