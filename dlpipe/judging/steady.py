"""Verdicts that do not flip between epochs on the same evidence (hysteresis).

Each of the verdict's thresholds (the data wait that makes an epoch input-bound, the item cost under
which items are cheap, the CPU use that saturates the budget, the run-queue share that makes an epoch
contended, the share of copies) is crossed from the side the previous verdict on the same evidence
(judging.advice.Evidence.previous: one per job) took only when the figure passes it by a band; the
first verdict of a job, and any verdict without a previous one, uses the bare threshold. So epochs
whose figures wander around a threshold keep one answer, and it changes when the evidence moves beyond
the noise. The bands, from epoch-to-epoch spreads measured on the 2-CPU machine (2026-12-06):
- data wait: 0.05 of the epoch. `trainer.devices=2` on the tabular recipe read 28%, 19% and 31% in
  three epochs of the same run beside other work (the middle one flipped to compute-bound);
- item cost: 1.5x, relative. The same run's per-item wait moved 31-35 us per epoch; under torchrun
  the first epoch's start-up alone moved it by more than a third;
- CPU use: 5 points of the budget; copies: 0.05 of the epoch;
- run-queue share: 0.08 (the smoke recipe's shares of 37-80% beside other work and 5-27% quiet leave
  the third in between with room on both sides);
- the job's CPU demand over its budget (contention "from inside"): 0.15 of the budget. The tabular
  recipe under `trainer.devices=2` wanted 1.3 CPUs of its 1 in two epochs and less in the third.
"""

WAIT_BAND = 0.05
COST_BAND = 1.5
CPU_BAND = 5.0
SHARE_BAND = 0.08
OVER_BAND = 0.15


def above(previous: dict | None, key: str, value: float, threshold: float, band: float,
          relative: bool = False) -> bool:
    """Whether `value` is at or over `threshold`, with the band against the previous answer under `key`
    (`relative`: the band is a factor); the answer is recorded there for the next verdict. `previous`
    None: the bare threshold, nothing recorded."""
    was = None if previous is None else previous.get(key)
    if was is None:
        edge = threshold
    elif relative:
        edge = threshold / band if was else threshold * band
    else:
        edge = threshold - band if was else threshold + band
    now = value >= edge
    if previous is not None:
        previous[key] = now
    return now
