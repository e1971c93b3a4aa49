"""Pytest set-up: the backend matrix of the op tests, Triton under its interpreter on CPU,
and fresh backend buffers poisoned with NaN in every test.

The op tests take one of two fixtures:

* ``backend``: every registered backend ("torch", "numba", "triton"). Triton runs under the
  interpreter (no GPU here) with blocks small enough that the tests' shapes cross chunk and
  channel-block edges; its two forward algorithms are both covered (``triton-looped``,
  ``triton-three_phase``). Inputs are made in ``backend.dtype``, the most precise dtype the
  backend takes (float64, or float32 for Triton), and compared with ``backend.tol``.
* ``exact_backend``: the backends that compute in float64 ("torch", "numba"), for tests
  that are about float64 (gradcheck, 1e-12 agreement).

Two kinds of ``backend`` items are deselected for Triton (pytest reports them as deselected,
not passed): a ``chunk`` other than ``None`` (the torch and numba backends' chunk length;
Triton has no such knob, so they would repeat the ``None`` case), and a ``dtype`` of float64
(Triton refuses it; tests/test_backend.py checks the error).
"""

import dataclasses
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

    @property
    def tol(self) -> dict:
        return TOL[self.dtype]

    @property
    def exact(self) -> bool:
        return self.dtype == torch.float64


CASES = {
    "torch": BackendCase("torch", {}, torch.float64),
    "numba": BackendCase("numba", {}, torch.float64),
    "triton-looped": BackendCase("triton", dict(algorithm="looped", **TRITON_SMALL),
                                 torch.float32),
    "triton-three_phase": BackendCase("triton", dict(algorithm="three_phase", **TRITON_SMALL),
                                      torch.float32),
}
assert {c.name for c in CASES.values()} == set(REGISTRY), "a registered backend has no test case"


def _enter(case: BackendCase):
    with backend_options(case.name, **case.options), fastrwa.use_backend(case.name):
        yield case


@pytest.fixture(params=list(CASES))
def backend(request):
    """Run the test once per backend (and Triton algorithm); yields its :class:`BackendCase`."""
    yield from _enter(CASES[request.param])


@pytest.fixture(params=[k for k, c in CASES.items() if c.exact])
def exact_backend(request):
    """Run the test once per backend that computes in float64."""
    yield from _enter(CASES[request.param])


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
