"""Contention measured and named: the kernel's counters read from fake /proc and cgroup files, the
per-epoch figures they give, and the verdict's words on synthetic epochs. No timing assertions."""

import os
import time

import pytest

from dlpipe.judging.contention import contention
from dlpipe.judging.verdict import diagnose
from dlpipe.machine import cpu_pressure
from dlpipe.telemetry.contention import ContentionMeter
from dlpipe.telemetry.sampler import EpochClock, ResourceSampler
from dlpipe.tracking.metric_names import mlflow_name

TICK = os.sysconf("SC_CLK_TCK")
PSI = "some avg10=1.00 avg60=2.00 avg300=3.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def proc_stat(root, cpus):
    """/proc/stat with per-CPU lines of (user, idle, steal) ticks; steal None: a kernel without the column."""
    lines = ["cpu  1 2 3 4 5 6 7 8 0 0"]
    for n, (user, idle, steal) in enumerate(cpus):
        lines.append(f"cpu{n} {user} 0 0 {idle} 0 0 0" + (f" {steal} 0 0" if steal is not None else ""))
    write(root / "stat", "\n".join(lines + ["intr 1 2 3", "ctxt 9"]) + "\n")


def schedstat(root, pid, tid, run_ns, wait_ns):
    write(root / str(pid) / "task" / str(tid) / "schedstat", f"{run_ns} {wait_ns} 7\n")


# -- the kernel's files --------------------------------------------------------------------------------

def test_psi_total_is_read_from_the_some_line_and_garbage_reads_none():
    assert cpu_pressure.psi_some_total_us(PSI.format(1234)) == 1234
    assert cpu_pressure.psi_some_total_us("full avg10=0.00 total=5\n") is None
    assert cpu_pressure.psi_some_total_us("some avg10=1.0 total=x\n") is None
    assert cpu_pressure.psi_some_total_us(None) is None


def test_the_jobs_cgroup_pressure_wins_then_the_systems_then_none(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cg"
    write(proc / "self" / "cgroup", "0::/jobs/mine\n")
    write(cgroup / "cgroup.controllers", "cpu memory\n")
    assert cpu_pressure.pressure_file(str(proc), str(cgroup)) is None  # no PSI anywhere: no figure
    write(proc / "pressure" / "cpu", PSI.format(1))
    assert cpu_pressure.pressure_file(str(proc), str(cgroup)) == (str(proc / "pressure" / "cpu"), "system")
    write(cgroup / "jobs" / "mine" / "cpu.pressure", PSI.format(2))
    assert cpu_pressure.pressure_file(str(proc), str(cgroup)) == (str(cgroup / "jobs" / "mine" / "cpu.pressure"),
                                                                  "cgroup")


def test_a_cgroup_v1_host_reads_the_unified_trees_pressure(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cg"
    write(proc / "self" / "cgroup", "4:memory:/x\n1:cpu,cpuacct:/x\n0::/\n")
    (cgroup / "cpu,cpuacct").mkdir(parents=True)
    write(cgroup / "unified" / "cpu.pressure", PSI.format(3))
    assert cpu_pressure.pressure_file(str(proc), str(cgroup)) == (str(cgroup / "unified" / "cpu.pressure"), "cgroup")


def test_cpu_times_sum_the_jobs_cpus_and_steal_only_where_reported(tmp_path):
    proc_stat(tmp_path, [(100, 300, 20), (50, 50, 0), (999, 1, 0)])
    both = cpu_pressure.cpu_times({0, 1}, str(tmp_path))
    assert both.total_s == pytest.approx((420 + 100) / TICK)
    assert both.busy_s == pytest.approx(150 / TICK)  # idle and steal are not busy
    assert both.steal_s == pytest.approx(20 / TICK)
    proc_stat(tmp_path, [(100, 300, None)])
    assert cpu_pressure.cpu_times(None, str(tmp_path)).steal_s is None
    assert cpu_pressure.cpu_times(None, str(tmp_path / "nowhere")) is None


def test_thread_schedstats_of_a_process_and_of_none(tmp_path):
    schedstat(tmp_path, 10, 10, 5_000, 7_000)
    schedstat(tmp_path, 10, 11, 1, 2)
    write(tmp_path / "10" / "task" / "12" / "schedstat", "garbage\n")
    assert cpu_pressure.thread_schedstats(10, str(tmp_path)) == {10: (5_000, 7_000), 11: (1, 2)}
    assert cpu_pressure.thread_schedstats(99, str(tmp_path)) == {}


# -- per-epoch figures ---------------------------------------------------------------------------------

def meter_on(tmp_path, psi=True):
    proc, cgroup = tmp_path / "proc", tmp_path / "cg"
    write(proc / "self" / "cgroup", "0::/\n")
    if psi:
        write(proc / "pressure" / "cpu", PSI.format(1_000_000))
    proc_stat(proc, [(0, 0, 0), (0, 0, 0)])
    schedstat(proc, 10, 10, 0, 1_000_000_000)  # waits before the window are not the window's
    return proc, ContentionMeter(str(proc), str(cgroup), cpus={0, 1})


def test_a_window_gives_run_queue_pressure_steal_and_others(tmp_path):
    proc, meter = meter_on(tmp_path)
    meter.sample({"main": [10], "workers": [20], "other": []})
    meter.start()
    schedstat(proc, 10, 10, 0, 1_500_000_000)  # main: +0.5 s waiting
    schedstat(proc, 20, 21, 0, 300_000_000)  # a worker born in the window: all of its 0.3 s
    meter.sample({"main": [10], "workers": [20], "other": [30]})
    schedstat(proc, 20, 21, 0, 1_300_000_000)  # +1.0 s more
    schedstat(proc, 30, 30, 200_000_000, 0)  # the tracking process: 0.2 s of CPU, the job's
    meter.sample({"main": [10], "workers": [20], "other": [30]})
    write(proc / "pressure" / "cpu", PSI.format(1_000_000 + 1_500_000))  # 1.5 s of 2 s stalled
    # 2 s on 2 CPUs = 400 ticks: 300 busy, 60 stolen; the job used 1.0 s (+0.2 s tracking)
    proc_stat(proc, [(150, 20, 30), (150, 20, 30)])
    got = meter.window(wall_s=2.0, job_cpu_s=1.0)
    assert got["run_queue_main_s_per_s"] == pytest.approx(0.25)
    assert got["run_queue_workers_s_per_s"] == pytest.approx(0.65)
    assert got["run_queue_s_per_s"] == pytest.approx(0.9)
    assert got["cpu_pressure_frac"] == pytest.approx(0.75)
    assert got["cpu_steal_frac"] == pytest.approx(60 / 400)
    assert got["cpu_others_frac"] == pytest.approx(max(0.0, (300 / TICK - 1.2) / (400 / TICK)))  # 0.45 at 100 Hz
    # the next window starts where this one ended
    meter.sample({"main": [10], "workers": [20], "other": [30]})
    assert meter.window(wall_s=1.0, job_cpu_s=0.0)["run_queue_s_per_s"] == 0.0


def test_missing_files_leave_their_figures_out(tmp_path):
    proc, meter = meter_on(tmp_path, psi=False)
    (proc / "stat").unlink()
    meter.start()
    meter.sample({"main": [77], "workers": [], "other": []})  # no schedstat for this pid either
    assert meter.window(wall_s=1.0, job_cpu_s=0.5) == {}
    assert meter.pressure_source == "none"


def test_a_reused_thread_id_counts_as_a_new_thread(tmp_path):
    proc, meter = meter_on(tmp_path, psi=False)
    meter.sample({"main": [10], "workers": [], "other": []})
    meter.start()
    schedstat(proc, 10, 10, 0, 200_000_000)  # smaller than before: a new thread from zero
    meter.sample({"main": [10], "workers": [], "other": []})
    assert meter.window(wall_s=1.0, job_cpu_s=0.0)["run_queue_main_s_per_s"] == pytest.approx(0.2)


@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/schedstat"), reason="no schedstat on this kernel")
def test_the_real_sampler_reports_sane_contention_figures():
    sampler = ResourceSampler(interval_s=0.05, cpu_budget=2).start()
    try:
        deadline = time.perf_counter() + 0.3
        while time.perf_counter() < deadline:
            pass
        got = sampler.window()
    finally:
        sampler.stop()
    assert got["run_queue_s_per_s"] >= 0 and got["run_queue_workers_s_per_s"] == 0.0
    for key in ("cpu_pressure_frac", "cpu_steal_frac", "cpu_others_frac"):
        if key in got:
            assert 0.0 <= got[key] <= 1.0


def test_cpu_per_sample_counts_the_epochs_cpu_only():
    spent = iter([10.0, 10.6])
    clock = EpochClock(cpu_s=lambda: next(spent))
    clock.stepped(300)
    assert clock.summary()["cpu_s_per_sample"] == pytest.approx(0.002)
    assert "cpu_s_per_sample" not in EpochClock().summary()
    unread = EpochClock(cpu_s=lambda: None)
    unread.stepped(1)
    assert "cpu_s_per_sample" not in unread.summary()


# -- the verdict ---------------------------------------------------------------------------------------

def judge(metrics, workers=2, budget=2):
    return diagnose(metrics, num_workers=workers, cpu_budget=budget, pin_memory=False, device_type="cpu",
                    prefetch_factor=2, persistent_workers=True).line()


def epoch(wait_frac, **extra):
    seconds = 10.0
    return {"data_wait_frac": wait_frac, "data_wait_s": wait_frac * seconds, "epoch_time_s": seconds,
            "samples_per_s": 100.0, **extra}


STARVED = {"cpu_util": 40.0, "run_queue_s_per_s": 1.19, "run_queue_workers_s_per_s": 1.1,
           "run_queue_main_s_per_s": 0.09, "cpu_pressure_frac": 0.97, "cpu_others_frac": 0.7, "cpu_s_per_sample": 8e-4}


def test_workers_waiting_for_a_cpu_are_not_put_down_to_io_or_locks():
    line = judge(epoch(0.3, **STARVED))
    assert line.startswith("input-bound: data wait 30.0% with workers at the 2-CPU budget and the job's CPU at 40% of "
                           "it: items wait for a CPU, not for I/O or locks; contended: the job's threads waited for a "
                           "CPU 1.19 s per second (workers 1.10, main process 0.09), 60% of their runnable time, "
                           "on a 2-CPU budget")
    assert "CPU pressure 97% of the time" in line
    assert "from outside the job: other processes used 70% of its CPUs" in line
    assert "from inside" not in line and "I/O or locks (read" not in line
    assert "more workers or prefetch cannot help" in line and "cpu_s_per_sample" in line


def test_the_same_epoch_without_contention_figures_still_says_io_or_locks():
    quiet = {"cpu_util": 40.0}
    assert "items wait on I/O or locks" in judge(epoch(0.3, **quiet))
    below = {**quiet, "run_queue_s_per_s": 0.2, "cpu_others_frac": 0.7, "cpu_pressure_frac": 0.9}
    line = judge(epoch(0.3, **below))  # 0.2 s waiting to 0.8 s running: 20% of the runnable time
    assert "items wait on I/O or locks" in line and "contended" not in line
    idle = {"cpu_util": 5.0, "run_queue_s_per_s": 0.15}  # 60% of a little: under 0.1 s/s per CPU
    assert "contended" not in judge(epoch(0.3, **idle))


def test_a_job_using_little_cpu_is_contended_by_its_share_not_by_the_budget():
    light = {"cpu_util": 20.0, "run_queue_s_per_s": 0.3}  # 0.3 s/s is under a quarter of 2 CPUs...
    assert "waited for a CPU 0.30 s per second, 43% of their runnable time" in judge(epoch(0.3, **light))


def test_a_job_that_wants_more_than_its_budget_is_contended_from_inside():
    own = {"cpu_util": 80.0, "run_queue_s_per_s": 0.9, "run_queue_main_s_per_s": 0.6,
           "run_queue_workers_s_per_s": 0.3, "cpu_others_frac": 0.05}
    line = judge(epoch(0.3, **own))
    assert "from inside the job: its threads wanted 2.5 CPUs (1.6 used + 0.9 waiting) of its 2" in line
    assert "from outside" not in line and "trainer.torch_threads=1" in line
    at_budget = {**own, "cpu_util": 55.0, "cpu_others_frac": 0.5}  # 1.1 used + 0.9 waiting: the budget itself
    assert "from inside" not in judge(epoch(0.3, **at_budget)) and "from outside" in judge(epoch(0.3, **at_budget))


def test_a_wait_that_nothing_outside_explains_is_the_jobs_own():
    quiet = {"cpu_util": 50.0, "run_queue_s_per_s": 0.9, "cpu_others_frac": 0.01}  # thread workers, quiet machine
    line = judge(epoch(0.3, **quiet))
    assert "from inside the job: its threads wanted 1.9 CPUs (1.0 used + 0.9 waiting) of its 2, others used 1% " \
           "of them" in line and "trainer.torch_threads=1" in line
    assert "from inside" not in judge(epoch(0.3, cpu_util=50.0, run_queue_s_per_s=0.9))  # others not measured


def test_compute_bound_is_qualified_with_the_cpu_per_sample():
    line = judge(epoch(0.05, **STARVED))
    assert line.startswith("compute-bound: the loader keeps up (data wait 5.0%); samples/s understate the job here: it "
                           "spent 0.8 ms of CPU a sample; contended: the job's threads waited")
    assert "contended" not in judge(epoch(0.05, cpu_util=40.0, cpu_s_per_sample=8e-4))


def test_pressure_stands_in_where_there_is_no_schedstat_and_steal_counts_as_outside():
    assert contention({"cpu_pressure_frac": 0.8, "cpu_others_frac": 0.6}, 2).outside
    assert contention({"cpu_pressure_frac": 0.3, "cpu_others_frac": 0.6}, 2) is None
    stolen = contention({"run_queue_s_per_s": 0.1, "cpu_steal_frac": 0.2}, 2)
    assert stolen.outside and "the hypervisor took 20% (steal)" in stolen.text
    assert contention({}, 2) is None


def test_the_same_figures_give_the_same_words_in_every_epoch():
    lines = {judge({**epoch(0.3, **STARVED), "epoch": float(n)}) for n in (1, 2, 3)}
    assert len(lines) == 1


# -- end to end ----------------------------------------------------------------------------------------

def kernel_has(key: str) -> bool:
    """Whether this machine's kernel gives the figure `key` (else a run must leave it out)."""
    if key.startswith("run_queue"):
        return os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/schedstat")
    if key == "cpu_pressure_frac":
        return cpu_pressure.pressure_file() is not None
    times = cpu_pressure.cpu_times()
    return times is not None and (key != "cpu_steal_frac" or times.steal_s is not None)


FIGURES = ("run_queue_s_per_s", "run_queue_main_s_per_s", "run_queue_workers_s_per_s", "cpu_pressure_frac",
           "cpu_steal_frac", "cpu_others_frac")


def test_a_cli_run_records_the_contention_figures_every_epoch(dlpipe, mlflow_client, mlflow_store):
    from conftest import epoch_history, runs_of

    r = dlpipe("+recipe=smoke", "dataset.size=96", "trainer.epochs=2", "loader.worker_method=process",
               "trainer.progress=false", "checkpoint.enabled=false", f"tracking.uri={mlflow_store}",
               "tracking.experiment=contention-e2e")
    assert r.returncode == 0, r.stderr
    [run] = runs_of(mlflow_client, "contention-e2e")
    names = set(run.data.metrics)
    assert not any(mlflow_name(key).startswith("system/") for key in ("cpu_s_per_sample", *FIGURES))
    for key in ("cpu_s_per_sample", *FIGURES):
        if key != "cpu_s_per_sample" and not kernel_has(key):
            assert mlflow_name(key) not in names
            continue
        history = epoch_history(mlflow_client, run.info.run_id, mlflow_name(key))
        assert [e for e, _ in history] == [1, 2], key
        for _, value in history:
            assert value >= 0, key
            if key.endswith("_frac"):
                assert value <= 1, key
    assert all(v > 0 for _, v in epoch_history(mlflow_client, run.info.run_id, mlflow_name("cpu_s_per_sample")))


def test_the_other_ranks_torchrun_started_here_are_the_jobs_not_others():
    """Under torchrun (its agent the parent of every rank on the node) a rank's siblings are the job;
    without torchrun's variables, or alone on the node, no process is."""
    import subprocess
    import sys

    import psutil

    from dlpipe.telemetry.contention import sibling_ranks

    ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    try:
        me = psutil.Process(ranks[0].pid)
        torchrun = {"TORCHELASTIC_RUN_ID": "job", "LOCAL_WORLD_SIZE": "2"}
        siblings = {p.pid for p in sibling_ranks(me, torchrun)}
        assert ranks[1].pid in siblings and ranks[0].pid not in siblings
        assert sibling_ranks(me, {"LOCAL_WORLD_SIZE": "2"}) == []  # not started by torchrun
        assert sibling_ranks(me, {**torchrun, "LOCAL_WORLD_SIZE": "1"}) == []
    finally:
        for rank in ranks:
            rank.kill()
            rank.wait()
