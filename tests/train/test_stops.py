"""SIGINT (Ctrl-C) and SIGTERM anywhere in ``python -m fastrwa.train`` (issue 53, items 4
and 5): one line, exit status 128 + the signal, no traceback, and the files the line
promises. Phases are hit deterministically: ``FASTRWA_TRAIN_PAUSE_AT=PHASE`` makes a
process wait for a signal there (subprocesses), or the pause point of that phase sends this
process the signal itself (in-process runs of the CLI, which installs the same handlers).
During training a signal stops the run at the next step with a checkpoint, and the resumed
run ends with the uninterrupted run's metrics; a second Ctrl-C exits at once, a second
SIGTERM does not hurry the stop."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from fastrwa.train import stop
from fastrwa.train.cli import main as train_main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
FLAGS = ["--seq-len", "10", "--hidden", "4", "--batch-size", "2", "--steps", "3",
         "--eval-every", "2", "--no-progress"]
TIMEOUT = 120


def _paused(run_dir: Path, phases: str, *flags: str) -> subprocess.Popen:
    """``python -m fastrwa.train`` that waits at each of ``phases`` (comma-separated);
    returned once it waits at the first (its stderr lines so far in ``proc.lines``), killed
    after ``TIMEOUT`` seconds in any case."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fastrwa.train", *flags, "--run-dir", str(run_dir)],
        env={**ENV, stop.PAUSE: phases}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    proc.watchdog = threading.Timer(TIMEOUT, proc.kill)
    proc.watchdog.daemon = True
    proc.watchdog.start()
    proc.lines = []
    _next_pause(proc)
    return proc


def _next_pause(proc: subprocess.Popen) -> None:
    """Read ``proc``'s stderr until it says it waits."""
    while True:
        line = proc.stderr.readline()
        assert line, "the run ended before its pause: " + "".join(proc.lines)
        proc.lines.append(line)
        if line.startswith(stop.PAUSED):
            return


def _ended(proc: subprocess.Popen) -> tuple[int, str, list[str]]:
    """Its status, stdout, and stderr's lines (without the pause's and blank ones)."""
    out, err = proc.communicate(timeout=TIMEOUT)
    proc.watchdog.cancel()
    lines = [line for line in "".join(proc.lines).splitlines() + err.splitlines()
             if line.strip() and not line.startswith(stop.PAUSED)]
    return proc.returncode, out, lines


def _signal_at(monkeypatch, point: str, signum: int) -> None:
    """In-process runs: when the run reaches pause point ``point``, this process sends
    itself ``signum`` (once) and waits until the handler has run."""
    sent = []

    def pause_point(self, name):
        if name == point and not sent:
            sent.append(name)
            seen = self.received
            os.kill(os.getpid(), signum)
            end = time.monotonic() + 10
            while self.received == seen and time.monotonic() < end:
                time.sleep(0.001)

    monkeypatch.setattr(stop.StopRequests, "pause_point", pause_point)


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    """Ctrl-C while ``python -m fastrwa.train`` imports what it runs: one line (it was a
    KeyboardInterrupt traceback through the imports), status 130, no run directory."""
    proc = _paused(tmp_path / "run", "start-up", *FLAGS)
    proc.send_signal(signal.SIGINT)
    status, _, lines = _ended(proc)
    assert (status, lines) == (130, ["SIGINT during start-up: stopped at once; nothing was "
                                     "written"])
    assert not (tmp_path / "run").exists()


def test_the_signal_handlers_come_before_any_heavy_import():
    """``python -m fastrwa.train`` imports the packages above it (``fastrwa``,
    ``fastrwa.train``) and ``stop`` before it installs its handlers: none of them may import
    PyTorch (seconds, during which a Ctrl-C would print a traceback through the imports)."""
    code = ("import sys, fastrwa, fastrwa.train, fastrwa.train.stop; "
            "print(sorted(m for m in ('torch', 'numpy', 'numba') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.strip()
    assert out == "[]", out


@pytest.mark.parametrize("phase,signum,flags", [
    ("calibration", signal.SIGINT, ["--minutes", "0.5"]),
    ("preparation of the run", signal.SIGINT, ["--steps", "3"]),
    ("preparation of the run", signal.SIGTERM, ["--steps", "3"]),
])
def test_a_signal_before_the_first_step_ends_the_run_at_once(tmp_path, monkeypatch, capsys,
                                                              phase, signum, flags):
    """In the --minutes calibration, or between making the run directory and the first
    step (the data, the model): one line naming the phase, status 128 + the signal (it
    was a KeyboardInterrupt traceback, or for SIGTERM a silent death), and the new run's
    directory removed, as for a run that failed to start."""
    _signal_at(monkeypatch, phase, signum)
    run = tmp_path / "run"
    code = train_main([*FLAGS[:6], "--no-progress", *flags, "--run-dir", str(run)])
    err = capsys.readouterr().err
    name = signal.Signals(signum).name
    said = [line for line in err.splitlines() if name in line]
    assert code == 128 + signum and "Traceback" not in err
    assert said == [err.strip().splitlines()[-1]], err
    assert said[0].startswith(f"{name} during {phase}: stopped at once;"), err
    assert not run.exists()


def test_a_signal_while_a_resume_prepares_keeps_the_run_as_it_was(tmp_path, monkeypatch,
                                                                  capsys):
    run = tmp_path / "run"
    assert train_main([*FLAGS, "--run-dir", str(run)]) == 0
    files = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    _signal_at(monkeypatch, "preparation of the run", signal.SIGINT)
    capsys.readouterr()
    assert train_main(["--resume", str(run), "--steps", "5", "--no-progress"]) == 130
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"SIGINT during preparation of the run: stopped at once; {run} keeps its "
                    f"last checkpoint; resume with: python -m fastrwa.train --resume {run}")
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == files


def _finished(run: Path, out: str, lines: list[str]) -> None:
    """A run stopped after its last step (3): its line last, its report, its files."""
    assert lines[-1] == ("SIGINT: the run ended after its last step (3), with its "
                         "checkpoint, report and learning_curve.png"), lines
    assert not any("Traceback" in line for line in lines)
    assert "adding: test mse" in out and f"learning curve: {run / 'learning_curve.png'}" in out
    assert (run / "learning_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert torch.load(run / "checkpoint.pt")["step"] == 3
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert (records[-1]["step"], records[-1]["split"]) == (3, "test")


def test_ctrl_c_in_the_final_evaluation_still_writes_the_report_and_the_curve(tmp_path):
    """Ctrl-C during the last step's evaluation: the evaluation, checkpoint, report and
    learning curve are finished, then one line, status 130 (the signal went unanswered:
    status 0)."""
    run = tmp_path / "run"
    proc = _paused(run, "final evaluation", *FLAGS)
    proc.send_signal(signal.SIGINT)
    status, out, lines = _ended(proc)
    assert status == 130
    _finished(run, out, lines)


def test_ctrl_c_in_the_report_still_draws_the_curve(tmp_path, monkeypatch, capsys):
    """Ctrl-C during the report (it was a KeyboardInterrupt traceback and no plot)."""
    _signal_at(monkeypatch, "report", signal.SIGINT)
    run = tmp_path / "run"
    assert train_main([*FLAGS, "--run-dir", str(run)]) == 130
    out, err = capsys.readouterr()
    _finished(run, out, err.strip().splitlines())


def test_a_second_ctrl_c_while_the_checkpoint_is_written_finishes_it(tmp_path):
    """Ctrl-C, then Ctrl-C again while the stop's checkpoint is being written: the write
    finishes, no checkpoint.pt.tmp is left, and the last line says the checkpoint is there
    (the second Ctrl-C exited in the middle of the write, leaving the temporary file, and
    said "the run directory keeps its last checkpoint" of a run that had none)."""
    run = tmp_path / "run"
    proc = _paused(run, "training,checkpoint", "--steps", "100000", "--seq-len", "10",
                   "--hidden", "4", "--batch-size", "2", "--checkpoint-every", "100000",
                   "--no-progress")
    proc.send_signal(signal.SIGINT)           # before step 1: the stop's checkpoint after it
    _next_pause(proc)                         # ... which waits in the middle of its write
    assert (run / "checkpoint.pt.tmp").is_file() and not (run / "checkpoint.pt").exists()
    proc.send_signal(signal.SIGINT)
    status, _, lines = _ended(proc)
    assert status == 130 and not any("Traceback" in line for line in lines), lines
    assert torch.load(run / "checkpoint.pt")["step"] == 1
    assert not (run / "checkpoint.pt.tmp").exists()
    assert "SIGINT: stopping after this step, with a checkpoint (Ctrl-C again to exit at " \
        "once)" in lines
    assert "SIGINT again: exiting once the file being written is complete" in lines
    assert lines[-1] == (f"SIGINT again during training: stopped at once; the checkpoint of "
                         f"step 1 is written; resume with: python -m fastrwa.train --resume "
                         f"{run}"), lines


def _signal_in_step(monkeypatch, index: int, signum: int) -> None:
    """In-process runs: while the run makes step ``index`` (0-based: it takes its batch),
    this process sends itself ``signum`` (once) and waits until the handler has run. (The
    handler's notices go to file descriptor 2: ``capfd``, not ``capsys``.)"""
    from fastrwa.train import problems

    real = problems.SyntheticProblem.batch

    def batch(self, step, size):
        if step == index:
            requests = stop.current()
            seen = requests.received
            os.kill(os.getpid(), signum)
            end = time.monotonic() + 10
            while requests.received == seen and time.monotonic() < end:
                time.sleep(0.001)
        return real(self, step, size)

    monkeypatch.setattr(problems.SyntheticProblem, "batch", batch)


def test_ctrl_c_in_the_last_step_says_the_final_evaluation_comes_first(tmp_path, monkeypatch,
                                                                       capfd):
    """Ctrl-C while the last step runs: "stopping after this step" is said at once (the
    step is not known to be the last: a --minutes run decides after it), then, when the
    final evaluation starts, a line that says it is finished first (it was silent: the
    run went on for its whole final evaluation after saying it would stop)."""
    _signal_in_step(monkeypatch, 2, signal.SIGINT)
    run = tmp_path / "run"
    assert train_main([*FLAGS, "--run-dir", str(run)]) == 130
    out, err = capfd.readouterr()
    lines = [line for line in err.splitlines() if line.startswith("SIGINT")]
    assert lines == ["SIGINT: stopping after this step, with a checkpoint (Ctrl-C again to "
                     "exit at once)",
                     "SIGINT: that step was the last: finishing the final evaluation first "
                     "(Ctrl-C again to exit at once)",
                     "SIGINT: the run ended after its last step (3), with its checkpoint, "
                     "report and learning_curve.png"], err
    _finished(run, out, err.strip().splitlines())


def test_ctrl_c_in_a_step_before_the_last_says_nothing_more(tmp_path, monkeypatch, capfd):
    """(The follow-up line is for the last step only: a stop before it is one notice.)"""
    _signal_in_step(monkeypatch, 1, signal.SIGTERM)
    run = tmp_path / "run"
    assert train_main([*FLAGS, "--run-dir", str(run)]) == 143
    lines = [line for line in capfd.readouterr().err.splitlines() if "SIGTERM" in line]
    assert lines == ["SIGTERM: stopping after this step, with a checkpoint",
                     f"stopped at step 2 by SIGTERM: the checkpoint is saved; resume with: "
                     f"python -m fastrwa.train --resume {run}"]


def test_a_signal_owed_by_a_write_that_fails_still_ends_the_run_with_its_status(
        tmp_path, monkeypatch, capsys):
    """Ctrl-C while a resume repairs its logs (a signal then ends the run once the write is
    complete), and the write fails (a full disk): one line with the signal, the error and
    what the run directory holds, status 130 (the signal was dropped: "error: ...", status
    2)."""
    from fastrwa.models.pretrained import WriteError
    from fastrwa.train import loop

    run = tmp_path / "run"
    assert train_main([*FLAGS, "--run-dir", str(run)]) == 0
    capsys.readouterr()

    def truncate_metrics(path, step):
        requests = stop.current()
        os.kill(os.getpid(), signal.SIGINT)
        end = time.monotonic() + 10
        while not requests.received and time.monotonic() < end:
            time.sleep(0.001)
        raise WriteError(f"cannot write {path}: No space left on device")

    monkeypatch.setattr(loop, "truncate_metrics", truncate_metrics)
    assert train_main(["--resume", str(run), "--steps", "5", "--no-progress"]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and "error:" not in err.replace("; error:", ""), err
    assert err.strip().splitlines()[-1] == (
        f"SIGINT during preparation of the run: stopped at once; error: cannot write "
        f"{run / 'metrics.jsonl'}: No space left on device; {run} keeps its last checkpoint "
        f"(step 3); resume with: python -m fastrwa.train --resume {run}"), err


def test_uninterrupted_raises_the_owed_signal_from_the_error():
    """The unit: the error is the Interrupted's cause; without a signal owed, the error
    goes through as it is; nested blocks owe it at the outermost."""
    requests = stop.StopRequests()
    with pytest.raises(ZeroDivisionError):
        with requests.uninterrupted():
            1 / 0
    requests.enter("calibration")
    with pytest.raises(stop.Interrupted) as caught:
        with requests.uninterrupted():
            with pytest.raises(ZeroDivisionError):
                with requests.uninterrupted():
                    requests._handle(signal.SIGINT, None)
                    1 / 0
            raise OSError("disk full")
    assert (caught.value.status, str(caught.value.__cause__)) == (130, "disk full")
    assert caught.value.line("nothing was written") == (
        "SIGINT during calibration: stopped at once; error: disk full; nothing was written")


def _cli(run_dir: Path, *flags) -> subprocess.Popen:
    """``python -m fastrwa.train`` on a small adding run, as a process of its own."""
    return subprocess.Popen(
        [sys.executable, "-m", "fastrwa.train", "--steps", "400", "--seq-len", "20",
         "--hidden", "8", "--batch-size", "4", "--log-every", "10", "--eval-every", "100",
         "--checkpoint-every", "1000", "--no-progress", "--run-dir", str(run_dir), *flags],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"})


def _wait_for_records(run_dir: Path, proc: subprocess.Popen, n: int = 2) -> None:
    import time
    for _ in range(600):
        metrics = run_dir / "metrics.jsonl"
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        assert proc.poll() is None, proc.stderr.read()
        time.sleep(0.05)
    raise AssertionError("the run wrote no metrics")


def _records(run_dir: Path) -> list[dict]:
    """The metrics without the clock (elapsed, throughput), which no two runs share."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        out.append({k: v for k, v in r.items()
                    if k not in ("elapsed_s", "train_s", "tokens_per_s")})
    return out


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_at_a_step_with_a_checkpoint_and_resumes_exactly(tmp_path, signum):
    """SIGINT or SIGTERM: the run stops at the next step boundary with a checkpoint there,
    says the step and the --resume command, exits 128 + the signal (it was a 30-line
    KeyboardInterrupt traceback, or a silent exit, and no checkpoint); the resumed run ends
    with the uninterrupted run's metrics, record for record."""
    whole = _cli(tmp_path / "whole")
    assert whole.wait(timeout=600) == 0, whole.stderr.read()
    run = tmp_path / "stopped"
    proc = _cli(run)
    _wait_for_records(run, proc)
    proc.send_signal(signum)
    assert proc.wait(timeout=600) == 128 + signum
    err = proc.stderr.read()
    assert f"stopped at step" in err and f"by {signal.Signals(signum).name}" in err, err
    assert f"resume with: python -m fastrwa.train --resume {run}" in err and "Traceback" not in err
    step = int(err.split("stopped at step ")[1].split()[0])
    assert 0 < step < 400 and torch.load(run / "checkpoint.pt")["step"] == step
    resumed = subprocess.run([sys.executable, "-m", "fastrwa.train", "--resume", str(run),
                              "--no-progress"], capture_output=True, text=True, timeout=600,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert resumed.returncode == 0, resumed.stderr
    assert _records(run) == _records(tmp_path / "whole")


def test_a_second_interrupt_exits_at_once(tmp_path):
    """Ctrl-C, then Ctrl-C again while the step runs (slow steps): the second exits at once
    (status 130, its one line), without the stop's checkpoint, and says there is none (it
    said "the run directory keeps its last checkpoint"); a second SIGTERM (what a scheduler
    or torchrun's agent sends) does not hurry the stop."""
    run = tmp_path / "run"
    proc = _cli(run, "--steps", "100000", "--seq-len", "3000", "--hidden", "64",
                "--batch-size", "64", "--log-every", "1")
    _wait_for_records(run, proc, n=1)
    proc.send_signal(signal.SIGINT)
    while "stopping after this step" not in proc.stderr.readline():
        pass
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=600) == 130
    err = proc.stderr.read()
    assert "SIGINT again during training: stopped at once" in err, err
    assert "the run has no checkpoint" in err and "stopped at step" not in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not (run / "checkpoint.pt").exists()       # (--checkpoint-every 1000: none yet)
    run = tmp_path / "term"
    proc = _cli(run)
    _wait_for_records(run, proc)
    proc.send_signal(signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=600) == 143
    err = proc.stderr.read()
    assert "stopped at step" in err and "exiting now" not in err, err
    assert (run / "checkpoint.pt").is_file()


# -- a stop that a callback from C swallows (numba's compiler calls back into Python through
# llvmlite; ctypes reports an exception raised in a callback and goes on) ----------------
def _in_a_c_callback(function) -> None:
    """Call ``function`` from inside C (libc's qsort calling a ctypes comparison)."""
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    compare = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(
        lambda a, b: function() or 0)
    values = (ctypes.c_int * 2)(2, 1)
    libc.qsort(values, 2, ctypes.sizeof(ctypes.c_int), compare)


def test_a_stop_a_c_callback_swallows_is_raised_at_the_next_boundary_without_a_traceback(
        capfd):
    with stop.stop_requests() as stops:
        stops.enter("calibration")
        _in_a_c_callback(lambda: stops._handle(signal.SIGINT, None))
        assert "Traceback" not in capfd.readouterr().err     # (not printed by ctypes)
        with pytest.raises(stop.Interrupted, match="SIGINT during calibration"):
            stops.enter("start-up")
        stops.check()                                       # (raised once)


def test_a_second_ctrl_c_after_a_swallowed_one_exits_at_once():
    with stop.stop_requests() as stops:
        stops.enter("calibration")
        _in_a_c_callback(lambda: stops._handle(signal.SIGINT, None))
        with pytest.raises(stop.Interrupted):
            stops._handle(signal.SIGINT, None)


def test_a_swallowed_stop_is_raised_at_the_next_step_boundary():
    with stop.stop_requests() as stops:
        stops.enter("training")
        stops._handle(signal.SIGINT, None)                  # (noted: the step goes on)
        _in_a_c_callback(lambda: stops._handle(signal.SIGINT, None))   # (again: at once)
        with pytest.raises(stop.Interrupted, match="SIGINT again"):
            stops.pending(1, "cpu")


def test_only_rank_0_says_what_a_signal_does(monkeypatch, capfd):
    for rank, said in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        with stop.stop_requests() as stops:
            stops.enter("training")
            stops._handle(signal.SIGTERM, None)
        assert ("SIGTERM: stopping after this step" in capfd.readouterr().err) is said


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_after_a_finished_runs_last_line_changes_nothing(tmp_path, signum):
    """The run's lines are all written and its status is decided: a signal in the process's
    teardown (a second of imports' finalisers) neither kills it silently nor prints."""
    code = ("import os, runpy, signal, sys, atexit\n"
            f"atexit.register(lambda: os.kill(os.getpid(), {int(signum)}))\n"
            "sys.argv = ['fastrwa.train', *sys.argv[1:]]\n"
            "runpy.run_module('fastrwa.train', run_name='__main__')\n")
    proc = subprocess.run([sys.executable, "-c", code, *FLAGS, "--run-dir",
                           str(tmp_path / "run")], env=ENV, capture_output=True, text=True,
                          timeout=TIMEOUT)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
    assert "learning curve:" in proc.stdout
