"""``python -m fastrwa.train --context-parallel N`` under torchrun: 4 processes as 2 data
replicas x 2 context slices train like one process on the same global batch, and a run
stopped at a checkpoint resumes to the bit (carried states included); bad layouts are clear
errors."""

import json
import os
import subprocess
import sys

import pytest
import torch

from fastrwa.train.cli import main as train_main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
TIMING = ("tokens_per_s", "elapsed_s", "train_s")   # measured, so they differ from run to run


def _metrics(run_dir):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _flags(corpus, run_dir, *more):
    flags = ["-m", "fastrwa.train", "--task", "text", "--data", corpus, "--hidden", 16,
             "--layers", 2, "--bptt", 15, "--warmup", 2, "--log-every", 1, "--eval-every", 4,
             "--checkpoint-every", 3, "--eval-bytes", 300, "--no-progress", "--run-dir",
             run_dir, *more]
    return list(map(str, flags))


def _torchrun(processes, flags):
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", str(processes), *flags],
                         env=ENV, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(20_000)))
    return path


def test_two_by_two_processes_train_like_one_and_resume_to_the_bit(tmp_path, corpus):
    """Segments of 15 bytes (slices of 8 and 7) over 2 context ranks, 2 data replicas of 2
    rows: the losses of a one-process run on the same 4 rows (float32 sums in another
    order: within 1e-5); then the same run stopped at step 4 and resumed to step 6 gives
    the uninterrupted run's metrics and weights exactly."""
    from fastrwa.models import load_pretrained

    full = tmp_path / "full"
    _torchrun(4, _flags(corpus, full, "--steps", 6, "--batch-size", 2,
                        "--context-parallel", 2))
    one = tmp_path / "one"
    subprocess.run([sys.executable, *_flags(corpus, one, "--steps", 6, "--batch-size", 4)],
                   check=True, env=ENV, capture_output=True, timeout=600)
    split, alone = _metrics(full), _metrics(one)
    assert [(r["step"], r["split"]) for r in split] == [(r["step"], r["split"]) for r in alone]
    for a, b in zip(split, alone):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"])), (a, b)
    part = tmp_path / "part"
    _torchrun(4, _flags(corpus, part, "--steps", 4, "--decay-steps", 6, "--batch-size", 2,
                        "--context-parallel", 2))
    _torchrun(4, ["-m", "fastrwa.train", "--resume", str(part), "--steps", "6", "--no-progress"])
    # (the shorter run's test evaluation at its last step, 4, stays in its history)
    resumed = [r for r in _metrics(part) if (r["step"], r["split"]) != (4, "test")]
    assert resumed == split
    a, b = (load_pretrained(run / "model") for run in (full, part))
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(x, y), name


def test_packed_documents_over_two_context_ranks_train_like_one_process(tmp_path, corpus):
    """--pack with --context-parallel 2: each micro-batch's rows, flattened into one packed
    sequence with the whole sequence's cu_seqlens, split along time over the two ranks
    (documents cross the split): the losses of one process on the same rows, within 1e-5
    (float32 sums in another order), at every step and evaluation."""
    runs = {}
    for name, processes, more in (("split", 2, ["--context-parallel", 2]), ("one", 1, [])):
        runs[name] = tmp_path / name
        flags = _flags(corpus, runs[name], "--steps", 4, "--batch-size", 3, "--pack", "\\x05",
                       *more)
        if processes > 1:
            _torchrun(processes, flags)
        else:
            subprocess.run([sys.executable, *flags], check=True, env=ENV,
                           capture_output=True, timeout=600)
    split, alone = _metrics(runs["split"]), _metrics(runs["one"])
    assert [(r["step"], r["split"]) for r in split] == [(r["step"], r["split"]) for r in alone]
    for a, b in zip(split, alone):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * max(1.0, abs(b["loss"])), (a, b)


def test_a_group_size_that_does_not_divide_the_processes_is_a_clear_error(tmp_path, corpus,
                                                                         capsys):
    # (one process: the same check as for 3 processes and groups of 2)
    code = train_main(_flags(corpus, tmp_path / "r", "--steps", 2, "--batch-size", 2,
                             "--context-parallel", 2)[2:])
    assert code == 2
    assert ("--context-parallel 2 must divide the number of processes (1): each data "
            "replica is a group of 2 processes (run it under torchrun)") in capsys.readouterr().err


@pytest.mark.parametrize("flags,words", [
    (["--task", "adding", "--context-parallel", "2"], "needs --task enwik8 or text"),
    (["--model", "gru", "--context-parallel", "2"], "--model rda-scan or rwa-scan"),
    (["--bptt", "3", "--context-parallel", "4"], "--bptt (3) must be at least"),
    (["--compile", "--context-parallel", "2"], "cannot be combined"),
    (["--context-parallel", "0"], "--context-parallel must be at least 1"),
])
def test_bad_context_parallel_flags_are_clear_errors(tmp_path, corpus, capsys, flags, words):
    data = [] if "adding" in flags else ["--task", "text", "--data", str(corpus)]
    code = train_main([*data, *flags, "--steps", "1", "--no-progress", "--run-dir",
                       str(tmp_path / "bad")])
    assert code == 2
    assert words in capsys.readouterr().err
