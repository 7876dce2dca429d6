"""A dataset that waits at a known item for a stop signal from outside (a Slurm `scancel
--signal`, a preemption), importable by a dlpipe job on the test cluster (PYTHONPATH=tests)."""

import os
import time

from faulty_data import SignalsItself

from dlpipe.stop import stopping


class WaitsForAStop(SignalsItself):
    """SignalsItself's data (so a run's numbers compare with its runs'), signalling nothing: at the
    `at`-th item fetched it writes `marker` and waits, up to `wait_s`, until the job begins to stop
    (dlpipe's stop clock), so an outside signal lands at a known item whatever its delivery takes.
    Once: with `marker` there (a requeued job starts again), it trains straight on."""

    def __init__(self, marker: str, at: int, wait_s: float = 120.0, **kwargs):
        super().__init__(marker=marker, at=-1, **kwargs)
        self.wait_at, self.wait_s, self.seen = at, wait_s, 0

    def __getitem__(self, i):
        self.seen += 1
        if self.seen == self.wait_at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            deadline = time.monotonic() + self.wait_s
            while not stopping() and time.monotonic() < deadline:
                time.sleep(0.05)
        return super().__getitem__(i)
