"""Pytest set-up: fresh backend buffers are poisoned with NaN in every test."""

import pytest

from fastrwa import torch_backend


@pytest.fixture(autouse=True)
def poison_fresh_buffers():
    """Every buffer the backend allocates starts as NaN, so an unwritten entry fails a test."""
    torch_backend.set_poison(True)
    yield
    torch_backend.set_poison(False)
