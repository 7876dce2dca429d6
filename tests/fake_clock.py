"""A fake time.perf_counter for tests of timing logic: it moves only when the code under test says it
spent time, so timings are exact whatever else the machine is doing."""

import time


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def install(monkeypatch) -> FakeClock:
    """Put a FakeClock in place of time.perf_counter (every `time.perf_counter()` call) for one test."""
    clock = FakeClock()
    monkeypatch.setattr(time, "perf_counter", clock)
    return clock
