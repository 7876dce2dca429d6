"""When a sweep names a winner (sweeps/noise.py): only beyond the noise measured in that sweep, on
jobs with controlled metric histories."""

import pytest

from dlpipe.sweeps.jobs import Job
from dlpipe.sweeps.noise import best_by, contention_share, epoch_contention, epoch_spread, fastest, last_spread


def job(number: int, speeds: list[float], status: str = "FINISHED", settings=None, **history: list[float]) -> Job:
    """A job whose samples/s per epoch are `speeds` (the last one is what the table shows) and whose
    other per-epoch figures are `history`, epochs numbered from 1 as the runner logs them."""
    series = {"samples_per_s": speeds, **history}
    return Job(number, f"loader.num_workers={number}", status,
               metrics={name: values[-1] for name, values in series.items()}, run_id=f"run{number}",
               settings=settings or (("loader.num_workers", str(number)),),
               history={name: dict(enumerate(values, start=1)) for name, values in series.items()})


def test_the_issues_repeated_setting_makes_its_gap_noise():
    """`loader.num_workers=0,2 loader.pin_memory=false,true` without CUDA: jobs #2 and #3 ran the
    same effective settings at 87.2 and 29.3 samples/s. Nothing within that 3x of the top is a
    winner: the fastest is not named, and the sentence says which jobs are indistinguishable."""
    same = (("loader.num_workers", "2"), ("loader.pin_memory", "False"))
    jobs = [job(0, [30.0, 40.0]), job(1, [28.0, 35.0]), job(2, [80.0, 87.2], settings=same),
            job(3, [25.0, 29.3], settings=same)]
    ranking = fastest(jobs)
    assert ranking.winner is None
    assert [j.number for j in ranking.within] == [0, 1, 2, 3]
    assert ranking.headline() == "fastest: indistinguishable (jobs #0-#3 within noise)"
    assert ranking.sentence() == ("jobs #0-#3 are within the noise of this sweep (same settings up to 198% apart): "
                                  "no fastest job")


def test_a_lead_beyond_the_epoch_spread_wins_and_the_first_epoch_is_left_out():
    """Worker start-up makes a first epoch slow: it is no noise. Epochs 2-4 spread 10% at most."""
    jobs = [job(0, [50.0, 100.0, 105.0, 110.0]), job(1, [20.0, 200.0, 210.0, 205.0]),
            job(2, [100.0, 150.0, 160.0, 155.0])]
    ranking = fastest(jobs)
    assert ranking.winner is jobs[1] and ranking.within == [jobs[1]]
    assert ranking.noise == pytest.approx(0.10)
    assert ranking.headline() == "fastest: job #1 loader.num_workers=1 (205.0 samples/s)"
    assert ranking.sentence().endswith(": 32% ahead of #2 (155.0), beyond the noise of this sweep "
                                       "(10%: epoch-to-epoch spread up to 10%)")


def test_a_lead_within_the_epoch_spread_names_the_jobs_it_cannot_tell_apart():
    jobs = [job(0, [10.0, 100.0, 138.0, 120.0]), job(1, [10.0, 125.0, 130.0, 128.0]), job(2, [10.0, 60.0, 62.0, 61.0])]
    ranking = fastest(jobs)
    assert ranking.winner is None
    assert ranking.within == [jobs[0], jobs[1]]  # job #2 is beyond the noise below them: not named
    assert ranking.sentence() == ("jobs #0 and #1 are within the noise of this sweep (epoch-to-epoch spread up to "
                                  "38%): no fastest job")


def test_without_any_spread_the_min_gain_floor_still_holds():
    """One epoch a job: nothing measured, but a 2% lead is no finding anywhere in dlpipe (MIN_GAIN)."""
    close = fastest([job(0, [100.0]), job(1, [102.0])])
    assert close.winner is None and close.noise == pytest.approx(0.03)
    assert "no spread measured; floor 3%" in close.sentence()
    assert fastest([job(0, [100.0]), job(1, [104.0])]).winner.number == 1
    assert fastest([job(0, [100.0])]).winner.number == 0  # nothing to compare it with
    assert fastest([job(0, [100.0], status="FAILED")]) is None


def test_a_failed_job_is_never_the_fastest_nor_the_runner_up():
    jobs = [job(0, [100.0, 100.0]), job(1, [900.0, 900.0], status="KILLED"), job(2, [200.0, 200.0])]
    assert fastest(jobs).winner is jobs[2]


def test_epoch_contention_counts_only_what_other_processes_took():
    # threads waited 1 s per second while running 1 CPU second: half their runnable time
    assert epoch_contention({"run_queue_s_per_s": 1.0, "cpu_main_pct": 60.0, "cpu_workers_pct": 40.0,
                             "cpu_others_frac": 0.7}) == pytest.approx(0.5)
    # the same wait with others using 10% of the job's CPUs: mostly its own threads against each other
    assert epoch_contention({"run_queue_s_per_s": 1.0, "cpu_main_pct": 100.0,
                             "cpu_others_frac": 0.1}) == pytest.approx(0.1)
    assert epoch_contention({"run_queue_s_per_s": 1.0, "cpu_main_pct": 100.0, "cpu_others_frac": 0.0,
                             "cpu_steal_frac": 0.2}) == pytest.approx(0.2)  # the hypervisor took it
    # without schedstat, CPU pressure stands in for the wait; without /proc/stat figures, the wait alone
    assert epoch_contention({"cpu_pressure_frac": 0.6, "cpu_others_frac": 0.4}) == pytest.approx(0.4)
    assert epoch_contention({"cpu_pressure_frac": 0.6}) == pytest.approx(0.6)
    assert epoch_contention({}) is None


def test_contention_share_reads_the_epochs_after_the_first():
    j = job(0, [50.0, 100.0, 100.0], cpu_pressure_frac=[0.9, 0.2, 0.3], cpu_others_frac=[0.9, 0.1, 0.25])
    assert contention_share(j) == (pytest.approx(0.25), pytest.approx(0.3))
    assert contention_share(job(1, [100.0])) == (None, None)


def test_a_contended_job_measured_only_a_floor_so_nothing_beats_it():
    """The regression sweep on the shared machine: two learning rates (the same compute) at 39801.7
    and 3290.4 samples/s, the slower job's threads waiting 68% of their runnable time while other
    processes used 67% of its CPUs. No lead over a contended job is a finding."""
    quiet = {"run_queue_s_per_s": [0.1, 0.1, 0.1], "cpu_main_pct": [195.0] * 3, "cpu_others_frac": [0.02] * 3}
    busy = {"run_queue_s_per_s": [1.02, 1.35, 1.38], "cpu_main_pct": [98.0, 66.0, 62.0],
            "cpu_others_frac": [0.48, 0.66, 0.68], "cpu_pressure_frac": [0.57, 0.94, 0.97]}
    jobs = [job(0, [1459.0, 31694.4, 39801.7], **quiet), job(1, [1877.2, 2928.5, 3290.4], **busy)]
    ranking = fastest(jobs)
    assert ranking.winner is None and ranking.floors == [jobs[1]]
    assert ranking.sentence() == (
        "jobs #0 and #1 are within the noise of this sweep (epoch-to-epoch spread up to 26%, job #1 contended, up "
        "to 68% of the time lost to other processes, so samples/s only a floor, CPU pressure 0.97): no fastest job")
    # the same jobs with the machine to themselves: the 12x lead stands
    calm = {**busy, "cpu_others_frac": [0.01] * 3, "cpu_pressure_frac": [0.05] * 3}
    assert fastest([jobs[0], job(1, [1877.2, 2928.5, 3290.4], **calm)]).winner is jobs[0]


def test_mild_contention_widens_the_noise_by_what_it_could_explain():
    """20% of a job's time lost to others could make it 1/(1 - 0.2) = 1.25x slower: a 20% lead is noise."""
    lost = {"cpu_pressure_frac": [0.2, 0.2], "cpu_others_frac": [0.3, 0.3]}
    jobs = [job(0, [100.0, 100.0], **lost), job(1, [120.0, 120.0], **lost)]
    ranking = fastest(jobs)
    assert ranking.noise == pytest.approx(0.25) and ranking.winner is None
    assert "up to 20% of a job's time lost to other processes" in ranking.sentence()
    assert fastest([jobs[0], job(1, [130.0, 130.0], **lost)]).winner.number == 1


def test_contention_inside_the_job_is_its_own_cost_not_noise():
    """4 workers on 2 CPUs: the job's threads wait for each other with nothing else running. That wait
    is what the setting costs, so a quiet job beating it wins."""
    inside = {"run_queue_s_per_s": [1.5, 1.5], "cpu_main_pct": [50.0] * 2, "cpu_workers_pct": [150.0] * 2,
              "cpu_others_frac": [0.0, 0.0]}
    jobs = [job(0, [100.0, 200.0]), job(4, [100.0, 120.0], **inside)]
    assert fastest(jobs).winner is jobs[0]


def test_spread_helpers():
    assert epoch_spread({1: 10.0, 2: 100.0, 3: 138.0}) == pytest.approx(0.38)
    assert epoch_spread({1: 10.0, 2: 100.0}) is None  # one epoch after the first: no spread
    assert last_spread({1: 0.5, 2: 0.3, 3: 0.25}) == pytest.approx(0.05)  # the last epoch's change
    assert last_spread({1: 0.5}) is None


def objective_job(number: int, r2: list[float], speeds=(100.0, 100.0), settings=None) -> Job:
    return job(number, list(speeds), settings=settings, val_r2=r2)


def test_best_by_the_objective_is_named_beyond_its_last_epoch_change():
    """val_r2 (higher is better): job #2 leads by 0.03 where no job's R2 moved more than 0.01 in its
    last epoch; the fastest job is another, judged apart."""
    jobs = [objective_job(0, [0.80, 0.85, 0.86]), objective_job(1, [0.70, 0.80, 0.81], speeds=(100.0, 300.0)),
            objective_job(2, [0.85, 0.88, 0.89])]
    best = best_by(jobs, "val_r2", higher=True)
    assert best.winner is jobs[2] and best.noise == pytest.approx(0.01)
    assert best.headline() == "best val_r2: job #2 loader.num_workers=2 (0.89)"
    assert best.sentence().endswith("0.03 ahead of #0 (0.86), beyond the noise of this sweep "
                                    "(0.01: val_r2 moved up to 0.01 in a job's last epoch)")
    assert fastest(jobs).winner is jobs[1]
    # a loss (lower is better) with one still falling fast: its last change swamps the gap
    losses = [job(0, [1.0, 1.0], val_loss=[0.9, 0.5]), job(1, [1.0, 1.0], val_loss=[0.6, 0.45])]
    loss = best_by(losses, "val_loss", higher=False)
    assert loss.winner is None and loss.within == losses
    assert loss.sentence() == ("jobs #0 and #1 are within the noise of this sweep (val_loss moved up to 0.4 in a "
                               "job's last epoch): no best job by val_loss")


def test_repeated_settings_set_the_objectives_noise():
    same = (("optim.lr", "0.01"),)
    jobs = [objective_job(0, [0.90], settings=same), objective_job(1, [0.86], settings=same),
            objective_job(2, [0.88])]
    best = best_by(jobs, "val_r2", higher=True)
    assert best.winner is None and [j.number for j in best.within] == [0, 1, 2]
    assert "same settings up to 0.04 apart" in best.sentence()
    # equal values measure nothing, and a tie is no win
    tie = best_by([objective_job(0, [0.5]), objective_job(1, [0.5])], "val_r2", higher=True)
    assert tie.winner is None and tie.headline() == "best val_r2: indistinguishable (jobs #0 and #1 within noise)"


def test_a_panels_own_best_is_named_only_beyond_its_noise():
    """The chart's data wait, GPU and memory panels (sweeps.chart.panel_best): judged as the objective
    is, against the last epoch-to-epoch change and repeated settings; data wait of a contended job is
    only a ceiling, so no lead over it is a finding. Memory is no share of time: contention leaves it."""
    from dlpipe.sweeps.chart import PANELS, panel_best

    wait, rss = (next(p for p in PANELS if p.metric == m) for m in ("data_wait_frac", "tree_rss_peak_mb"))
    steady = [job(0, [100.0, 100.0, 100.0], data_wait_frac=[0.5, 0.20, 0.21]),
              job(1, [100.0, 100.0, 100.0], data_wait_frac=[0.5, 0.30, 0.30])]
    assert panel_best(steady, wait) == [steady[0]]  # 0.09 ahead; the waits moved 0.01 at most
    moving = [steady[0], job(1, [100.0, 100.0, 100.0], data_wait_frac=[0.5, 0.15, 0.30])]
    assert panel_best(moving, wait) == []  # job #1's wait moved 0.15 in its last epoch: 0.09 is within it
    tie = [job(0, [100.0], data_wait_frac=[0.2]), job(1, [100.0], data_wait_frac=[0.2])]
    assert panel_best(tie, wait) == []
    as_shown = [job(0, [100.0], data_wait_frac=[0.2001]), job(1, [100.0], data_wait_frac=[0.2000])]
    assert panel_best(as_shown, wait) == []  # both bars read 20.0%: a lead nobody can see is none
    lost = {"run_queue_s_per_s": [1.0] * 3, "cpu_main_pct": [100.0] * 3, "cpu_others_frac": [0.6] * 3}
    contended = [steady[0], job(1, [100.0, 100.0, 100.0], data_wait_frac=[0.5, 0.30, 0.30], **lost)]
    assert panel_best(contended, wait) == []
    gpu = next(p for p in PANELS if p.metric == "gpu_util")
    starved = [job(0, [100.0, 100.0, 100.0], gpu_util=[90.0, 90.0, 90.0], **lost),
               job(1, [100.0, 100.0, 100.0], gpu_util=[60.0, 60.0, 60.0])]
    assert panel_best(starved, gpu) == [starved[0]]  # its GPU use is a floor: starved, it still leads
    assert panel_best(starved[::-1], gpu) == [starved[0]]
    behind = [job(0, [100.0] * 3, gpu_util=[50.0] * 3, **lost), job(1, [100.0] * 3, gpu_util=[60.0] * 3)]
    assert panel_best(behind, gpu) == []  # a lead over a starved job's floor is no finding
    memory = [job(0, [100.0, 100.0], tree_rss_peak_mb=[500.0, 510.0], **lost),
              job(1, [100.0, 100.0], tree_rss_peak_mb=[900.0, 905.0])]
    assert panel_best(memory, rss) == [memory[0]]
