"""A training run's directory (``--run-dir``): --overwrite removes only a run directory,
never what a link points to, and only after every check (the data opened, the lock taken);
one process per run directory; a checkpoint or export write that fails, an OSError and a
full disk are clean errors that say what is kept; numbers no run can use and a refused
language-model run are one-line errors before any directory is made."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

from train_helpers import SYNTHETIC, _corpus, _lm_flags, _resume, _run


def _zip(path: Path, raw: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", raw)
    return path


# -- --overwrite ---------------------------------------------------------------------------
def test_overwrite_removes_a_symlink_never_what_it_points_to(tmp_path):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 1)
    assert code == 0
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "config.json").write_text("{}")
    (foreign / "model.pt").write_text("someone else's model")
    (run / "best").symlink_to(foreign, target_is_directory=True)
    (run / "samples.txt").symlink_to(foreign / "model.pt")
    assert _run(tmp_path, "run", *SYNTHETIC, "--steps", 1, "--overwrite")[0] == 0
    assert sorted(p.name for p in foreign.iterdir()) == ["config.json", "model.pt"]
    assert (foreign / "model.pt").read_text() == "someone else's model"
    assert not (run / "best").exists() and not (run / "best").is_symlink()


@pytest.mark.parametrize("name", ["metrics.jsonl", "checkpoint.pt.tmp"])
def test_overwrite_validates_everything_before_removing_anything(tmp_path, capsys, name):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 1)
    assert code == 0
    (run / name).unlink(missing_ok=True)
    (run / name).mkdir()
    (run / name / "inside").write_text("x")
    before = sorted(p.name for p in run.iterdir())
    assert _run(tmp_path, "run", *SYNTHETIC, "--steps", 1, "--overwrite")[0] == 2
    err = capsys.readouterr().err
    assert name in err and "Traceback" not in err
    assert sorted(p.name for p in run.iterdir()) == before
    assert (run / name / "inside").read_text() == "x"


# -- one process per run directory ---------------------------------------------------------
def test_a_run_directory_in_use_is_refused_until_its_process_ends(tmp_path, capsys):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 1)
    assert code == 0
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import fcntl, os, sys, time
            fd = os.open({str(run / 'run.lock')!r}, os.O_RDWR | os.O_CREAT)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, str(os.getpid()).encode())
            print("locked", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert _resume(run, "--steps", 2) == 2
        err = capsys.readouterr().err
        assert "in use" in err and str(holder.pid) in err
        assert _run(tmp_path, "run", *SYNTHETIC, "--steps", 1, "--overwrite")[0] == 2
        assert "in use" in capsys.readouterr().err and (run / "checkpoint.pt").is_file()
    finally:
        holder.send_signal(signal.SIGKILL)           # a crash: the kernel drops the lock
        holder.wait()
    assert _resume(run, "--steps", 2) == 0
    # the lock is released when a run ends: it can be resumed again at once
    assert _resume(run, "--steps", 3) == 0


# -- a checkpoint or export write that fails -----------------------------------------------
@pytest.mark.parametrize("target", ["checkpoint.pt.tmp", "model.pt.tmp"])
def test_a_failed_write_is_a_clean_error_and_leaves_no_tmp(tmp_path, monkeypatch, capsys,
                                                          target):
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        name = f if isinstance(f, (str, os.PathLike)) else getattr(f, "name", "")
        if str(name).endswith(target):
            with open(name, "wb") as out:
                out.write(b"PK\x03\x04 partial")
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos "
                               "64 vs 0; PytorchStreamWriter failed writing file data/0: "
                               "file write failed")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    corpus = _corpus(tmp_path)
    code, run = _run(tmp_path, "run", *_lm_flags(corpus), "--steps", 2)
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert target.removesuffix(".tmp") in err and "file write failed" in err
    assert not list(run.rglob("*.tmp"))


# -- numbers no run can use, refused before anything is written ----------------------------
@pytest.mark.parametrize("flags,words", [
    (["--lm", "vocab_size=300"], "--lm vocab_size must be 257"),
    (["--lr", "1e39"], "--lr must be"),
    (["--weight-decay", "1e39"], "--weight-decay must be"),
    (["--seed", str(2 ** 70)], "--seed must be"),
    (["--seed", "-1"], "--seed must be"),
])
def test_unusable_numbers_are_refused_before_the_run_directory_is_made(tmp_path, capsys,
                                                                       flags, words):
    corpus = _corpus(tmp_path)
    code, run = _run(tmp_path, "bad", *_lm_flags(corpus), "--steps", 2, *flags)
    err = capsys.readouterr().err
    assert code == 2 and words in err and "Traceback" not in err, err
    assert not run.exists()


def test_a_new_run_that_fails_before_its_first_step_leaves_no_directory(tmp_path, capsys):
    code, run = _run(tmp_path, "run", "--task", "text", "--data", tmp_path / "missing.txt")
    assert code == 2 and "no such file" in capsys.readouterr().err
    assert not run.exists()
    _corpus(tmp_path, "missing.txt")           # the rerun with the corpus in place is not blocked
    assert _run(tmp_path, "run", *_lm_flags(tmp_path / "missing.txt"), "--steps", 1)[0] == 0


# -- --overwrite, the lock, OSErrors and full disks, revisited -----------------------------
def test_overwrite_opens_the_data_before_removing_the_old_run(tmp_path, capsys):
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 1)
    assert code == 0
    before = sorted(p.name for p in run.iterdir())
    code, _ = _run(tmp_path, "run", "--task", "text", "--data", tmp_path / "typo.txt",
                   "--overwrite")
    assert code == 2 and "no such file" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before
    cut = tmp_path / "enwik8.zip"
    cut.write_bytes(_zip(tmp_path / "whole.zip", b"x" * 5000).read_bytes()[:60])
    code, _ = _run(tmp_path, "run", "--task", "enwik8", "--data", cut, "--overwrite")
    assert code == 2 and "truncated" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before


def test_an_oserror_preparing_the_run_dir_reaches_every_rank(tmp_path, monkeypatch, capsys):
    """Under torchrun rank 0 broadcasts the outcome of preparing the run directory; an
    OSError (flock's ENOLCK on NFS) must be broadcast too, or the other ranks wait forever."""
    import errno as errno_
    from fastrwa.train import cli, rundir

    def no_locks(fd, op):
        raise OSError(errno_.ENOLCK, "No locks available")

    sent = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(cli.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(cli.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(cli.dist, "broadcast_object_list", lambda obj, src: sent.append(list(obj)))
    monkeypatch.setattr(cli.dist, "destroy_process_group", lambda: None)
    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)
    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 1)
    err = capsys.readouterr().err
    assert code == 2 and "No locks available" in err and "Traceback" not in err
    assert len(sent) == 1 and "No locks available" in sent[0][2]
    assert len(err.strip().splitlines()) == 1


def test_overwrite_replaces_a_directory_left_with_only_its_lock(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.lock").write_text("12345\n")            # a start that failed
    assert _run(tmp_path, "run", *SYNTHETIC, "--steps", 1, "--overwrite")[0] == 0
    assert (run / "checkpoint.pt").is_file()


def test_overwrite_takes_the_lock_before_it_plans(tmp_path, capsys):
    import fcntl

    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 1)
    assert code == 0
    (run / "notes.txt").write_text("mine")              # a plan would refuse this
    fd = os.open(run / "run.lock", os.O_RDWR)           # another process's run in progress
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert _run(tmp_path, "run", *SYNTHETIC, "--steps", 1, "--overwrite")[0] == 2
        assert "in use" in capsys.readouterr().err        # the lock was asked first
    finally:
        os.close(fd)
    # a refused plan releases the lock, and removes run.lock when this process made it
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert _run(tmp_path, "other", *SYNTHETIC, "--steps", 1, "--overwrite")[0] == 2
    assert "notes.txt" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    assert _run(tmp_path, "run", *SYNTHETIC, "--steps", 1, "--overwrite")[0] == 2
    assert (run / "run.lock").is_file() and (run / "checkpoint.pt").is_file()


def test_an_oserror_during_training_says_what_is_kept(tmp_path, monkeypatch, capsys):
    import errno as errno_
    from fastrwa.train import cli

    def full_disk(*args, **kwargs):
        raise OSError(errno_.ENOSPC, "No space left on device", "metrics.jsonl")

    monkeypatch.setattr(cli, "train", full_disk)
    code, _ = _run(tmp_path, "run", *SYNTHETIC, "--steps", 1)
    err = capsys.readouterr().err
    assert code == 2 and "No space left" in err and "are kept" in err
    assert "nothing written before the failure was removed" not in err


def test_truncating_metrics_on_a_full_disk_leaves_them_whole(tmp_path, monkeypatch):
    from fastrwa.models.pretrained import WriteError
    from fastrwa.train.checkpoints import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    text = "".join(json.dumps({"step": k, "split": "train", "loss": 1.0}) + "\n"
                   for k in (1, 2, 3))
    path.write_text(text)

    def full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(WriteError, match="metrics.jsonl"):
        truncate_metrics(path, 1)
    monkeypatch.undo()
    assert path.read_text() == text and not (tmp_path / "metrics.jsonl.tmp").exists()
    truncate_metrics(path, 1)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1]


def test_messages_of_a_refused_language_model_run(tmp_path, capsys):
    """A misspelled --lm field names the field and the ones there are (it was Python's raw
    "__init__() got an unexpected keyword argument"); --task text without --data, or with a
    missing file, is refused before a run directory is named, and a text corpus's error does
    not point at the enwik8 download."""
    corpus = _corpus(tmp_path)
    code, _ = _run(tmp_path, "a", *_lm_flags(corpus), "--steps", 2, "--lm", "nheads=2")
    err = capsys.readouterr().err
    assert code == 2 and "--lm nheads=...: LMConfig has no field 'nheads'" in err
    assert "n_heads" in err and "unexpected keyword" not in err
    for flags, words in ((["--task", "text"], "needs --data"),
                         (["--task", "text", "--data", tmp_path / "missing.txt"],
                          "no such file (a byte corpus")):
        code, run = _run(tmp_path, "b", *flags, "--steps", 2)
        err = capsys.readouterr().err
        assert code == 2 and words in err and "run directory" not in err, err
        assert "enwik8" not in err and not run.exists()
