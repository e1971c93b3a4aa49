"""Reliability of ``python -m fastrwa.train`` (issue 22): damaged data and exports, what a
resume depends on, --overwrite, the run directory's lock, full disks, a corpus rewritten
during a run, numbers no run can use, and messages that name the real problem."""

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

from fastrwa.train import data as fdata
from fastrwa.train.cli import main as train_main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SYNTHETIC = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--log-every", 1]


def _run(tmp_path: Path, name: str, *flags) -> tuple[int, Path]:
    args = ["--run-dir", str(tmp_path / name), "--no-progress", *map(str, flags)]
    return train_main(args), tmp_path / name


def _resume(run: Path, *flags) -> int:
    return train_main(["--resume", str(run), "--no-progress", *map(str, flags)])


def _corpus(tmp_path: Path, name: str = "corpus.txt", n: int = 6_000) -> Path:
    path = tmp_path / name
    path.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(n)))
    return path


def _lm_flags(corpus: Path) -> list:
    return ["--task", "text", "--data", corpus, "--hidden", 8, "--layers", 1, "--bptt", 16,
            "--batch-size", 2, "--warmup", 0, "--log-every", 1, "--eval-every", 2,
            "--checkpoint-every", 2, "--eval-bytes", 100]


# -- 5: enwik8.zip and its cached extraction ----------------------------------------------
def _zip(path: Path, raw: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", raw)
    return path


def test_a_truncated_zip_is_refused_not_trained_on_as_compressed_bytes(tmp_path, capsys):
    raw = bytes((i * 7 + i // 13) % 251 for i in range(20_000))
    whole = _zip(tmp_path / "whole.zip", raw).read_bytes()
    cut = tmp_path / "enwik8.zip"
    cut.write_bytes(whole[: len(whole) // 2])            # an interrupted download
    with pytest.raises(ValueError, match="truncated or damaged.*download it again"):
        fdata.read_corpus(cut)
    code, run = _run(tmp_path, "run", "--task", "enwik8", "--data", cut, "--hidden", 8,
                     "--layers", 1, "--batch-size", 2, "--bptt", 16, "--steps", 1)
    err = capsys.readouterr().err
    assert code == 2 and "enwik8.zip" in err and "truncated" in err
    assert not run.exists() or not any(run.iterdir())   # a rerun is not blocked


def test_a_damaged_cached_extraction_is_extracted_again(tmp_path, capsys):
    raw = bytes((i * 7 + i // 13) % 251 for i in range(20_000))
    archive = _zip(tmp_path / "enwik8.zip", raw)
    assert bytes(fdata.read_corpus(archive).tolist()) == raw
    (cached,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("enwik8")]
    damaged = bytearray(cached.read_bytes())
    damaged[1234] ^= 0x01                               # same size, one bit off
    cached.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert bytes(fdata.read_corpus(archive).tolist()) == raw
    assert "extracting" in capsys.readouterr().err
    assert cached.read_bytes() == raw


# -- 6: exported models -----------------------------------------------------------------
def _record_data_offset(path: Path, suffix: str) -> int:
    """Where the bytes of the zip record whose name ends with ``suffix`` start."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith(suffix))
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = int.from_bytes(header[26:28], "little"), \
        int.from_bytes(header[28:30], "little")
    return info.header_offset + 30 + name_len + extra_len


def test_an_export_with_a_flipped_byte_is_refused(tmp_path):
    from fastrwa.models import LMConfig, build, load_pretrained, save_pretrained

    model = build(LMConfig(d_model=8, n_layers=1))
    save_pretrained(model, tmp_path / "m")
    weights = tmp_path / "m" / "model.pt"
    data = bytearray(weights.read_bytes())
    data[_record_data_offset(weights, "data/0") + 3] ^= 0x7F   # the embedding's first value
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"model\.pt is corrupt.*CRC"):
        load_pretrained(tmp_path / "m")


# -- 7: what a resume depends on ----------------------------------------------------------
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


# -- 9: --overwrite -----------------------------------------------------------------------
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


# -- 10: one process per run directory ----------------------------------------------------
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


# -- 11: samples.txt on resume ------------------------------------------------------------
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


# -- 12: a checkpoint or export write that fails -----------------------------------------
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


# -- 13: a corpus rewritten during a run --------------------------------------------------
def test_a_corpus_truncated_while_in_use_cannot_crash_the_reader(tmp_path):
    """The corpus is memory-mapped; reading a page of a file truncated since killed the
    process with SIGBUS. The map is of a private copy now."""
    corpus = _corpus(tmp_path, n=1 << 20)
    script = textwrap.dedent(f"""
        from fastrwa.train.data import read_corpus
        data = read_corpus({str(corpus)!r})
        open({str(corpus)!r}, "wb").close()                # truncated in place
        print(int(data[-1]), int(data[len(data) // 2]))
    """)
    env = {**ENV, "FASTRWA_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    n = 1 << 20
    expected = f"{((n - 1) * 7 + (n - 1) // 13) % 251} {((n // 2) * 7 + (n // 2) // 13) % 251}"
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == expected


# -- 16: numbers no run can use, refused before anything is written -----------------------
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


# -- 21: messages that name the real problem ----------------------------------------------
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


def test_plot_writes_where_it_says_or_refuses_a_directory(tmp_path, capsys):
    from fastrwa.train.plot import main as plot_main

    code, run = _run(tmp_path, "run", *SYNTHETIC, "--steps", 2)
    assert code == 0
    (tmp_path / "out").mkdir()
    capsys.readouterr()
    assert plot_main([str(run), "--out", str(tmp_path / "out")]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert not (tmp_path / "out.png").exists()
    assert plot_main([str(run), "--out", str(tmp_path / "curves")]) == 0
    printed = capsys.readouterr().out.strip()
    assert Path(printed).read_bytes()[:4] == b"\x89PNG"


# -- review of the reliability changes ----------------------------------------------------
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


def test_our_saves_write_crcs_and_a_file_without_crcs_is_unverified_not_corrupt(tmp_path):
    from fastrwa.models import LMConfig, build, load_pretrained, save_pretrained

    model = build(LMConfig(d_model=8, n_layers=1))
    serialization = torch.serialization
    serialization.set_crc32_options(False)
    try:
        save_pretrained(model, tmp_path / "m")           # ours: CRCs written anyway
        assert serialization.get_crc32_options() is False          # and the option restored
        with zipfile.ZipFile(tmp_path / "m" / "model.pt") as z:
            assert all(i.CRC != 0 for i in z.infolist() if i.file_size > 0)
        torch.save(model.state_dict(), tmp_path / "m" / "model.pt")   # someone else's
    finally:
        serialization.set_crc32_options(True)
    with pytest.warns(UserWarning, match="written without CRCs.*cannot be verified"):
        load_pretrained(tmp_path / "m")


def test_an_unreadable_archive_is_an_oserror_not_corrupt(tmp_path, monkeypatch):
    import errno as errno_
    from fastrwa.models import pretrained

    path = tmp_path / "checkpoint.pt"
    torch.save({"a": torch.ones(2)}, path)

    def denied(*args, **kwargs):
        raise PermissionError(errno_.EACCES, "Permission denied", str(path))

    monkeypatch.setattr(pretrained.zipfile, "ZipFile", denied)
    with pytest.raises(PermissionError, match="Permission denied"):
        pretrained.check_archive(path, "checkpoint")


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


def test_a_corpus_that_cannot_be_read_is_not_called_a_cache_write_error(tmp_path):
    import errno as errno_

    class Failing:
        def read(self, n):
            raise OSError(errno_.EIO, "Input/output error")

    with pytest.raises(OSError) as info:
        fdata._copy(Failing(), tmp_path / "cached", tmp_path / "cached.tmp",
                    tmp_path / "corpus.txt")
    message = str(info.value)
    assert "cannot read" in message and "corpus.txt" in message and "cannot write" not in message
    assert not (tmp_path / "cached.tmp").exists()


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


def test_copies_left_by_killed_processes_are_removed(tmp_path, monkeypatch):
    """A process killed while copying a corpus into the cache leaves ``<name>.<pid>.tmp``;
    the next copy of that corpus removes those whose process is gone (they piled up, each the
    corpus's size), and leaves a live process's alone."""
    monkeypatch.setenv("FASTRWA_CACHE", str(tmp_path / "cache"))
    corpus = _corpus(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    size = corpus.stat().st_size
    sha = fdata.hashlib.sha256(corpus.read_bytes()).hexdigest()
    name = f"{corpus.name}-{size}-{sha[:16]}"
    cache = tmp_path / "cache"
    cache.mkdir()
    dead, live = cache / f"{name}.{dead_pid}.tmp", cache / f"{name}.1.tmp"   # (pid 1 runs)
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    path, got_sha = fdata._snapshot(corpus)
    assert path.read_bytes() == corpus.read_bytes() and got_sha == sha
    assert not dead.exists() and live.exists()


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


def test_a_log_line_during_training_is_not_glued_to_the_progress_bar(tmp_path, monkeypatch,
                                                                    capsys):
    """The CPU kernels' compile notice (a warning of the "fastrwa" logger) printed during a
    step goes through the progress bar's writer: it starts a line of its own (it was
    appended to the bar's line)."""
    import logging

    from fastrwa.train import problems
    real = problems.SyntheticProblem.batch

    def batch(self, step, streams):
        if step == 3:
            logging.getLogger("fastrwa").warning("fastrwa: a notice during a step")
        return real(self, step, streams)
    monkeypatch.setattr(problems.SyntheticProblem, "batch", batch)
    assert train_main(["--steps", "6", "--seq-len", "10", "--hidden", "4", "--batch-size", "2",
                       "--run-dir", str(tmp_path / "run")]) == 0
    err = capsys.readouterr().err
    at = err.index("fastrwa: a notice during a step")
    assert err[at - 1] in "\r\n", repr(err[max(0, at - 40):at + 40])


def test_evaluations_show_their_progress(tmp_path, capsys):
    """Each evaluation shows a progress bar over its batches (the final one, on a whole test
    split, can take minutes; it showed nothing), gone when it ends; none with
    --no-progress."""
    flags = ["--steps", "2", "--seq-len", "10", "--hidden", "4", "--batch-size", "2"]
    assert train_main([*flags, "--run-dir", str(tmp_path / "shown")]) == 0
    err = capsys.readouterr().err
    assert "valid evaluation: 100%" not in err         # (left: the bar is cleared)
    assert "valid evaluation:   0%" in err and "test evaluation:   0%" in err and "/4 " in err
    assert train_main([*flags, "--no-progress", "--run-dir", str(tmp_path / "quiet")]) == 0
    assert "evaluation:" not in capsys.readouterr().err


def test_minutes_sizes_the_run_from_a_calibration(tmp_path, monkeypatch, capsys):
    """--minutes M: the steps that fill M minutes at the calibrated seconds per step, the
    schedule decaying over them, recorded in config.json (a resume trains the same run);
    refused with --steps or not positive (with --resume the plan made at the start stands:
    tests/test_train_resume_flags.py)."""
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
