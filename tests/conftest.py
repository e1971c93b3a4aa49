"""Pytest set-up: Triton runs under its interpreter on CPU, and fresh backend buffers are
poisoned with NaN in every test."""

import os

import torch

# Kernels pick interpreter or compiler when they are decorated, so this must precede any
# import of fastrwa.kernels. With a GPU present the kernels compile for it instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import fastrwa  # noqa: E402
from fastrwa import buffers  # noqa: E402

CPU_BACKENDS = ("torch", "numba")


@pytest.fixture(params=CPU_BACKENDS)
def op_backend(request):
    """Run the test once per CPU backend (modules opt in with ``usefixtures``)."""
    with fastrwa.use_backend(request.param):
        yield request.param


@pytest.fixture(autouse=True)
def poison_fresh_buffers():
    """Every buffer the backend allocates starts as NaN, so an unwritten entry fails a test."""
    buffers.set_poison(True)
    yield
    buffers.set_poison(False)
