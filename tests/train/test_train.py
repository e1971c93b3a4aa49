"""Training: tasks, loaders, the CLI, exact resume after SIGKILL, torchrun with 2 processes;
the plot's --out, log lines beside the progress bar, and the evaluations' progress bars."""

import gzip
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from fastrwa.train import data as fdata
from fastrwa.train.tasks import TASKS, make_task
from fastrwa.train.cli import main as train_main
from fastrwa.train.models import MODELS

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


# -- tasks -----------------------------------------------------------------------------------
def test_adding_targets_and_baseline():
    task = make_task("adding", 50)
    b = task.batch(0, 4000)
    marked = b.x[..., 1].bool()
    assert marked.sum(1).eq(2).all()
    torch.testing.assert_close(b.target[:, -1], (b.x[..., 0] * marked).sum(1))
    naive = ((1.0 - b.target[:, -1]) ** 2).mean().item()       # always predict 1
    assert abs(naive - task.baseline) < 0.01 and abs(task.baseline - 0.167) < 1e-3


def test_copy_tasks_recall_the_symbols_after_the_delimiter():
    for name in ("copy", "variable-copy", "multicopy"):
        task = make_task(name, 60)
        b = task.batch(3, 5)
        tokens = b.x.argmax(-1)
        for row in range(5):
            delims = (tokens[row] == 9).nonzero().flatten().tolist()
            recalled = b.target[row][b.mask[row]].view(len(delims), -1)
            S = recalled.shape[1]
            for k, d in enumerate(delims):
                # copy: the symbols open the sequence; multicopy: they open each segment
                start = d - task.GAP - S if name == "multicopy" else 0
                assert recalled[k].tolist() == tokens[row, start:start + S].tolist()
        uniform = torch.zeros(5, b.x.shape[1], task.output_size)
        uniform[..., 8] = -1e9                     # never predict blank: uniform over K=8
        assert abs(task.score(uniform, b)[0].item() - task.baseline) < 1e-4


def test_parity_and_classify_length_targets():
    b = make_task("parity", 30).batch(1, 8)
    assert torch.equal(b.target, b.x[..., 0].long().cumsum(1) % 2) and b.mask.all()
    task = make_task("classify-length", 40)
    b = task.batch(2, 64)
    length = b.x[..., 0].sum(1)
    assert torch.equal(b.target[:, -1], (length > 20).long())
    assert task.baseline == 0.5 and task.higher_is_better


def test_batches_are_a_function_of_the_step():
    task = make_task("adding", 20, seed=3)
    assert torch.equal(task.batch(7, 4).x, task.batch(7, 4).x)
    assert not torch.equal(task.batch(7, 4).x, task.batch(8, 4).x)
    assert not torch.equal(task.batch(7, 4).x, task.batch(7, 4, "valid").x)


# -- loaders ---------------------------------------------------------------------------------
def _write_idx(path, array: torch.Tensor):
    header = bytes([0, 0, 8, array.dim()]) + struct.pack(f">{array.dim()}I", *array.shape)
    body = header + array.to(torch.uint8).numpy().tobytes()
    (gzip.open(path, "wb") if str(path).endswith(".gz") else open(path, "wb")).write(body)


def _tiny_mnist(directory: Path):
    gen = torch.Generator().manual_seed(0)
    for split, n in (("train", 40), ("t10k", 12)):
        images = torch.randint(0, 256, (n, 4, 4), generator=gen)
        labels = torch.randint(0, 10, (n,), generator=gen)
        _write_idx(directory / f"{split}-images-idx3-ubyte.gz", images)
        _write_idx(directory / f"{split}-labels-idx1-ubyte", labels)
    return images, labels


def test_idx_loader(tmp_path):
    images, labels = _tiny_mnist(tmp_path)
    got_images, got_labels = fdata.load_mnist(tmp_path, "test")
    assert torch.equal(got_images, images.to(torch.uint8)) and torch.equal(got_labels, labels)
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01\x00\x00\x00\x01x")
    with pytest.raises(ValueError, match="not an IDX file"):
        fdata.read_idx(tmp_path / "bad")
    with pytest.raises(FileNotFoundError, match="train-images-idx3-ubyte"):
        fdata.load_mnist(tmp_path / "nowhere", "train")


def test_corpus_split_zip_and_streams(tmp_path):
    raw = bytes(range(256)) * 8
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as z:
        z.writestr("enwik8", raw)
    assert bytes(fdata.read_corpus(tmp_path / "enwik8.zip").tolist()) == raw
    (tmp_path / "enwik8").write_bytes(raw)
    assert bytes(fdata.read_corpus(tmp_path / "enwik8").tolist()) == raw
    parts = fdata.split_corpus(fdata.read_corpus(tmp_path / "enwik8"))
    assert [len(parts[k]) for k in ("train", "valid", "test")] == [1844, 102, 102]
    assert bytes(torch.cat(list(parts.values())).tolist()) == raw
    n = 100_000_000                      # enwik8: exactly 90M / 5M / 5M
    assert (n - 2 * (n // 20), n // 20) == (90_000_000, 5_000_000)
    streams = fdata.ByteStreams(parts["train"], 3, 10)
    x, y, new_pass = streams.get(0)
    assert new_pass and x.shape == (3, 10) and torch.equal(x[:, 1:], y[:, :-1])
    x1, _, again = streams.get(1)
    assert not again and torch.equal(x1[:, 0], y[:, -1])    # consecutive segments continue


def test_the_zip_is_extracted_once_and_the_corpus_is_mapped_not_copied(tmp_path):
    """enwik8.zip is extracted into the cache once; every process then maps the same file
    (the corpus's bytes are not read into each process's memory)."""
    raw = bytes(range(256)) * 64
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as z:
        z.writestr("enwik8", raw)
    first = fdata.read_corpus(tmp_path / "enwik8.zip")
    cached = list((tmp_path / "cache").iterdir())
    assert len(cached) == 1 and cached[0].read_bytes() == raw
    mtime = cached[0].stat().st_mtime_ns
    second = fdata.read_corpus(tmp_path / "enwik8.zip")
    assert cached[0].stat().st_mtime_ns == mtime and torch.equal(first, second)
    rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096  # noqa: E731
    big = tmp_path / "big"
    big.write_bytes(b"\x07" * (64 << 20))
    before = rss()
    data = fdata.read_corpus(big)
    assert len(data) == 64 << 20 and rss() - before < (16 << 20)   # mapped, not read in
    assert int(data[12345]) == 7


@pytest.mark.parametrize("n, streams, segment", [(2, 4, 3), (101, 4, 7), (100, 3, 200),
                                                 (64, 8, 8)])
def test_whole_split_scores_every_byte_once(n, streams, segment):
    """Batched evaluation: every (previous byte -> next byte) pair of the split exactly once,
    in order within each row, and no target past the end."""
    data = torch.randint(0, 256, (n,), dtype=torch.uint8)
    pairs, rows = [], None
    for x, y in fdata.whole_split(data, streams, segment):
        rows = x if rows is None else torch.cat([rows, x], dim=1)
        keep = y >= 0
        pairs += list(zip(x[keep].tolist(), y[keep].tolist()))
    flat = rows.reshape(-1)[: n - 1]
    assert torch.equal(flat, data[:-1].long())              # rows continue the split
    assert sorted(pairs) == sorted(zip(data[:-1].tolist(), data[1:].tolist()))


# -- the CLI ---------------------------------------------------------------------------------
SYNTHETIC = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--log-every", 1]


def _run(tmp_path, name, *flags):
    args = ["--run-dir", str(tmp_path / name), "--no-progress", *map(str, flags)]
    return train_main(args), tmp_path / name


TIMING = ("tokens_per_s", "elapsed_s", "train_s")   # measured, so they differ from run to run


def _metrics(run_dir, timing=False):
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records if timing else [{k: v for k, v in r.items() if k not in TIMING}
                                   for r in records]


@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_a_few_steps(tmp_path, model):
    code, run = _run(tmp_path, model, "--model", model, "--task", "adding", "--seq-len", 12,
                     "--hidden", 8, "--layers", 2, "--batch-size", 4, "--steps", 4,
                     "--log-every", 2, "--eval-every", 4, "--eval-batches", 1)
    assert code == 0
    records = _metrics(run)
    assert [(r["step"], r["split"]) for r in records] == [(2, "train"), (4, "train"),
                                                          (4, "valid"), (4, "test")]
    assert all(math.isfinite(r["mse"]) for r in records)
    assert (run / "checkpoint.pt").is_file() and (run / "learning_curve.png").is_file()


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_synthetic_task_trains_a_few_steps(tmp_path, task):
    code, run = _run(tmp_path, task, "--task", task, "--seq-len", 30, "--hidden", 8,
                     "--batch-size", 4, "--steps", 2, "--log-every", 1, "--eval-batches", 1)
    assert code == 0 and [r["split"] for r in _metrics(run)] == ["train", "train", "valid",
                                                                   "test"]


def test_batches_are_made_on_the_cpu_whatever_the_default_device(tmp_path):
    """Every problem's batches are CPU tensors, the same numbers, when the default device is
    another (here "meta", standing in for CUDA under ``torch.set_default_device``): the
    generators are CPU ones and the trainer moves batches itself."""
    from fastrwa.train.problems import ByteLMProblem, ImageProblem, SyntheticProblem
    _tiny_mnist(tmp_path)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"one document.\n\nanother, longer document here.\n\n" * 40)
    problems = {name: SyntheticProblem(make_task(name, 40), 1) for name in TASKS}
    problems["pmnist"] = ImageProblem(str(tmp_path), True, 0, 1)
    problems["text, packed"] = ByteLMProblem(str(corpus), 2, 16, 0, pack=b"\n\n")
    for name, problem in problems.items():
        want = problem.batch(3, 2)
        with torch.device("meta"):
            got = problem.batch(3, 2)
        for field in ("x", "target", "mask", "starts"):
            a, b = getattr(want, field), getattr(got, field)
            if a is None:
                assert b is None, (name, field)
                continue
            assert b.device.type == "cpu" and torch.equal(a, b), (name, field)


def test_mnist_and_text_tasks(tmp_path):
    _tiny_mnist(tmp_path)
    code, run = _run(tmp_path, "pm", "--task", "pmnist", "--data", tmp_path, "--hidden", 8,
                     "--batch-size", 4, "--steps", 2, "--log-every", 1, "--eval-batches", 2)
    assert code == 0 and "accuracy" in _metrics(run)[-1]
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    code, run = _run(tmp_path, "txt", "--task", "text", "--data", corpus, "--hidden", 16,
                     "--batch-size", 2, "--bptt", 16, "--steps", 3, "--log-every", 1,
                     "--eval-bytes", 200, "--warmup", 0)
    assert code == 0 and 0 < _metrics(run)[-1]["bpc"] < 9
    with zipfile.ZipFile(tmp_path / "enwik8.zip", "w") as z:
        z.writestr("enwik8", corpus.read_bytes())
    code, run = _run(tmp_path, "enwik8", "--task", "enwik8", "--data", tmp_path / "enwik8.zip",
                     "--hidden", 8, "--layers", 1, "--batch-size", 2, "--bptt", 16,
                     "--steps", 4, "--warmup", 0, "--lr", 0.02, "--log-every", 1,
                     "--eval-bytes", 100)
    records = _metrics(run)
    assert code == 0 and {r["split"] for r in records} == {"train", "valid", "test"}
    held_out = [r["bpc"] for r in records if r["split"] != "train"]
    assert all(0 < bpc < 8 for bpc in held_out)             # learnt: better than uniform
    assert [r for r in records if r["split"] == "test"][0]["whole"]


def test_resume_of_a_finished_run_continues_exactly(tmp_path):
    flags = ["--task", "adding", "--seq-len", 15, "--hidden", 8, "--batch-size", 4,
             "--log-every", 2, "--eval-every", 5, "--checkpoint-every", 5]
    assert _run(tmp_path, "full", *flags, "--steps", 20)[0] == 0
    assert _run(tmp_path, "part", *flags, "--steps", 10)[0] == 0
    assert train_main(["--resume", str(tmp_path / "part"), "--steps", "20", "--no-progress"]) == 0
    # The shorter run's final test evaluation (step 10) stays in its history.
    resumed = [r for r in _metrics(tmp_path / "part") if (r["split"], r["step"]) != ("test", 10)]
    assert resumed == _metrics(tmp_path / "full")


def test_resume_after_sigkill_is_bit_identical(tmp_path):
    """A real kill -9 mid-run (stateful byte task: the carried TBPTT state is restored too)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(60_000)))
    flags = ["--task", "text", "--data", corpus, "--model", "rda-scan", "--hidden", 48,
             "--batch-size", 4, "--bptt", 64, "--steps", 300, "--log-every", 5,
             "--eval-every", 50, "--eval-bytes", 500, "--checkpoint-every", 25, "--no-progress"]
    cmd = [sys.executable, "-m", "fastrwa.train", *map(str, flags)]
    subprocess.run(cmd + ["--run-dir", str(tmp_path / "full")], check=True, env=ENV,
                   capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd + ["--run-dir", str(killed)], env=ENV,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        lines = (killed / "metrics.jsonl").read_text().splitlines() \
            if (killed / "metrics.jsonl").exists() else []
        if (killed / "checkpoint.pt").exists() and len(lines) >= 12:   # past step 50
            break
        time.sleep(0.005)
    assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    logged = len((killed / "metrics.jsonl").read_text().splitlines())
    subprocess.run([sys.executable, "-m", "fastrwa.train", "--resume", str(killed),
                    "--no-progress"], check=True, env=ENV, capture_output=True, timeout=600)
    assert logged < len(_metrics(tmp_path / "full"))
    assert _metrics(killed) == _metrics(tmp_path / "full")


def test_torchrun_two_processes_match_one_with_the_doubled_batch(tmp_path):
    common = ["-m", "fastrwa.train", "--task", "adding", "--seq-len", 20, "--hidden", 16,
              "--steps", 6, "--log-every", 1, "--eval-every", 6, "--no-progress"]
    common = list(map(str, common))
    # --standalone: the rendezvous store binds a port the OS picks (an earlier version picked
    # a free port itself and handed it over, a race that failed once in CI)
    ddp_run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                              "--nproc_per_node", "2", *common, "--batch-size", "4",
                              "--run-dir", str(tmp_path / "ddp")],
                             env=ENV, capture_output=True, text=True, timeout=600)
    assert ddp_run.returncode == 0, ddp_run.stdout[-3000:] + ddp_run.stderr[-3000:]
    subprocess.run([sys.executable, *common, "--batch-size", "8", "--run-dir",
                    str(tmp_path / "one")], check=True, env=ENV, capture_output=True,
                   timeout=600)
    ddp, one = _metrics(tmp_path / "ddp"), _metrics(tmp_path / "one")
    assert [r["step"] for r in ddp] == [r["step"] for r in one]
    for a, b in zip(ddp, one):
        if a["split"] == "train":
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"])), (a, b)


def test_errors(tmp_path, capsys):
    assert _run(tmp_path, "a", "--task", "enwik8", "--data", tmp_path / "nope")[0] == 2
    assert "no such file" in capsys.readouterr().err
    assert _run(tmp_path, "b", "--task", "enwik8")[0] == 2
    assert "needs --data" in capsys.readouterr().err
    assert _run(tmp_path, "c", "--seq-len", 10, "--hidden", 4, "--batch-size", 2,
                "--steps", 2)[0] == 0
    assert _run(tmp_path, "c", "--steps", 2)[0] == 2
    assert "--overwrite" in capsys.readouterr().err
    assert train_main(["--resume", str(tmp_path / "c"), "--model", "lstm"]) == 2
    err = capsys.readouterr().err
    assert "cannot change on resume" in err and "model: saved 'rwa-scan', given 'lstm'" in err
    (tmp_path / "c" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    assert train_main(["--resume", str(tmp_path / "c"), "--steps", "4", "--no-progress"]) == 2
    assert "corrupt" in capsys.readouterr().err
    assert train_main(["--resume", str(tmp_path / "missing")]) == 2
    assert "not a run directory" in capsys.readouterr().err


def test_plot_overlays_runs(tmp_path):
    for name in ("r1", "r2"):
        _run(tmp_path, name, "--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--steps", 4,
             "--log-every", 1)
    from fastrwa.train.plot import main as plot_main
    assert plot_main([str(tmp_path / "r1"), str(tmp_path / "r2"), "--out",
                      str(tmp_path / "both.png")]) == 0
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"


def test_compiled_training_follows_eager_training(tmp_path):
    flags = ["--task", "parity", "--seq-len", 16, "--hidden", 8, "--batch-size", 4,
             "--steps", 3, "--log-every", 1, "--eval-every", 3]
    assert _run(tmp_path, "eager", *flags)[0] == 0
    assert _run(tmp_path, "compiled", *flags, "--compile")[0] == 0
    for a, b in zip(_metrics(tmp_path / "compiled"), _metrics(tmp_path / "eager")):
        assert a["step"] == b["step"] and abs(a["loss"] - b["loss"]) < 1e-5, (a, b)


def test_resume_drops_a_metrics_line_cut_short_by_the_kill(tmp_path):
    flags = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--log-every", 1,
             "--checkpoint-every", 2, "--eval-every", 2]
    assert _run(tmp_path, "full", *flags, "--steps", 4)[0] == 0
    assert _run(tmp_path, "cut", *flags, "--steps", 2)[0] == 0
    with open(tmp_path / "cut" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tr')             # the kill hit mid-line
    assert train_main(["--resume", str(tmp_path / "cut"), "--steps", "4", "--no-progress"]) == 0
    resumed = [r for r in _metrics(tmp_path / "cut") if (r["split"], r["step"]) != ("test", 2)]
    assert resumed == _metrics(tmp_path / "full")


def test_overwrite_replaces_only_a_run_directory(tmp_path, capsys):
    """--overwrite removes a fastrwa run's files; a directory holding anything else (a home
    directory, the current directory) is refused, naming what is there, and left untouched."""
    flags = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--steps", 2]
    precious = tmp_path / "mine"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    assert _run(tmp_path, "mine", *flags, "--overwrite")[0] == 2
    assert "thesis.tex" in capsys.readouterr().err
    assert (precious / "thesis.tex").read_text() == "years of work"
    assert _run(tmp_path, "run", *flags)[0] == 0
    (tmp_path / "run" / "notes.txt").write_text("mine too")
    assert _run(tmp_path, "run", *flags, "--overwrite")[0] == 2
    assert "notes.txt" in capsys.readouterr().err and (tmp_path / "run" / "notes.txt").exists()
    (tmp_path / "run" / "notes.txt").unlink()
    assert _run(tmp_path, "run", *flags, "--overwrite")[0] == 0     # a run: replaced
    (tmp_path / "file").write_text("x")
    assert _run(tmp_path, "file", *flags)[0] == 2
    assert "is a file" in capsys.readouterr().err


def test_a_failed_metrics_rewrite_on_resume_keeps_the_history(tmp_path, monkeypatch, capsys):
    """Resume trims metric lines logged after the last checkpoint. A write that fails midway
    (a full disk) must leave the old file whole, and say so without a traceback."""
    import builtins
    import errno
    import io

    flags = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--log-every", 1,
             "--checkpoint-every", 2, "--eval-every", 2]
    assert _run(tmp_path, "run", *flags, "--steps", 2)[0] == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as f:
        f.write('{"step": 3, "split": "train", "loss": 1.0}\n')    # after the checkpoint
    before = metrics.read_text()
    real_open = builtins.open

    class DiskFull(io.StringIO):
        def __init__(self, real):
            super().__init__()
            self.real = real

        def write(self, text):
            self.real.write(text[: len(text) // 2])
            self.real.flush()
            raise OSError(errno.ENOSPC, "No space left on device", str(self.real.name))

        def __exit__(self, *exc):
            self.real.close()

    def full_disk_open(file, mode="r", *args, **kwargs):
        handle = real_open(file, mode, *args, **kwargs)
        if "w" in mode and "metrics.jsonl" in str(file):
            return DiskFull(handle)
        return handle

    monkeypatch.setattr(builtins, "open", full_disk_open)
    monkeypatch.setattr(io, "open", full_disk_open)
    code = train_main(["--resume", str(tmp_path / "run"), "--steps", "4", "--no-progress"])
    monkeypatch.undo()
    assert code == 2 and "No space left" in capsys.readouterr().err
    assert metrics.read_text() == before


def test_a_checkpoint_with_a_flipped_byte_is_refused(tmp_path, capsys):
    flags = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--checkpoint-every", 2]
    assert _run(tmp_path, "run", *flags, "--steps", 2)[0] == 0
    path = tmp_path / "run" / "checkpoint.pt"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    assert train_main(["--resume", str(tmp_path / "run"), "--steps", "4", "--no-progress"]) == 2
    assert "corrupt" in capsys.readouterr().err


@pytest.mark.parametrize("flags,words", [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--batch-size", "-1"], "--batch-size must be at least 1"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--log-every", "-5"], "--log-every must be at least 1"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be at least 1"),
    (["--eval-batches", "0"], "--eval-batches must be at least 1"),
    (["--lr", "inf"], "--lr must be a finite number above 0"),
    (["--lr", "0"], "--lr must be a finite number above 0"),
    (["--clip", "nan"], "--clip must be a finite number"),
])
def test_bad_numbers_are_clear_errors(tmp_path, capsys, flags, words):
    assert _run(tmp_path, "bad", *flags)[0] == 2
    assert words in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_resume_of_a_run_with_a_damaged_config_or_metrics_is_a_clear_error(tmp_path, capsys):
    flags = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--steps", 2,
             "--checkpoint-every", 1, "--log-every", 1]
    assert _run(tmp_path, "run", *flags)[0] == 0
    config = tmp_path / "run" / "config.json"
    good = config.read_text()
    for damaged in ("[1, 2]", '{"hidden": "wide"}', "{not json"):
        config.write_text(damaged)
        assert train_main(["--resume", str(tmp_path / "run"), "--no-progress"]) == 2
        assert "config.json is not a fastrwa run configuration" in capsys.readouterr().err
    config.write_text(good)
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write("[1, 2]\n{}\n")
    assert train_main(["--resume", str(tmp_path / "run"), "--steps", "3", "--no-progress"]) == 2
    assert "is not a metrics record" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["rda-scan", "gru"])
def test_torchrun_on_a_byte_corpus(tmp_path, model):
    """Two processes on a byte corpus (the carried state leaves the learned initial state
    without a gradient after the first segment; DDP must know it)."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(20_000)))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", "-m", "fastrwa.train", "--task", "text",
                          "--data", str(corpus), "--model", model, "--hidden", "8",
                          "--layers", "2", "--batch-size", "2", "--accum", "2", "--bptt", "16",
                          "--steps", "5", "--eval-every", "5", "--eval-bytes", "200",
                          "--no-progress", "--run-dir", str(tmp_path / "run")],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert [r["step"] for r in _metrics(tmp_path / "run") if r["split"] == "train"]
    from fastrwa.models import load_pretrained

    model = load_pretrained(tmp_path / "run" / "model")     # the export needs no training code
    assert model.config.layer == {"rda-scan": "rda", "gru": "gru"}[model_name(model)]
    # each process scored half of the test split's rows; their sums make the whole split's
    from fastrwa.train.device import placement
    from fastrwa.train.problems import ByteLMProblem

    test = [r for r in _metrics(tmp_path / "run") if r["split"] == "test"][-1]
    alone = ByteLMProblem(str(corpus), 2, 16, 200).evaluate(model.eval(), 2, "test",
                                                            placement("cpu", None))
    assert test["bytes"] == alone["bytes"] and test["whole"]
    assert abs(test["bpc"] - alone["bpc"]) < 1e-6, (test, alone)


def test_whole_split_shards_cover_every_byte_once():
    data = torch.arange(1000)            # (ids, not bytes: each target names its position)
    for world in (1, 2, 3, 8, 11):
        targets = [y for rank in range(world) for _, y in fdata.whole_split(data, 8, 30,
                                                                              (rank, world))]
        kept = torch.cat([y[y >= 0] for y in targets]).sort().values
        assert torch.equal(kept, torch.arange(1, 1000)), world


def model_name(model):
    return "gru" if model.config.layer == "gru" else "rda-scan"


def _lm_flags(corpus):
    return ["--task", "text", "--data", corpus, "--hidden", 16, "--layers", 2, "--bptt", 16,
            "--batch-size", 2, "--accum", 2, "--warmup", 3, "--log-every", 1,
            "--eval-every", 4, "--checkpoint-every", 3, "--eval-bytes", 300]


@pytest.mark.parametrize("model, flags, named", [
    ("lstm", ["--lm", "token_shift=false"], "--lm token_shift: --model lstm does not read it"),
    ("gru", ["--attention", "exp"], "--attention: --model gru does not read it"),
    ("transformer", ["--lm", "output_gate=false"], "--lm output_gate: --model transformer"),
    ("mingru", ["--lm", "learn_initial_state=false"], "--lm learn_initial_state: --model"),
    ("rwa-scan", ["--lm", "discount_init=spread"], "--lm discount_init: --model rwa-scan"),
    ("rda-scan", ["--lm", "preset=exp-tanh", "--attention", "exp", "--lm", "f_o=tanh"],
     "--attention, --lm f_o: --lm preset=exp-tanh sets RDA's attention and output functions"),
])
def test_language_model_refuses_fields_its_model_does_not_read(tmp_path, capsys, model, flags,
                                                                named):
    """A field the model ignores would look like an ablation and change nothing: refused,
    named, before anything is written."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    code, run = _run(tmp_path, "new", *_lm_flags(corpus), "--model", model, *flags)
    assert code == 2 and not run.exists()
    assert named in capsys.readouterr().err


def test_language_model_fields_a_model_reads_are_accepted(tmp_path, capsys):
    """...and the fields it reads are taken and recorded; on resume an unread one is refused
    and the run is left as it was."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    for name, model, flags in (("m", "mingru", ["--lm", "mlp_ratio=2"]),
                               ("t", "transformer", ["--lm", "n_heads=2", "--lm", "mlp_ratio=2"]),
                               ("r", "rwa-scan", ["--lm", "learn_initial_state=false"])):
        code, run = _run(tmp_path, name, *_lm_flags(corpus), "--model", model, "--steps", 2,
                         *flags)
        assert code == 0, name
        saved = json.loads((run / "config.json").read_text())["lm"]
        assert all(saved[k] == json.loads(v) for k, v in
                   (f.split("=") for f in flags if "=" in f)), saved
    capsys.readouterr()
    before = {name: (run / name).read_text() for name in ("config.json", "metrics.jsonl")}
    flags = ["--steps", "3", "--no-progress", "--lm", "discount_init=spread"]
    assert train_main(["--resume", str(run), *flags]) == 2
    assert "--lm discount_init: --model rwa-scan does not read it" in capsys.readouterr().err
    assert {name: (run / name).read_text() for name in before} == before


def test_language_model_resume_is_bit_identical(tmp_path):
    """A ByteLM run stopped at a checkpoint and resumed follows the uninterrupted run to the
    bit: weights, the warmup/cosine schedule, the carried states of every micro-batch."""
    from fastrwa.models import load_pretrained

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(8_000)))
    flags = _lm_flags(corpus)
    assert _run(tmp_path, "full", *flags, "--steps", 9)[0] == 0
    assert _run(tmp_path, "part", *flags, "--steps", 6, "--decay-steps", 9)[0] == 0
    assert train_main(["--resume", str(tmp_path / "part"), "--steps", "9", "--no-progress"]) == 0
    # (the shorter run's final evaluations, at step 6, stay in its history)
    resumed = [r for r in _metrics(tmp_path / "part")
               if r["step"] != 6 or r["split"] == "train"]
    assert resumed == _metrics(tmp_path / "full")
    full, part = (load_pretrained(tmp_path / name / "model") for name in ("full", "part"))
    for (name, a), b in zip(full.state_dict().items(), part.state_dict().values()):
        assert torch.equal(a, b), name
    lrs = [r["lr"] for r in _metrics(tmp_path / "full") if r["split"] == "train"]
    assert lrs[:3] == pytest.approx([2e-3 / 3, 4e-3 / 3, 2e-3]) and lrs[-1] == pytest.approx(2e-4)


def test_language_model_run_records_every_lm_field_and_old_runs_resume_as_built(tmp_path):
    """A new run's config.json holds every LMConfig field, so a resume builds the model the
    run started with whatever the defaults are by then; a run saved before ``output_gate``
    existed (no such field) resumes without the gate; ``--lm`` on resume (no ``--task``
    needed) names fields over the saved ones."""
    from fastrwa.models import LMConfig

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(8_000)))
    assert _run(tmp_path, "new", *_lm_flags(corpus), "--steps", 3)[0] == 0
    lm = json.loads((tmp_path / "new" / "config.json").read_text())["lm"]
    expected = LMConfig().to_dict()
    for flagged in ("layer", "d_model", "n_layers", "attention", "context"):
        del expected[flagged]
    assert lm == expected
    flags = [*_lm_flags(corpus), "--lm", "output_gate=false", "--steps", 3]
    assert _run(tmp_path, "old", *flags)[0] == 0
    saved = json.loads((tmp_path / "old" / "config.json").read_text())
    saved["lm"] = {}            # as written before the field existed
    (tmp_path / "old" / "config.json").write_text(json.dumps(saved))
    assert train_main(["--resume", str(tmp_path / "old"), "--steps", "5", "--no-progress",
                       "--lm", "output_gate=false"]) == 0
    assert [r["step"] for r in _metrics(tmp_path / "old") if r["split"] == "train"][-1] == 5
    assert train_main(["--resume", str(tmp_path / "old"), "--steps", "6", "--no-progress",
                       "--lm", "token_shift=false"]) == 2


def test_language_model_run_writes_samples_best_and_export(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    code, run = _run(tmp_path, "lm", *_lm_flags(corpus), "--steps", 8)
    assert code == 0
    err = capsys.readouterr().err
    assert "ByteLM (rda-scan)" in err and "parameters" in err
    assert (run / "samples.txt").read_text(encoding="utf-8").count("--- step") == 2
    for name in ("best", "model"):
        assert {p.name for p in (run / name).iterdir()} == {    # (docs/hf.md's format)
            "config.json", "model.pt", "generation_config.json", "tokenizer_config.json",
            "configuration_fastrwa.py", "modeling_fastrwa.py", "tokenization_fastrwa.py",
            "README.md"}
    records = _metrics(run, timing=True)
    assert all(r["tokens_per_s"] > 0 for r in records if r["split"] == "train")
    assert all(r["elapsed_s"] >= r["train_s"] > 0 for r in records)
    test = [r for r in records if r["split"] == "test"][0]
    assert test["whole"] and test["bytes"] == 9_000 // 20 - 1     # every byte of the split
    assert _run(tmp_path, "lm", *_lm_flags(corpus), "--steps", 2, "--overwrite")[0] == 0
    assert _run(tmp_path, "x", "--task", "text", "--data", corpus, "--model", "rwa-cell")[0] == 2
    assert "not a language model" in capsys.readouterr().err
    assert _run(tmp_path, "y", "--task", "text", "--data", corpus, "--lm", "heads=2")[0] == 2
    assert "heads" in capsys.readouterr().err
    assert _run(tmp_path, "y", "--task", "text", "--data", corpus, "--lm", "attention=exp")[0] == 2
    assert "--attention" in capsys.readouterr().err
    # an unusable --lm is refused before --overwrite removes the run it would replace
    assert _run(tmp_path, "lm", *_lm_flags(corpus), "--lm", "heads=2", "--overwrite")[0] == 2
    assert (run / "metrics.jsonl").is_file() and (run / "model" / "model.pt").is_file()


def test_plot_names_the_runs_it_cannot_overlay_and_reads_a_killed_run(tmp_path, capsys):
    from fastrwa.train.plot import main as plot_main

    _run(tmp_path, "mse", "--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--steps", 2,
         "--log-every", 1)
    _run(tmp_path, "acc", "--task", "parity", "--seq-len", 10, "--hidden", 4,
         "--batch-size", 2, "--steps", 2, "--log-every", 1)
    with open(tmp_path / "mse" / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "split": "tr')             # killed mid-write
    code = plot_main([str(tmp_path / "mse"), str(tmp_path / "acc"), "--out",
                      str(tmp_path / "both.png")])
    err = capsys.readouterr().err
    assert code == 1 and "not overlaid" in err and "acc" in err and "accuracy" in err
    assert (tmp_path / "both.png").read_bytes()[:4] == b"\x89PNG"
    (tmp_path / "acc" / "config.json").write_text("[]")
    assert plot_main([str(tmp_path / "acc")]) == 2
    assert "not a run configuration" in capsys.readouterr().err


def test_damaged_data_files_and_foreign_checkpoints_are_clear_errors(tmp_path, capsys):
    raw = bytes(range(256)) * 40
    good = tmp_path / "corpus.zip"
    with zipfile.ZipFile(good, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("corpus", raw)
    data = bytearray(good.read_bytes())
    data[len(data) // 2] ^= 0xFF                        # a flipped byte in the compressed data
    (tmp_path / "bad.zip").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="damaged"):
        fdata.read_corpus(tmp_path / "bad.zip")
    (tmp_path / "cut").write_bytes(b"\x00\x00\x08\x03\x00\x00")   # header cut short
    with pytest.raises(ValueError, match="cut short"):
        fdata.read_idx(tmp_path / "cut")
    (tmp_path / "cut.gz").write_bytes(b"\x1f\x8b\x08\x00broken")
    with pytest.raises(ValueError, match="cannot be read"):
        fdata.read_idx(tmp_path / "cut.gz")
    flags = ["--seq-len", 10, "--batch-size", 2, "--steps", 2, "--checkpoint-every", 1]
    assert _run(tmp_path, "small", *flags, "--hidden", 4)[0] == 0
    assert _run(tmp_path, "wide", *flags, "--hidden", 6)[0] == 0
    (tmp_path / "small" / "checkpoint.pt").write_bytes(
        (tmp_path / "wide" / "checkpoint.pt").read_bytes())
    assert train_main(["--resume", str(tmp_path / "small"), "--steps", "3",
                       "--no-progress"]) == 2
    assert "does not fit this run" in capsys.readouterr().err


def test_a_run_dir_that_cannot_be_made_is_a_clear_error(tmp_path, monkeypatch, capsys):
    """Below a file, or in a directory the user may not write (simulated: tests run as root,
    who may write anywhere): exit 2 with the reason and the path, no traceback."""
    import pathlib

    flags = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--steps", 1]
    (tmp_path / "file").write_text("x")
    assert _run(tmp_path, "file/run", *flags)[0] == 2
    err = capsys.readouterr().err
    assert "error:" in err and "file" in err and "Traceback" not in err
    real_mkdir = pathlib.Path.mkdir

    def read_only(self, *args, **kwargs):
        if self.name == "locked":
            raise PermissionError(13, "Permission denied", str(self))
        return real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    assert _run(tmp_path, "locked", *flags)[0] == 2
    err = capsys.readouterr().err
    assert "Permission denied" in err and "locked" in err
    assert not (tmp_path / "file").is_dir() and (tmp_path / "file").read_text() == "x"


def test_generate_streams_from_a_run_directory(tmp_path, capsysbinary):
    from fastrwa.generate import main as generate_main

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 200)
    code, run = _run(tmp_path, "lm", *_lm_flags(corpus), "--steps", 4)
    assert code == 0
    capsysbinary.readouterr()
    assert generate_main([str(run), "--prompt", "the quick", "--max-new", "30"]) == 0
    out = capsysbinary.readouterr()
    assert out.out.startswith(b"the quick") and len(out.out) == len("the quick") + 30 + 1
    assert b"bytes/s" in out.err
    assert generate_main([str(run), "--best", "--max-new", "5", "--beam", "3"]) == 0
    assert len(capsysbinary.readouterr().out) == 5 + 1
    assert generate_main([str(tmp_path / "nowhere")]) == 2
    assert b"no model there" in capsysbinary.readouterr().err
    threads = torch.get_num_threads()
    assert generate_main([str(run), "--max-new", "3", "--threads", "2"]) == 0
    assert torch.get_num_threads() == threads        # main gives the caller's count back
    assert generate_main([str(run), "--threads", "0"]) == 2
    assert b"--threads must be at least 1" in capsysbinary.readouterr().err


def test_torchrun_resume_picks_the_process_group_for_the_saved_device(tmp_path):
    """Under torchrun the process group (nccl or gloo) is chosen before rank 0 reads the run;
    on --resume without --device it must follow the saved run's device, not the default."""
    from fastrwa.train import cli

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"device": "cpu", "task": "text"}))

    def device(*argv):
        args = cli.parser().parse_args(list(argv))
        cfg, given = cli._config(args)
        return cli.run_device(args, cfg, given)

    assert device("--resume", str(run)) == "cpu"
    assert device("--resume", str(run), "--device", "cuda") == "cuda"
    assert device("--task", "text") == "auto"
    (run / "config.json").write_text("{not json")
    assert device("--resume", str(run)) == "auto"     # rank 0 reports the bad file next


def test_the_trainer_process_flushes_subnormals(monkeypatch):
    """``python -m fastrwa.train`` runs with subnormal floats flushed to zero (training makes
    them; x86 matrix products on them run several times slower, docs/training.md)."""
    import runpy
    import fastrwa.train.cli as cli
    tiny_product = lambda: (torch.tensor([1e-30]) * torch.tensor([1e-10])).item()  # noqa: E731
    assert tiny_product() != 0                       # PyTorch's default: kept
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush subnormals (torch.set_flush_denormal)")
    seen = []
    monkeypatch.setattr(cli, "main", lambda: seen.append(tiny_product()) or 0)
    try:
        with pytest.raises(SystemExit):
            runpy.run_module("fastrwa.train", run_name="__main__")
    finally:
        torch.set_flush_denormal(False)              # (this test's process: as it was)
    assert seen == [0.0]


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
