"""What a sweep's parent says at its end: the best job by the objective and, apart, the fastest job,
each named only beyond the sweep's noise (sweeps.noise), as a headline, sentences, tags and metrics.

`dlpipe.best_job` / `dlpipe.best_run_id` and the metric `sweep/best_<objective>` name the best job by
the objective; `dlpipe.fastest_job` / `dlpipe.fastest_run_id` and `sweep/best_samples_per_s` the
fastest. Where no job leads beyond the noise those are not written, and `dlpipe.best_verdict` /
`dlpipe.fastest_verdict` say which jobs are indistinguishable (they are written in every case).
No Hydra or MLflow imports.
"""

from dataclasses import dataclass

from dlpipe.sweeps.jobs import Job
from dlpipe.sweeps.noise import Ranking, best_by, fastest
from dlpipe.sweeps.objective import Objective

VERDICT_TAGS = ("dlpipe.objective_of_sweep", "dlpipe.best_job", "dlpipe.best_run_id", "dlpipe.best_verdict",
                "dlpipe.fastest_job", "dlpipe.fastest_run_id", "dlpipe.fastest_verdict")
"""Every tag sweep_tags may write on the parent: a continued sweep drops the last attempt's."""


@dataclass
class SweepVerdict:
    objective: Objective | None
    best: Ranking | None
    """The finished jobs ranked by the objective; None without an objective or a job that logged it."""
    fastest: Ranking | None

    def headline(self) -> str:
        """`Best val_r2: job #2 lr=0.01 (0.912); fastest: indistinguishable (jobs #0-#3 within noise)`."""
        if self.best is not None:
            best = self.best.headline()
        elif self.objective is not None:
            best = f"best {self.objective.metric}: no finished job logged it"
        else:
            best = "best: no objective (no sweep.objective, no monitored metric with a known direction, no val_loss)"
        parts = [best] + ([self.fastest.headline()] if self.fastest is not None else [])
        text = "; ".join(parts)
        return text[:1].upper() + text[1:]

    def sentences(self) -> list[str]:
        """The verdicts with their evidence: the objective's first."""
        return [r.sentence() for r in (self.best, self.fastest) if r is not None]

    def tags(self) -> dict[str, str]:
        tags = {}
        if self.objective is not None:
            tags["dlpipe.objective_of_sweep"] = (f"{self.objective.metric} ({self.objective.direction}, "
                                                 f"from {self.objective.source})")
        for prefix, ranking in (("dlpipe.best", self.best), ("dlpipe.fastest", self.fastest)):
            if ranking is None:
                continue
            tags[f"{prefix}_verdict"] = ranking.sentence()
            if ranking.winner is not None:
                tags[f"{prefix}_job"] = ranking.winner.name
                tags[f"{prefix}_run_id"] = ranking.winner.run_id
        return tags

    def metrics(self) -> dict[str, float]:
        """The winners' values, under `sweep/` (the UI's chart view never mixes the parent with its children)."""
        out = {}
        for ranking in (self.best, self.fastest):
            if ranking is not None and ranking.winner is not None:
                out[f"sweep/best_{ranking.metric}"] = ranking.winner.metrics[ranking.metric]
        return out

    def marked(self, metric: str) -> list[Job] | None:
        """The jobs a chart panel of `metric` marks as the winner ([] for none), or None where the
        verdict does not rank that metric (the panel ranks itself)."""
        for ranking in (self.best, self.fastest):
            if ranking is not None and ranking.metric == metric:
                return [ranking.winner] if ranking.winner is not None else []
        return None


def judge(jobs: list[Job], objective: Objective | None) -> SweepVerdict:
    best = best_by(jobs, objective.metric, objective.higher) if objective is not None else None
    return SweepVerdict(objective, best, fastest(jobs))
