"""benchmarks/torch_threads.py: its reading of a run's summary table, and a run at its --quick size
(the figures of which mean nothing)."""

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.torch_threads import samples_per_s

REPO = Path(__file__).resolve().parents[1]

SUMMARY = """\
epoch  train loss  val loss  val acc  samples/s  data wait  epoch s  cpu %  rss MB
-----  ----------  --------  -------  ---------  ---------  -------  -----  ------
    1      0.8288    0.4507    1.000      120.2       1.7%    10.65     64     550
    2      0.2126    0.1009    1.000      112.6       1.0%    11.37     64     561
    3      0.2000    0.1000    1.000      114.6       1.0%    11.37     64     561
bottleneck: compute-bound: the loader keeps up (data wait 1%)
"""


def test_the_figure_is_the_epochs_after_the_first():
    assert samples_per_s("log line\n" + SUMMARY) == pytest.approx(113.6)
    one_epoch = "\n".join(SUMMARY.splitlines()[:3])
    assert samples_per_s(one_epoch) == pytest.approx(120.2)  # nothing after the first: the first


@pytest.mark.integration
def test_the_script_runs_at_its_quick_size(tmp_path):
    out = tmp_path / "torch_threads.md"
    r = subprocess.run([sys.executable, "-m", "benchmarks.torch_threads", "--quick", "--cases", "3", "--out", str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "| tabular MLP, 2 worker processes | " in text and "(auto: CPU budget " in text
    assert "- tabular MLP, 2 worker processes: auto rule / torch's default " in text
