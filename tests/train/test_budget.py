"""``--minutes M`` (issue 53, item 11): the run is sized from a calibration and recorded in
config.json; the plan scales the steps, the warm-up and the intervals to the budget, and the run keeps to the wall clock when its steps get slower
than calibrated, ending early with one line."""

import json
import time
from pathlib import Path

from fastrwa.train import budget, cli, problems
from fastrwa.train.cli import main as train_main
from fastrwa.train.config import RunConfig

TINY = ["--seq-len", "10", "--hidden", "4", "--batch-size", "2", "--no-progress"]


def _run(tmp_path: Path, name: str, *flags) -> tuple[int, Path]:
    args = ["--run-dir", str(tmp_path / name), "--no-progress", *map(str, flags)]
    return train_main(args), tmp_path / name


def test_the_plan_fills_the_budget_with_steps_and_several_evaluations():
    """5 minutes at 1 s a step, 3 s an evaluation, 6 s the test: the final evaluations
    (9 s) and 9 evaluations before them (27 s) leave 264 steps, evaluated and checkpointed
    every 27 (10 points on the curve; with the defaults' 500 a short run had one), a warm-up
    of 4% as the LM defaults have (200 of 5000), logs every 2; the flags given keep their
    values; evaluations that would take more than a quarter of the time are fewer."""
    cal = budget.Calibration(step_s=1.0, valid_s=3.0, test_s=6.0)
    lm = RunConfig(task="text", data="corpus.txt")
    planned = budget.plan(lm, {}, 300.0, cal)
    assert (planned.steps, planned.decay_steps, planned.eval_every, planned.checkpoint_every,
            planned.warmup, planned.log_every) == (264, 264, 27, 27, 11, 2)
    given = {"eval_every": 50, "warmup": 7, "checkpoint_every": 100, "log_every": 5}
    planned = budget.plan(RunConfig(task="text", data="corpus.txt", **given), given, 300.0, cal)
    assert (planned.steps, planned.eval_every, planned.warmup, planned.checkpoint_every,
            planned.log_every) == (274, 50, 7, 100, 5)           # 291 s / (1 + 3 / 50)
    slow_evals = budget.Calibration(step_s=1.0, valid_s=30.0, test_s=30.0)
    planned = budget.plan(RunConfig(), {}, 300.0, slow_evals)
    assert (planned.steps, planned.eval_every, planned.warmup) == (210, 105, 0)  # 2 points


def test_minutes_ends_on_the_wall_clock_when_steps_slow_down(tmp_path, monkeypatch, capsys):
    """Steps that take twice their calibrated time after the calibration (another process
    on the machine): the run ends at its deadline (it overran by the slowdown), says so in
    one line, has its final evaluation and several points on its curve, and its schedule
    still decays over the planned steps."""
    calibrated = []

    def calibrate(cfg):
        calibrated.append(budget.calibrate(cfg))
        return calibrated[0]

    real = problems.SyntheticProblem.batch

    def slower(self, step, size):
        if calibrated:
            time.sleep(calibrated[0].step_s)
        return real(self, step, size)

    monkeypatch.setattr(cli, "calibrate", calibrate)
    monkeypatch.setattr(problems.SyntheticProblem, "batch", slower)
    minutes = 0.1
    began = time.monotonic()
    assert train_main([*TINY, "--minutes", str(minutes), "--run-dir",
                       str(tmp_path / "run")]) == 0
    took = time.monotonic() - began
    err = capsys.readouterr().err
    assert took < minutes * 60 + 2.0, (took, err)
    steps = json.loads((tmp_path / "run" / "config.json").read_text())["steps"]
    records = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    end = records[-1]["step"]
    assert 0 < end < steps and records[-1]["split"] == "test"
    said = [line for line in err.splitlines() if "the time is up" in line]
    assert len(said) == 1 and said[0].startswith(
        f"--minutes {minutes:g}: the time is up after step {end} of {steps}"), err
    assert sum(r["split"] == "valid" for r in records) >= 3


def test_the_deadline_counts_the_evaluation_due_and_the_checkpoints():
    """After a step, the run goes on only if what this step still has to do (its
    evaluation, its checkpoint), one more step and the final evaluation and checkpoint fit
    before the deadline (it counted the step and the final evaluation only: a run could end
    an evaluation and a checkpoint after its --minutes). A checkpoint takes what the latest
    writes took; the calibration estimates the first; the plan leaves room for them."""
    cal = budget.Calibration(step_s=1.0, valid_s=10.0, test_s=10.0, write_s=2.0)
    deadline = budget.Deadline(time.monotonic() + 24.0, 0.4, cal)
    assert not deadline.after_step(1.0)                   # 1 + 20 + 2 = 23 s
    assert deadline.after_step(1.0, evaluates=True)       # + 10 s of evaluation due
    assert deadline.after_step(1.0, writes=True)          # + 2 s of checkpoint due
    deadline.wrote(0.5)
    assert not deadline.after_step(1.0, writes=True)      # 1 + 20 + 0.5 + 0.5 = 22 s
    deadline.wrote(5.0)
    assert deadline.after_step(1.0)                       # 1 + 20 + 5 = 26 s
    planned = budget.plan(RunConfig(task="text", data="corpus.txt"), {}, 300.0,
                          budget.Calibration(step_s=1.0, valid_s=3.0, test_s=6.0, write_s=1.0))
    assert (planned.steps, planned.eval_every) == (254, 26)   # (300 - 6 - 10 x 4) / 1


def test_minutes_keeps_to_the_clock_when_checkpoints_are_slow(tmp_path, monkeypatch, capsys):
    """Checkpoints that take 1 s each (a slow disk; the calibration serializes to memory):
    the run's last checkpoint is written before its deadline (it overran by a checkpoint or
    two: each check counted neither the one due at that step nor the final one)."""
    from fastrwa.train import loop

    real, ended = loop.save_checkpoint, []

    def save_checkpoint(path, payload):
        time.sleep(1.0)
        real(path, payload)
        ended.append(time.monotonic())

    monkeypatch.setattr(loop, "save_checkpoint", save_checkpoint)
    minutes = 0.05
    began = time.monotonic()
    assert train_main([*TINY, "--minutes", str(minutes), "--run-dir",
                       str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    assert ended and ended[-1] - began < minutes * 60 + 0.25, (ended[-1] - began, err)
    records = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["split"] == "test"


def test_minutes_sizes_the_run_from_a_calibration(tmp_path, monkeypatch, capsys):
    """--minutes M: the steps that fill M minutes at the calibrated seconds per step, the
    schedule decaying over them, recorded in config.json (a resume trains the same run);
    refused with --steps or not positive (with --resume the plan made at the start stands:
    tests/train/test_resume.py)."""
    from fastrwa.train import budget, cli
    cal = budget.calibrate(cli.RunConfig(seq_len=10, hidden=4, batch_size=2))
    assert cal.step_s > 0 and cal.valid_s > 0 and cal.test_s > 0
    monkeypatch.setattr(cli, "calibrate", lambda cfg: budget.Calibration(0.5, 0.0, 0.0))
    code, run = _run(tmp_path, "run", "--seq-len", 10, "--hidden", 4, "--batch-size", 2,
                     "--minutes", 0.1)
    assert code == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["steps"] == saved["decay_steps"] in (11, 12)   # (6 s, less the calibration)
    assert saved["eval_every"] == 2
    assert f"--minutes 0.1: 0.5 s a step here, 0 s an evaluation: {saved['steps']} steps, " \
        f"evaluated every 2, warm-up 0" in capsys.readouterr().err
    for flags, words in ((["--minutes", 1, "--steps", 5], "not with --steps"),
                         (["--minutes", 0], "--minutes must be a positive finite number"),
                         (["--minutes", "nan"], "--minutes must be a positive finite number"),
                         (["--minutes", -1, "--resume", run],
                          "--minutes must be a positive finite number")):
        code, _ = _run(tmp_path, "other", *flags)
        assert code == 2 and words in capsys.readouterr().err
