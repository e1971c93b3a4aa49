"""``--threads``: a CPU run leaves the cores other programs keep busy to them (threads that
share a busy core made a training step about 6x slower; bench/busy_core.py)."""

import os
import subprocess
import sys
import time

import pytest
import torch

from fastrwa.train import threads as threads_module
from fastrwa.train.cli import main as train_main

FLAGS = ["--steps", "2", "--seq-len", "10", "--hidden", "8", "--batch-size", "4",
         "--no-progress"]


@pytest.mark.parametrize("available,others,cores,expected", [
    (2, 1.0, 2, 1),        # one of two cores busy: the other one
    (2, 0.7, 2, 1),        # most of a core busy
    (2, 0.1, 2, 2),        # background noise: both
    (2, 2.0, 2, 1),        # every core busy: still one
    (16, 3.2, 16, 13),
    (4, 0.0, 8, 4),        # never more than PyTorch would use
])
def test_auto_leaves_the_busy_cores(available, others, cores, expected):
    assert threads_module.choose(available, others, cores) == expected


def test_busy_cores_reads_the_other_programs_work(tmp_path, monkeypatch):
    """From /proc/stat's per-core lines (user nice system idle iowait irq softirq steal) of
    the cores this process may use, over the sleep: core 0 busy 150 of 200 jiffies, core 1
    idle, is 0.75 of a core; core 2, outside the affinity, is left out; so is what this
    process itself computed meanwhile."""
    stat = tmp_path / "stat"
    lines = lambda busy, idle, idle1: (f"cpu  0 0 0 0 0 0 0 0 0 0\n"         # noqa: E731
                                       f"cpu0 {busy} 0 0 {idle} 0 0 0 0 0 0\n"
                                       f"cpu1 0 0 0 {idle1} 0 0 0 0 0 0\n"
                                       f"cpu2 {busy * 7} 0 0 0 0 0 0 0 0 0\nintr 1 2 3\n")
    stat.write_text(lines(1000, 5000, 6000))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(time, "sleep", lambda s: stat.write_text(lines(1150, 5050, 6200)))
    ticks, walls = iter([10.0, 10.0, 10.0, 10.3]), iter([0.0, 1.0, 0.0, 1.0])
    monkeypatch.setattr(time, "process_time", lambda: next(ticks))
    monkeypatch.setattr(time, "monotonic", lambda: next(walls))
    assert threads_module.busy_cores(stat=stat) == (0.75, 2)
    stat.write_text(lines(1000, 5000, 6000))      # (this process computed 0.3 s meanwhile)
    others, cores = threads_module.busy_cores(stat=stat)
    assert (round(others, 9), cores) == (0.45, 2)
    monkeypatch.setattr(time, "process_time", lambda: 0.0)
    monkeypatch.setattr(time, "monotonic", lambda: 0.0)
    assert threads_module.busy_cores(stat=tmp_path / "none") is None


def test_threads_flag_is_checked_and_set_for_the_run_only(tmp_path, capsys, monkeypatch):
    before = torch.get_num_threads()
    seen = []
    monkeypatch.setattr("fastrwa.train.cli.train",
                        lambda *a, **k: seen.append(torch.get_num_threads()) or {})
    monkeypatch.setattr("fastrwa.train.cli._report", lambda *a, **k: None)
    assert train_main([*FLAGS, "--threads", "1", "--run-dir", str(tmp_path / "r")]) == 0
    assert seen == [1] and torch.get_num_threads() == before
    # (an explicit count holds wherever the run computes: auto only looks at a CPU run)
    monkeypatch.setattr("fastrwa.train.cli.resolve_device", lambda name: torch.device("cuda"))
    assert train_main([*FLAGS, "--threads", "1", "--run-dir", str(tmp_path / "g")]) == 0
    assert seen == [1, 1] and torch.get_num_threads() == before
    for bad in ("0", "-1", "two"):
        with pytest.raises(SystemExit) as exit_:
            train_main([*FLAGS, "--threads", bad])
        assert exit_.value.code == 2
        assert f"argument --threads: expected 'auto' or a positive int, got '{bad}'" in \
            capsys.readouterr().err


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs a second core to keep busy")
def test_a_busy_core_is_left_to_its_program(tmp_path):
    """With a loop spinning on one core, ``--threads auto`` uses fewer threads and says so
    in one line."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        # (PyTorch's own thread count in the run: not a test worker's OMP_NUM_THREADS)
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        result = subprocess.run([sys.executable, "-m", "fastrwa.train", *FLAGS,
                                 "--run-dir", str(tmp_path / "r")],
                                capture_output=True, text=True, timeout=300, env=env)
    finally:
        spinner.kill()
        spinner.wait()
    assert result.returncode == 0, result.stderr
    (line,) = [l for l in result.stderr.splitlines() if l.startswith("threads: ")]
    used, available = map(int, line.split()[1:4:2])
    assert used < available, line
    assert f"--threads {available} uses them all" in line


@pytest.mark.parametrize("bad", [["--minutes", "-1"], ["--task", "text", "--data", "missing.txt"]])
def test_an_argument_error_is_the_only_line(tmp_path, monkeypatch, capsys, bad):
    """The line about busy cores is said once the flags are known to be good: an argument
    error is the run's one line."""
    from fastrwa.train import cli
    monkeypatch.setattr(cli, "pick", lambda flag, available: (1, "threads: 1 of 2 (test)"))
    monkeypatch.chdir(tmp_path)
    assert cli.main([*FLAGS, "--run-dir", str(tmp_path / "r"), *bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert cli.main([*FLAGS, "--run-dir", str(tmp_path / "r")]) == 0     # (said when good)
    assert "threads: 1 of 2 (test)" in capsys.readouterr().err
