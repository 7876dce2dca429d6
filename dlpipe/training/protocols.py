"""What the training loop needs from the rest of the job, as Protocols: somewhere to send metrics
and, in a data-parallel job, the other ranks. Tests pass small stand-ins."""

from typing import Protocol


class MetricSink(Protocol):
    """What the loop needs from a tracker: cheap metric recording, and a flush between epochs."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...

    def flush(self) -> None: ...


class Peers(Protocol):
    """The other ranks of a data-parallel job (dlpipe.training.distributed.Collectives)."""

    def sum(self, values: list[float]) -> list[float]: ...

    def any(self, flag: bool) -> bool: ...

    def barrier(self) -> None: ...

    def epoch_row(self, row: dict[str, float]) -> dict[str, float]: ...


class NoMetrics:
    """A MetricSink that drops everything (no tracker)."""

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        return None

    def flush(self) -> None:
        return None
