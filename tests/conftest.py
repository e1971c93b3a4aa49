"""Pytest set-up: the backend matrix of the op tests, Triton under its interpreter on CPU,
and fresh backend buffers poisoned with NaN in every test.

The op tests take one of two fixtures:

* ``backend``: every registered backend ("torch", "numba", "triton"). Triton runs under the
  interpreter (no GPU here, and the interpreter is slow) with blocks small enough that the
  tests' shapes cross chunk edges, and channel-block edges at 5 or more channels. Its
  forward algorithm ("looped" or "segments") is chosen per test item by a stable hash of
  the item's name, so both are covered across the matrix at the cost of one. Inputs are
  made in ``backend.dtype``, the most precise dtype the backend takes (float64, or float32
  for Triton), and compared with ``backend.tol``; ``backend.splits(T)`` are the split
  points a streaming test tries (all of them, or for Triton the first, second, middle,
  last two).
* ``exact_backend``: the backends that compute in float64 ("torch", "numba"), for tests
  that are about float64 (gradcheck, 1e-12 agreement).

Two kinds of ``backend`` items are deselected for Triton (pytest reports them as deselected,
not passed): a ``chunk`` other than ``None`` (the torch and numba backends' chunk length;
Triton has no such knob, so they would repeat the ``None`` case), and a ``dtype`` of float64
(Triton refuses it; tests/backends/test_selection.py checks the error). A third kind, on the
interpreter only: items marked ``triton_repeat``, whose Triton column repeats what the op
tests check through the interpreter (a training step over packed documents, which the
cu_seqlens op tests cover; input layouts, which the Triton launcher makes contiguous before
any kernel reads them). With ``keep=[...]`` the marker leaves out only the items whose
parameters match none of those listed: a cross product whose other cases repeat, on the
interpreter, kernel code that the kept ones run (every attention at every input dtype: the
attention code depends on the dtype only through ``NEWTON``, float32 or not, so float32 and
bfloat16 take both of its branches for every attention, and float16 differs from bfloat16
only in the loads' and stores' conversion, which does not depend on the attention). Under
``--cuda`` they run.

``python -m pytest --cuda`` (on a machine with a CUDA GPU) runs the Triton column compiled,
on CUDA tensors, twice per test: "triton-looped" and "triton-segments", each with the same
small blocks. Inside those items the default device is CUDA, so tensors a test makes without
naming a device are CUDA tensors; the helpers draw random numbers on the CPU (reproducible
across devices) and move them. Tests marked ``cuda`` run only under ``--cuda``; without it
they are deselected (reported, not passed), which is how CI, with no GPU, treats them.
Tests marked ``interpreter`` run the Triton backend on CPU tensors on purpose (traffic
counted by the interpreter, launch arguments spied on); under ``--cuda`` they are deselected.
"""

import dataclasses
import hashlib
import os
import sys

import pytest
import torch

import fastrwa
from fastrwa.ops.dispatch import BACKENDS
from fastrwa.testing import backend_options, poison_buffers
from helpers import TOL

TRITON_KERNELS = "fastrwa.kernels.triton.scan_fwd"

# Triton's blocks in the op tests: chunks of 4 steps, 4 channels in both passes (as the
# launcher's defaults do: 32 channels in both). A backward block of its own (2 channels,
# several blocks at 5 channels) runs in the variant and chained checks against the reference
# (tests/triton_helpers.py SMALL); here it doubled the backward's programs, each
# interpreted op by op.
TRITON_SMALL = dict(block_t=4, block_d=4, block_d_backward=4, segment_chunks=2)


@dataclasses.dataclass(frozen=True)
class BackendCase:
    """One column of the op test matrix."""

    name: str                     # the backend's name
    options: dict                 # knobs forced for the test
    dtype: torch.dtype            # the most precise input dtype the backend takes
    interpreted: bool = False     # slow: the streaming tests try fewer split points
    device: str = "cpu"           # where the test's tensors live (the default device)

    @property
    def tol(self) -> dict:
        return TOL[self.dtype]

    @property
    def exact(self) -> bool:
        return self.dtype == torch.float64

    def splits(self, T: int) -> list[int]:
        return sorted({0, 1, T // 2, T - 1, T}) if self.interpreted else list(range(T + 1))


TRITON_ALGORITHMS = ("looped", "segments")
CASES = {
    "torch": BackendCase("torch", {}, torch.float64),
    "numba": BackendCase("numba", {}, torch.float64),
    "triton": BackendCase("triton", TRITON_SMALL, torch.float32, interpreted=True),
}
assert set(CASES) == set(BACKENDS), "a registered backend has no test case"
# Under --cuda the "triton" column is replaced by one column per forward algorithm.
CUDA_CASES = {
    f"triton-{alg}": BackendCase("triton", dict(TRITON_SMALL, algorithm=alg), torch.float32,
                                 device="cuda")
    for alg in TRITON_ALGORITHMS
}


def pytest_addoption(parser):
    parser.addoption("--cuda", action="store_true",
                     help="run the Triton column of the op tests compiled, on CUDA tensors, "
                          "once per forward algorithm, and the tests marked 'cuda' "
                          "(needs a CUDA GPU)")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; runs only under --cuda")
    config.addinivalue_line("markers", "interpreter: runs Triton on CPU tensors; not under --cuda")
    config.addinivalue_line("markers", "triton_repeat(keep=None): its Triton column repeats "
                            "what the op tests check (with keep: but for the parameters "
                            "listed); left out on the interpreter, run under --cuda")
    if config.getoption("--cuda"):
        if not torch.cuda.is_available():
            raise pytest.UsageError("--cuda needs a CUDA GPU, and torch sees none")
        if os.environ.get("TRITON_INTERPRET") == "1":
            raise pytest.UsageError("--cuda compiles the Triton kernels; unset TRITON_INTERPRET")
    else:
        # The kernels pick interpreter or compiler when they are decorated (on first use of
        # the backend), so this must come before that; the CPU tensors need the interpreter.
        assert TRITON_KERNELS not in sys.modules, "Triton kernels imported before configure"
        os.environ["TRITON_INTERPRET"] = "1"
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # Under pytest-xdist (-n N: the README's command), one thread a worker and in the
        # processes it starts: N workers share N cores, and a run's thread count (which a
        # bit-identical resume depends on) does not follow the other workers' load.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


def backend_cases(config) -> dict[str, BackendCase]:
    """The columns of the ``backend`` matrix for this run."""
    if not config.getoption("--cuda"):
        return CASES
    return {k: c for k, c in CASES.items() if k != "triton"} | CUDA_CASES


def pytest_generate_tests(metafunc):
    cases = backend_cases(metafunc.config)
    for name, pick in (("backend", lambda c: True), ("exact_backend", lambda c: c.exact)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(name, [k for k, c in cases.items() if pick(c)], indirect=True)


def _enter(case: BackendCase, nodeid: str):
    options = dict(case.options)
    if case.name == "triton" and "algorithm" not in options:
        digest = hashlib.sha256(nodeid.encode()).digest()[0]
        options["algorithm"] = TRITON_ALGORITHMS[digest % len(TRITON_ALGORITHMS)]
    with backend_options(case.name, **options), fastrwa.use_backend(case.name), \
            torch.device(case.device):
        yield case


@pytest.fixture
def backend(request):
    """Run the test once per backend column; yields its :class:`BackendCase`."""
    yield from _enter(backend_cases(request.config)[request.param], request.node.nodeid)


@pytest.fixture
def exact_backend(request):
    """Run the test once per backend that computes in float64."""
    yield from _enter(backend_cases(request.config)[request.param], request.node.nodeid)


def _interpreter_repeat(marker, params: dict) -> bool:
    """Whether a ``triton_repeat`` marker makes an item a repeat on the interpreter: always,
    or, with ``keep=[{param: value, ...}, ...]``, unless the item's parameters match one of
    those (``@pytest.mark.triton_repeat(keep=[dict(attention="exp")])``: the Triton column
    keeps one attention)."""
    if marker is None:
        return False
    keep = marker.kwargs.get("keep")
    if keep is None:
        return True
    unknown = {k for case in keep for k in case} - set(params)
    if unknown:     # (a misspelt name would match nothing and leave every case out)
        raise pytest.UsageError(f"triton_repeat(keep=...) names {sorted(unknown)}, which are "
                                f"not parameters of the test ({sorted(params)})")
    return not any(all(params[k] == v for k, v in case.items()) for case in keep)


def pytest_collection_modifyitems(config, items):
    cuda = config.getoption("--cuda")
    keep, drop = [], []
    for item in items:
        params = getattr(item, "callspec", None)
        params = params.params if params else {}
        triton = str(params.get("backend", "")).startswith("triton")
        repeat = params.get("chunk") is not None or params.get("dtype") == torch.float64 \
            or (_interpreter_repeat(item.get_closest_marker("triton_repeat"), params)
                and not cuda)
        needs_gpu = item.get_closest_marker("cuda") is not None and not cuda
        needs_cpu = item.get_closest_marker("interpreter") is not None and cuda
        (drop if (triton and repeat) or needs_gpu or needs_cpu else keep).append(item)
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
