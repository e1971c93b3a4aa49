"""Pytest set-up: the backend matrix of the op tests, Triton under its interpreter on CPU,
and fresh backend buffers poisoned with NaN in every test.

The op tests take one of two fixtures:

* ``backend``: every registered backend ("torch", "numba", "triton"). Triton runs under the
  interpreter (no GPU here, and the interpreter is slow) with blocks small enough that the
  tests' shapes cross chunk and channel-block edges. Its forward algorithm ("looped" or
  "three_phase") is chosen per test item by a stable hash of the item's name, so both are
  covered across the matrix at the cost of one. Inputs are made in ``backend.dtype``, the
  most precise dtype the backend takes (float64, or float32 for Triton), and compared with
  ``backend.tol``; ``backend.splits(T)`` are the split points a streaming test tries (all of
  them, or for Triton the first, second, middle, last two).
* ``exact_backend``: the backends that compute in float64 ("torch", "numba"), for tests
  that are about float64 (gradcheck, 1e-12 agreement).

Two kinds of ``backend`` items are deselected for Triton (pytest reports them as deselected,
not passed): a ``chunk`` other than ``None`` (the torch and numba backends' chunk length;
Triton has no such knob, so they would repeat the ``None`` case), and a ``dtype`` of float64
(Triton refuses it; tests/test_backend.py checks the error).
"""

import dataclasses
import hashlib
import os

import torch

# Kernels pick interpreter or compiler when they are decorated, so this must precede any
# import of the Triton kernels. With a GPU present the kernels compile for it instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fastrwa  # noqa: E402
from fastrwa.ops.registry import REGISTRY  # noqa: E402
from fastrwa.testing import backend_options, poison_buffers  # noqa: E402
from helpers import TOL  # noqa: E402

# Triton's blocks in the op tests: chunks of 4 steps, 4 channels (2 in the backward, as the
# backward's channel block differs from the forward's by default).
TRITON_SMALL = dict(block_t=4, block_d=4, block_d_backward=2)


@dataclasses.dataclass(frozen=True)
class BackendCase:
    """One column of the op test matrix."""

    name: str                     # the registry name
    options: dict                 # knobs forced for the test
    dtype: torch.dtype            # the most precise input dtype the backend takes
    interpreted: bool = False     # slow: the streaming tests try fewer split points

    @property
    def tol(self) -> dict:
        return TOL[self.dtype]

    @property
    def exact(self) -> bool:
        return self.dtype == torch.float64

    def splits(self, T: int) -> list[int]:
        return sorted({0, 1, T // 2, T - 1, T}) if self.interpreted else list(range(T + 1))


CASES = {
    "torch": BackendCase("torch", {}, torch.float64),
    "numba": BackendCase("numba", {}, torch.float64),
    "triton": BackendCase("triton", TRITON_SMALL, torch.float32, interpreted=True),
}
assert set(CASES) == set(REGISTRY), "a registered backend has no test case"
TRITON_ALGORITHMS = ("looped", "three_phase")


def _enter(case: BackendCase, nodeid: str):
    options = dict(case.options)
    if case.name == "triton":
        digest = hashlib.sha256(nodeid.encode()).digest()[0]
        options["algorithm"] = TRITON_ALGORITHMS[digest % len(TRITON_ALGORITHMS)]
    with backend_options(case.name, **options), fastrwa.use_backend(case.name):
        yield case


@pytest.fixture(params=list(CASES))
def backend(request):
    """Run the test once per backend; yields its :class:`BackendCase`."""
    yield from _enter(CASES[request.param], request.node.nodeid)


@pytest.fixture(params=[k for k, c in CASES.items() if c.exact])
def exact_backend(request):
    """Run the test once per backend that computes in float64."""
    yield from _enter(CASES[request.param], request.node.nodeid)


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        triton = str(params.get("backend", "")).startswith("triton")
        repeat = params.get("chunk") is not None or params.get("dtype") == torch.float64
        (drop if triton and repeat else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def poison_fresh_buffers():
    """Every buffer the backend allocates starts as NaN, so an unwritten entry fails a test."""
    with poison_buffers():
        yield


@pytest.fixture(autouse=True)
def _corpus_cache(tmp_path, monkeypatch):
    """Zip corpora are extracted into the test's own directory, not ~/.cache."""
    monkeypatch.setenv("FASTRWA_CACHE", str(tmp_path / "cache"))
