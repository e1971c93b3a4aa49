"""``--resume RUN`` with the flags the run was started with (issue 53, items 6 and 13): the
same values resume (alone, or as the whole command with ``--resume`` added, under torchrun
too), a value that differs is refused naming the flag and both values, and a resume says
the step it resumes from."""

import contextlib
import json
import os
import signal
import subprocess
import sys

import torch

from fastrwa.train import problems
from fastrwa.train.cli import main as train_main
from fastrwa.train.config import RunConfig
from fastrwa.train.rundir import prepare_run_dir

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(6_000)))
    return path


def _lm(corpus, *more) -> list[str]:
    return list(map(str, ["--task", "text", "--data", corpus, "--hidden", 8, "--layers", 1,
                          "--bptt", 16, "--batch-size", 2, "--eval-bytes", 100, "--log-every",
                          1, "--no-progress", *more]))


def test_resume_with_the_pack_flag_the_run_started_with(tmp_path, monkeypatch, capsys):
    """A --pack run stopped at step 2 resumes with its whole command plus --resume, and with
    --resume RUN --pack SEP alone (it was refused: "--pack ... needs --task enwik8 or text");
    another separator is refused naming --pack, the saved and the given value; the resume
    says the step it resumes from."""
    run = tmp_path / "run"
    command = _lm(_corpus(tmp_path), "--pack", "\\x05", "--steps", 4, "--run-dir", run)
    real = problems.ByteLMProblem.batch

    def stopped_in_step_2(self, step, size):
        if step == 1:
            os.kill(os.getpid(), signal.SIGINT)      # (Ctrl-C: a stop after this step)
        return real(self, step, size)

    monkeypatch.setattr(problems.ByteLMProblem, "batch", stopped_in_step_2)
    assert train_main(command) == 130
    monkeypatch.undo()
    assert torch.load(run / "checkpoint.pt")["step"] == 2
    capsys.readouterr()
    assert train_main([*command, "--resume", str(run)]) == 0
    assert "resuming from step 2\n" in capsys.readouterr().err
    assert train_main(["--resume", str(run), "--pack", "\\x05", "--steps", "5",
                       "--no-progress"]) == 0
    assert "resuming from step 4\n" in capsys.readouterr().err
    for flags in (["--pack", "\\x06"], [*command, "--pack", "\\x06"]):
        assert train_main(["--resume", str(run), *flags, "--steps", "6"]) == 2
        err = capsys.readouterr().err
        assert "--pack: saved '\\x05', given '\\x06'" in err and "Traceback" not in err, err
    assert torch.load(run / "checkpoint.pt")["step"] == 5


def test_torchrun_resume_with_the_context_parallel_flag(tmp_path, capsys):
    """A --context-parallel 2 run (killed before its first checkpoint: what it wrote when it
    started) resumes under torchrun with --resume RUN --context-parallel 2 (it was refused:
    "--context-parallel ... needs --task enwik8 or text"); another N is refused naming
    --context-parallel, the saved and the given value."""
    corpus = _corpus(tmp_path)
    run = tmp_path / "run"
    cfg = RunConfig(task="text", data=str(corpus), hidden=8, layers=1, bptt=16, batch_size=2,
                    eval_bytes=100, steps=2, context_parallel=2, progress=False)
    with contextlib.ExitStack() as hold:
        prepare_run_dir(run, cfg, resume=False, overwrite=False, hold=hold)
    assert train_main(["--resume", str(run), "--context-parallel", "4"]) == 2
    assert "--context-parallel: saved 2, given 4" in capsys.readouterr().err
    resumed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "-m", "fastrwa.train", "--resume", str(run), "--context-parallel", "2"],
        env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from step 0 (no checkpoint: the run starts over)" in resumed.stderr
    ckpt = torch.load(run / "checkpoint.pt")
    assert (ckpt["step"], ckpt["world_size"]) == (2, 2)
    assert json.loads((run / "config.json").read_text())["context_parallel"] == 2


def test_resume_with_the_minutes_command_the_run_started_with(tmp_path, capsys):
    """A --minutes run continued by its whole command plus --resume (it was refused: "not
    with --resume"): the plan made at the start stands (here, a run of 2 steps given one
    more), and the resume says so."""
    flags = ["--task", "adding", "--seq-len", "10", "--hidden", "8", "--batch-size", "4",
             "--no-progress", "--threads", "1"]
    run = tmp_path / "run"
    assert train_main([*flags, "--steps", "2", "--run-dir", str(run)]) == 0
    capsys.readouterr()
    assert train_main([*flags, "--minutes", "0.5", "--resume", str(run), "--steps", "3"]) == 0
    err = capsys.readouterr().err
    assert "--minutes 0.5: the run's steps were planned when it started" in err
    assert "resuming from step 2" in err
