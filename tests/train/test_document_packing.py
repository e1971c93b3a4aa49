"""--pack: a byte corpus read as documents, packed into the trainer's rows without padding.
The trainer's packed step (its batch, the model's cu_seqlens forward, its loss and
gradients) equals training on every document piece alone, on every backend; the CLI runs
and refuses what it cannot do."""

import dataclasses

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig
from fastrwa.train.cli import main as train_main
from fastrwa.train.cli import unescape
from fastrwa.train.config import RunConfig
from fastrwa.train.packing import document_starts, model_inputs, packed_loss, packed_slice
from fastrwa.train.problems import ByteLMProblem
from helpers import TOL

DOCS = [b"the cat sat", b"a dog", b"x", b"we hid the big lid under the bed", b"",
        b"she fed ten hens and a cat", b"my hat is red", b"no"]
SEP = b"\n\n"


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_bytes(SEP.join(DOCS * 12))
    return path


def test_document_starts_follow_each_separator():
    data = torch.tensor(list(b"ab\n\ncd\n\n\n\nef\n"), dtype=torch.uint8)
    starts = document_starts(data, torch.arange(len(data)), SEP)
    # (after every occurrence, overlapping ones too: "\n\n\n\n" ends three documents)
    assert starts.nonzero()[:, 0].tolist() == [0, 4, 8, 9, 10]
    assert document_starts(data, torch.arange(len(data)), b"\n").nonzero()[:, 0].tolist() == \
        [0, 3, 4, 7, 8, 9, 10]


def test_a_packed_batch_marks_documents_and_ignores_the_targets_across_them(corpus):
    problem = ByteLMProblem(str(corpus), 3, 40, 0, pack=SEP)
    assert not problem.stateful
    for step in (0, 1, 5):
        batch = problem.batch(step, 3)
        index = problem.train.index(step)
        data = problem.train.data
        for r in range(3):
            for t in range(40):
                p = int(index[r, t])
                after_sep = p >= 2 and bytes(data[p - 2:p].tolist()) == SEP
                assert bool(batch.starts[r, t]) == (after_sep or p == 0), (step, r, t)
                nxt = int(index[r, t + 1])
                crosses = bytes(data[nxt - 2:nxt].tolist()) == SEP
                want = -100 if crosses else int(data[nxt])
                assert int(batch.target[r, t]) == want, (step, r, t)
    assert bool(problem.batch(0, 3).starts.any())


def _alone(model, x, y, starts):
    """The summed next-byte loss and count of every piece of every row, each run alone."""
    total, count = 0.0, 0
    for row, target, begins in zip(x, y, starts):
        edges = begins.clone()
        edges[0] = True
        cut = edges.nonzero()[:, 0].tolist() + [len(row)]
        for lo, hi in zip(cut[:-1], cut[1:]):
            logits, _ = model(row[None, lo:hi])
            total = total + torch.nn.functional.cross_entropy(
                logits[0], target[lo:hi], reduction="sum")
            count += int((target[lo:hi] >= 0).sum())
    return total, count


@pytest.mark.triton_repeat        # (tests/op/test_cu_seqlens.py: Triton's packed sequences)
@pytest.mark.parametrize("layer", ["rda", "rwa"])
def test_the_packed_step_equals_each_document_alone(corpus, backend, layer):
    """Forward and backward: the trainer's loss of a packed batch (model_inputs, the
    model's cu_seqlens forward, the problem's score) and its gradients are those of the
    mean over every document piece run from the initial state alone."""
    problem = ByteLMProblem(str(corpus), 2, 24, 0, pack=SEP)
    batch = problem.batch(3, 2)             # made on the CPU, where the corpus is
    batch = dataclasses.replace(batch, **{f: getattr(batch, f).to(backend.device)
                                          for f in ("x", "target", "mask", "starts")})
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=8, n_layers=2, layer=layer, mlp_ratio=2)).to(backend.dtype)
    x, packed = model_inputs(batch.x, batch.starts)
    assert x.shape == (1, 48) and packed["cu_seqlens"].numel() > 3
    output, _ = model(x, None, **packed)
    trainers, _ = problem.score(output, batch)              # (computed in float32)
    tokens, targets, _, scored = packed_slice(batch.x, batch.target, batch.starts)
    assert torch.equal(tokens, x)
    in_the_loop, _ = packed_loss(output, targets, scored)   # (what the trainer's loop takes)
    # the same mean in the model's dtype: the backend's precision, not float32's
    loss = torch.nn.functional.cross_entropy(output[0], batch.target.reshape(-1))
    grads = torch.autograd.grad(loss, list(model.parameters()))
    total, count = _alone(model, batch.x, batch.target, batch.starts)
    want = total / count
    want_grads = torch.autograd.grad(want, list(model.parameters()))
    tol = TOL[backend.dtype]
    trainers, in_the_loop, loss, want = (float(v.detach())
                                         for v in (trainers, in_the_loop, loss, want))
    assert abs(trainers - want) < 1e-5 and abs(in_the_loop - want) < 1e-5
    assert abs(loss - want) <= tol["y"] * max(1.0, abs(want))
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=tol["grad"], atol=tol["grad"])


def test_a_packed_run_trains_and_records_its_separator(corpus, tmp_path, capsys):
    run = tmp_path / "run"
    flags = ["--task", "text", "--data", str(corpus), "--hidden", "16", "--layers", "1",
             "--bptt", "32", "--batch-size", "2", "--steps", "6", "--eval-every", "6",
             "--eval-bytes", "100", "--no-progress", "--run-dir", str(run)]
    assert train_main([*flags, "--pack"]) == 0
    assert RunConfig.from_dict(__import__("json").loads(
        (run / "config.json").read_text())).pack == "\n\n"
    assert train_main([*flags, "--pack", "\\n", "--run-dir", str(tmp_path / "r2")]) == 0
    capsys.readouterr()
    for extra, message in ((["--pack", "--model", "lstm"], "--pack reads a byte corpus"),
                           (["--pack", ""], "must not be empty")):
        assert train_main([*flags, *extra, "--run-dir", str(tmp_path / "bad")]) == 2
        assert message in capsys.readouterr().err


def test_separators_read_escapes_and_keep_other_text():
    assert unescape("\\n\\n") == "\n\n" and unescape("</page>") == "</page>"
    assert unescape("é\\t中") == "é\t中"
