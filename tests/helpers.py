"""Inputs, the float64 reference and tolerances shared by the op tests."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import torch

import fastrwa
from fastrwa.kernels.codes import ATTENTIONS
from fastrwa.reference import rda_scan_reference, weighted_scan_reference
from fastrwa.state import ScanState
from fastrwa.testing import backend_options

if TYPE_CHECKING:
    from fastrwa.nn import LayerState

# Tolerances against a float64 reference evaluated on the same (rounded) inputs.
# Forward y, and gradients (scaled by the largest gradient entry).
TOL = {
    torch.float64: dict(y=1e-10, grad=1e-8),
    torch.float32: dict(y=2e-5, grad=1e-4),
    torch.bfloat16: dict(y=2e-2, grad=3e-2),
    torch.float16: dict(y=3e-3, grad=5e-3),
}


def randn(*shape, gen, uniform=False):
    """float64 numbers drawn on the CPU from ``gen`` (the same on every device), moved to the
    default device (CUDA in the ``--cuda`` columns, see conftest.py)."""
    draw = torch.rand if uniform else torch.randn
    x = draw(*shape, generator=gen, dtype=torch.float64, device="cpu")
    return x.to(torch.get_default_device())


def make_inputs(B, T, D, dtype=torch.float64, attention="exp", scale=1.0, seed=0, decay=True):
    """Random ``(z, a, g)``; "relu" logits are shifted so most weights are positive."""
    gen = torch.Generator().manual_seed(seed)
    z = randn(B, T, D, gen=gen)
    a = randn(B, T, D, gen=gen) * scale
    if attention == "relu":
        a = a + 0.5 * scale
    g = randn(B, T, D, gen=gen) * 2 if decay else None
    cast = lambda x: None if x is None else x.to(dtype)
    return cast(z), cast(a), cast(g)


def make_state(B, D, dtype=torch.float64, seed=1):
    """A canonical random state (``d >= 1``), as a scan would hand out."""
    gen = torch.Generator().manual_seed(seed)
    m = randn(B, D, gen=gen)
    n = randn(B, D, gen=gen)
    d = 1 + randn(B, D, gen=gen, uniform=True)
    return ScanState(m.to(dtype), n.to(dtype), d.to(dtype))


def run(z, a, g=None, attention="exp", state=None, final=False, reverse=False, chunk=None,
        cu_seqlens=None):
    """The op through the public functions (``g=None``: RWA), with a forced chunk size.

    ``chunk`` sets the torch backend's chunk and the numba backend's saved-state spacing;
    with a ``chunk`` the numba backend also splits channels into blocks of 2 (a partial
    block whenever ``D`` is odd). Triton's blocks are set by the ``backend`` fixture.
    """
    numba_opts = {} if chunk is None else dict(chunk=chunk, block=2)
    with backend_options("torch", chunk_size=chunk), backend_options("numba", **numba_opts):
        if g is None:
            return fastrwa.rwa_scan(z, a, state, final, reverse, cu_seqlens)
        return fastrwa.rda_scan(z, a, g, attention, state, final, reverse, cu_seqlens)


def reference(z, a, g=None, attention="exp", state=None, reverse=False, cu_seqlens=None):
    """The float64 reference on the same inputs (upcast; differentiable).

    With ``cu_seqlens``, each packed sequence runs on its own from its row of ``state``.
    """
    up = lambda x: None if x is None else x.double()
    st = None if state is None else ScanState(*(up(s) for s in state))
    if cu_seqlens is not None:
        ys, finals = [], []
        bounds = cu_seqlens.tolist()
        for i, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            part = lambda x: None if x is None else x[:, lo:hi]
            row = None if st is None else ScanState(*(s[i:i + 1] for s in st))
            y_i, f_i = reference(part(z), part(a), part(g), attention, row, reverse)
            ys.append(y_i)
            finals.append(f_i)
        return torch.cat(ys, dim=1), ScanState(*(torch.cat(p) for p in zip(*finals)))
    if g is None:
        return weighted_scan_reference(up(z), up(a), None, st, reverse)
    return rda_scan_reference(up(z), up(a), up(g), attention, st, reverse)


def assert_close(actual, expected, tol, what=""):
    actual = actual.double()
    assert torch.isfinite(actual).all(), f"{what}: non-finite entries"
    err = (actual - expected).abs().max().item() if actual.numel() else 0.0
    scale = max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol:.1e} * {scale:.3g}"


def loss_and_grads(fn, leaves, seed=0):
    """Gradients of a random linear functional of ``fn``'s outputs with respect to ``leaves``.

    ``fn()`` returns ``(y, state)``. The functional covers ``y`` and, when a state is
    returned, the gauge-invariant ``log(exp(m) d)`` and ``n / d`` (what any continuation
    of the scan depends on), so gradients flowing in through the final state are tested too.
    """
    y, state = fn()
    gen = torch.Generator().manual_seed(seed)
    weights = lambda x: randn(*x.shape, gen=gen).to(x.device)
    loss = (y.double() * weights(y)).sum()
    if state is not None:
        seen = state.d > 0   # an empty state (nothing seen) has no log-total or average
        log_total = torch.where(seen, state.m + torch.log(torch.where(seen, state.d, 1)), 0)
        loss = loss + (log_total.double() * weights(log_total)).sum()
        avg = state.average()
        loss = loss + (avg.double() * weights(avg)).sum()
    leaves = [x for x in leaves if x is not None]
    return torch.autograd.grad(loss, leaves, allow_unused=False)


def leaf(x, dtype=None):
    """A fresh leaf copy of ``x`` (optionally cast) that requires grad."""
    if x is None:
        return None
    return x.detach().to(dtype or x.dtype).clone().requires_grad_(True)


def compare_gradients(z, a, g, attention, state, reverse, chunk, dtype, tol=None, cu_seqlens=None):
    """Gradients of the op at ``dtype`` vs the float64 reference's autograd on the same values."""
    inputs = [leaf(x, dtype) for x in (z, a, g) if x is not None]
    st = None if state is None else ScanState(*(leaf(s, torch.float32 if dtype != torch.float64
                                                     else torch.float64) for s in state))
    padded = inputs + [None] * (3 - len(inputs))
    got = loss_and_grads(lambda: run(*padded, attention, st, final=True, reverse=reverse,
                                     chunk=chunk, cu_seqlens=cu_seqlens),
                         inputs + ([] if st is None else list(st)))
    ref_inputs = [leaf(x, torch.float64) for x in inputs]
    ref_state = None if st is None else ScanState(*(leaf(s, torch.float64) for s in st))
    ref_padded = ref_inputs + [None] * (3 - len(ref_inputs))
    want = loss_and_grads(lambda: reference(*ref_padded, attention, ref_state, reverse,
                                            cu_seqlens),
                          ref_inputs + ([] if ref_state is None else list(ref_state)))
    assert len(got) == len(want)
    for i, (g_, w_) in enumerate(zip(got, want)):
        assert g_.dtype == (inputs + list(st or []))[i].dtype
        assert_close(g_, w_, tol or TOL[dtype]["grad"], f"gradient #{i} ({dtype})")


def in_forked_child(fn, timeout: float = 120.0):
    """What ``fn()`` returns when run in a child made by ``fork()`` (a DataLoader worker's
    start): the test fails if the child hangs past ``timeout`` seconds. ``fn`` runs in a
    copy of the caller's memory; its result comes back through a queue (picklable)."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    proc = ctx.Process(target=lambda: queue.put(fn()))
    proc.start()
    proc.join(timeout)
    hung = proc.is_alive()
    if hung:
        proc.kill()
    assert not hung, "the forked child hung"
    return queue.get(timeout=10)


# -- a refused in-place call leaves a layer's state as it was (tests of layers and models) --
def snapshot(state: "LayerState") -> list:
    """Copies of a :class:`fastrwa.nn.LayerState`'s tensors, to compare after a call."""
    return [t.detach().clone() for t in (*state.scan, state.last_input) if t is not None]


def assert_unchanged(state: "LayerState", before: list) -> None:
    """``state`` holds exactly the values :func:`snapshot` took."""
    now = [t for t in (*state.scan, state.last_input) if t is not None]
    for got, want in zip(now, before, strict=True):
        assert torch.equal(got, want), "a refused call changed the state"


def fit_on_bytes(model: torch.nn.Module, data: bytes, steps: int, window: int) -> torch.nn.Module:
    """``model`` (a byte LM: ``model(ids) -> (logits, state)``) trained ``steps`` Adam steps
    at 1e-2 on next-byte prediction over 8 random windows of ``window`` bytes of ``data``
    a step (seeded by the step), and put in eval mode: a tiny model whose next byte depends
    on what it read (an untrained one hides a state fed from the wrong context)."""
    ids = torch.tensor(list(data))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        starts = torch.randint(0, len(ids) - window - 1, (8,),
                               generator=torch.Generator().manual_seed(step))
        rows = torch.stack([ids[s:s + window + 1] for s in starts.tolist()])
        logits, _ = model(rows[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 rows[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


# lm-evaluation-harness's perplexity task over local documents (tests/hf/test_lm_eval.py,
# tests/serve/test_lm_eval_server.py): a JSON-lines file of {"text": ...}, read offline.
LM_EVAL_PPL_TASK = """task: fastrwa_local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
"""


def lm_eval_ppl_task(tmp_path, docs: list[str]):
    """Write the documents and :data:`LM_EVAL_PPL_TASK` over them under ``tmp_path``;
    return the folder of tasks to give lm-eval's ``TaskManager(include_path=...)``."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "fastrwa_local_ppl.yaml").write_text(LM_EVAL_PPL_TASK.format(data=data))
    return tasks
