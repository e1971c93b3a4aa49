"""``--resume RUN``: what a resume depends on (the config, the corpus, the checkpoint, the
steps) is checked and a change refused naming it; samples written after the checkpoint are
trimmed, old checkpoints still resume, and a run killed in its final export finishes. With
the flags the run was started with (issue 53, items 6 and 13): the same values resume
(alone, or as the whole command with ``--resume`` added, under torchrun too), a value that
differs is refused naming the flag and both values, and a resume says the step it resumes
from."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastrwa.train import problems
from fastrwa.train.cli import main as train_main
from fastrwa.train.config import RunConfig
from fastrwa.train.rundir import prepare_run_dir

from train_helpers import ENV, SYNTHETIC, _corpus, _lm_flags, _resume, _run


def _lm(corpus, *more) -> list[str]:
    return list(map(str, ["--task", "text", "--data", corpus, "--hidden", 8, "--layers", 1,
                          "--bptt", 16, "--batch-size", 2, "--eval-bytes", 100, "--log-every",
                          1, "--no-progress", *more]))


# -- the flags the run was started with ----------------------------------------------------
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
    assert "--minutes 0.5 does not apply to a resume" in err
    assert "resuming from step 2" in err


# -- what a resume depends on --------------------------------------------------------------
def test_resume_refuses_an_edited_config_naming_the_field(tmp_path, capsys):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 2, "--checkpoint-every", 1)
    assert code == 0
    config = json.loads((run / "config.json").read_text())
    config["lr"] = 0.5
    (run / "config.json").write_text(json.dumps(config))
    metrics = (run / "metrics.jsonl").read_text()
    assert _resume(run, "--steps", 4) == 2
    err = capsys.readouterr().err
    assert "lr" in err and "0.001" in err and "0.5" in err
    assert (run / "metrics.jsonl").read_text() == metrics          # nothing touched


def test_resume_refuses_a_changed_corpus_or_data_path(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    code, run = _run(tmp_path, "run", *_lm_flags(corpus), "--steps", 2)
    assert code == 0
    corpus.write_bytes(corpus.read_bytes()[:-500] + b"x" * 400)     # edited in place
    assert _resume(run, "--steps", 4) == 2
    err = capsys.readouterr().err
    assert "changed" in err and "6,000" in err and "5,900" in err and "sha256" in err
    other = _corpus(tmp_path, "other.txt", 7_000)
    config = json.loads((run / "config.json").read_text())
    config["data"] = str(other)
    (run / "config.json").write_text(json.dumps(config))
    assert _resume(run, "--steps", 4) == 2
    err = capsys.readouterr().err
    assert "data" in err and "other.txt" in err and "corpus.txt" in err
    # the same bytes at a new path (a moved corpus) resume, with a note
    _corpus(tmp_path, "moved.txt")
    config["data"] = str(tmp_path / "moved.txt")
    (run / "config.json").write_text(json.dumps(config))
    assert _resume(run, "--steps", 4) == 0
    assert "moved.txt" in capsys.readouterr().err


def test_resume_refuses_a_checkpoint_from_another_run(tmp_path, capsys):
    flags = [*SYNTHETIC, "--steps", 2, "--checkpoint-every", 1]
    assert _run(tmp_path, "a", *flags)[0] == 0
    assert _run(tmp_path, "b", *flags)[0] == 0           # the same flags, another run
    (tmp_path / "a" / "checkpoint.pt").write_bytes((tmp_path / "b" / "checkpoint.pt").read_bytes())
    assert _resume(tmp_path / "a", "--steps", 4) == 2
    assert "another run" in capsys.readouterr().err


def test_resume_with_steps_at_or_below_the_checkpoint_is_refused(tmp_path, capsys):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 2, "--checkpoint-every", 1)
    assert code == 0
    for steps in ("2", "1"):
        assert _resume(run, "--steps", steps) == 2
        err = capsys.readouterr().err
        assert "at step 2" in err and f"--steps {steps}" in err
    assert _resume(run) == 2                       # a finished run: nothing left to train
    assert "at step 2" in capsys.readouterr().err
    assert _resume(run, "--steps", 3) == 0
    # the steps a resume asked for are recorded: a later plain --resume continues to them
    assert json.loads((run / "config.json").read_text())["steps"] == 3


# -- samples.txt on resume -----------------------------------------------------------------
def test_resume_trims_samples_written_after_the_checkpoint(tmp_path):
    corpus = _corpus(tmp_path)
    code, run = _run(tmp_path, "run", *_lm_flags(corpus), "--steps", 4)
    assert code == 0
    with open(run / "samples.txt", "a", encoding="utf-8") as f:   # logged, then killed
        f.write("--- step 6 ---\nlost\n--- step 8 ---\ncut sh")
    assert _resume(run, "--steps", 8) == 0
    text = (run / "samples.txt").read_text(encoding="utf-8")
    assert [line for line in text.splitlines() if line.startswith("--- step")] == \
        [f"--- step {k} ---" for k in (2, 4, 6, 8)]
    assert "lost" not in text and "cut sh" not in text


# -- messages that name the real problem ---------------------------------------------------
def test_resume_with_another_task_or_a_config_without_task_names_the_task(tmp_path, capsys):
    corpus = _corpus(tmp_path)
    code, run = _run(tmp_path, "run", *_lm_flags(corpus), "--steps", 2)
    assert code == 0
    assert _resume(run, "--task", "adding") == 2
    err = capsys.readouterr().err
    assert "task: saved 'text', given 'adding'" in err and "--lm" not in err
    config = json.loads((run / "config.json").read_text())
    del config["task"]
    (run / "config.json").write_text(json.dumps(config))
    assert _resume(run, "--steps", 4) == 2
    err = capsys.readouterr().err
    assert '"task"' in err and "--lm" not in err


def test_a_checkpoint_with_impossible_fields_is_refused_before_anything_is_touched(tmp_path,
                                                                                  capsys):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 2, "--checkpoint-every", 1)
    assert code == 0
    metrics = (run / "metrics.jsonl").read_text()
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    for field, value in (("step", -5), ("step", 1.5), ("elapsed", float("nan")),
                         ("world_size", 0)):
        torch.save({**ckpt, field: value}, run / "checkpoint.pt")
        assert _resume(run, "--steps", 4) == 2
        err = capsys.readouterr().err
        assert field in err and "Traceback" not in err
        assert (run / "metrics.jsonl").read_text() == metrics


def test_a_checkpoint_from_before_a_new_config_field_still_resumes(tmp_path):
    corpus = _corpus(tmp_path)
    code, run = _run(tmp_path, "run", *_lm_flags(corpus), "--steps", 2)
    assert code == 0
    ckpt = torch.load(run / "checkpoint.pt", weights_only=False)
    del ckpt["run"]["config"]["clip"]                     # a RunConfig field added since
    del ckpt["run"]["config"]["lm"]["mlp_ratio"]          # an LMConfig field added since
    torch.save(ckpt, run / "checkpoint.pt")
    assert _resume(run, "--steps", 4) == 0


def test_resume_records_the_schedule_not_the_device_or_progress(tmp_path):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 2)
    assert code == 0
    config = json.loads((run / "config.json").read_text())
    config["progress"] = True
    (run / "config.json").write_text(json.dumps(config))
    assert _resume(run, "--steps", 3, "--device", "cpu", "--eval-every", 7) == 0
    saved = json.loads((run / "config.json").read_text())
    assert (saved["steps"], saved["eval_every"]) == (3, 7)
    assert saved["device"] == "auto" and saved["progress"] is True
    assert saved["run_id"] == config["run_id"]


def test_a_run_killed_during_its_final_export_finishes_on_resume(tmp_path, monkeypatch):
    """A run that dies while writing its final export (model/) can be resumed to completion:
    the final checkpoint is written after the export, so it does not yet say the run is done
    (it said so, and --resume then refused with "nothing to train" and no model/)."""
    from fastrwa.train import loop

    corpus = _corpus(tmp_path)
    real = loop.save_pretrained

    def dies_at_the_export(model, directory, *card):
        if Path(directory).name == "model":
            raise KeyboardInterrupt("killed while exporting")
        return real(model, directory, *card)

    monkeypatch.setattr(loop, "save_pretrained", dies_at_the_export)
    with pytest.raises(KeyboardInterrupt):
        _run(tmp_path, "run", *_lm_flags(corpus), "--steps", 4)
    monkeypatch.undo()
    run = tmp_path / "run"
    assert not (run / "model" / "model.pt").exists()
    assert _resume(run) == 0
    assert (run / "model" / "model.pt").is_file()
    assert torch.load(run / "checkpoint.pt", weights_only=False)["step"] == 4


def test_a_checkpoint_naming_lmstate_where_it_was_defined_still_loads(tmp_path):
    # LMState moved from fastrwa.models.lm to fastrwa.models.cache; a checkpoint written
    # before names it fastrwa.models.lm.LMState, which weights-only loading must still allow.
    from fastrwa.models import LMState
    from fastrwa.nn import LayerState
    from fastrwa.state import ScanState
    from fastrwa.train.checkpoints import load_checkpoint, save_checkpoint
    import zipfile

    scan = ScanState(torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    state = LMState((LayerState(scan, None),))
    path = tmp_path / "checkpoint.pt"
    before = LMState.__module__
    LMState.__module__ = "fastrwa.models.lm"    # (pickled as a checkpoint of before the move)
    try:
        save_checkpoint(path, {"carried": [state]})
    finally:
        LMState.__module__ = before
    with zipfile.ZipFile(path) as archive:
        pickled = archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))
    assert b"fastrwa.models.lm" in pickled and b"fastrwa.models.cache" not in pickled
    loaded = load_checkpoint(path)["carried"][0]
    assert isinstance(loaded, LMState)
    assert torch.equal(loaded.layers[0].scan.n, scan.n)


# -- paths and flags that cannot apply to a resume (issue 59) --------------------------------
def test_a_run_started_with_a_relative_data_path_resumes_from_another_directory(
        tmp_path, monkeypatch, capsys):
    corpus = _corpus(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, run = _run(tmp_path, "run", *_lm_flags(corpus.name), "--steps", 2)
    assert code == 0
    assert json.loads((run / "config.json").read_text())["data"] == str(corpus)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _resume(run, "--steps", 3) == 0, capsys.readouterr().err


def test_the_same_corpus_by_another_path_resumes_and_is_recorded(tmp_path, monkeypatch, capsys):
    corpus = _corpus(tmp_path)
    code, run = _run(tmp_path, "run", *_lm_flags(corpus), "--steps", 2)
    assert code == 0
    (tmp_path / "link.txt").symlink_to(corpus)
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert _resume(run, "--steps", 3, "--data", "link.txt") == 0, capsys.readouterr().err
    assert json.loads((run / "config.json").read_text())["data"] == str(tmp_path / "link.txt")
    other = _corpus(tmp_path, "other.txt", 7_000)      # other bytes: refused, naming them
    assert _resume(run, "--steps", 4, "--data", other) == 2
    err = capsys.readouterr().err
    assert "changed" in err and "sha256" in err and "7,000" in err


def test_resume_with_overwrite_is_refused_and_the_run_kept(tmp_path, capsys):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 2)
    assert code == 0
    before = sorted(p.name for p in run.iterdir())
    assert _resume(run, "--steps", 3, "--overwrite") == 2
    err = capsys.readouterr().err
    assert "--overwrite" in err and "--resume" in err and "Traceback" not in err
    assert sorted(p.name for p in run.iterdir()) == before


def test_minutes_on_the_resume_of_a_steps_run_says_what_is_true(tmp_path, capsys):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 2)
    assert code == 0
    capsys.readouterr()
    assert _resume(run, "--steps", 3, "--minutes", "0.5") == 0
    err = capsys.readouterr().err
    assert "--minutes 0.5 does not apply to a resume" in err and "planned" not in err
