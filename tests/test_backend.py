"""Backend selection: use_backend, FASTRWA_BACKEND, "auto", and the missing Triton backend."""

import pytest
import torch

import fastrwa
from fastrwa import backend, cpu_backend, torch_backend


def _inputs():
    return torch.randn(1, 4, 2), torch.randn(1, 4, 2)


def test_default_is_auto_and_picks_the_compiled_cpu_kernels_on_cpu(monkeypatch):
    monkeypatch.delenv("FASTRWA_BACKEND", raising=False)
    assert fastrwa.get_backend() == "auto"
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert backend.resolve(torch.device("cpu"), dtype) is cpu_backend


def test_auto_falls_back_to_torch_when_numba_does_not_import(monkeypatch):
    monkeypatch.setattr(backend, "_numba_usable", lambda: False)
    assert backend.resolve(torch.device("cpu"), torch.float32) is torch_backend


def test_numba_backend_refuses_non_cpu_tensors():
    with fastrwa.use_backend("numba"), pytest.raises(RuntimeError, match="numba.*CPU.*meta"):
        backend.resolve(torch.device("meta"), torch.float32)


def test_use_backend_nests_and_restores(monkeypatch):
    monkeypatch.delenv("FASTRWA_BACKEND", raising=False)
    with fastrwa.use_backend("torch"):
        assert fastrwa.get_backend() == "torch"
        with fastrwa.use_backend("auto"):
            assert fastrwa.get_backend() == "auto"
        assert fastrwa.get_backend() == "torch"
        y, _ = fastrwa.rwa_scan(*_inputs())
        assert y.shape == (1, 4, 2)
    assert fastrwa.get_backend() == "auto"


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("FASTRWA_BACKEND", "torch")
    assert fastrwa.get_backend() == "torch"
    with fastrwa.use_backend("auto"):
        assert fastrwa.get_backend() == "auto"
    monkeypatch.setenv("FASTRWA_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FASTRWA_BACKEND.*'cuda'"):
        fastrwa.rwa_scan(*_inputs())


def test_triton_backend_on_cpu_without_the_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with fastrwa.use_backend("triton"):
        with pytest.raises(RuntimeError, match="triton.*CUDA.*TRITON_INTERPRET.*cpu"):
            fastrwa.rwa_scan(*_inputs())


def test_triton_backend_refuses_float64():
    z, a = (x.double() for x in _inputs())
    with fastrwa.use_backend("triton"), pytest.raises(TypeError, match="triton.*float64"):
        fastrwa.rwa_scan(z, a)


def test_auto_keeps_cpu_tensors_off_triton_even_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert backend.resolve(torch.device("cpu"), torch.float32) is cpu_backend


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend must be one of .*'numpy'"):
        with fastrwa.use_backend("numpy"):
            pass


def test_poisoned_buffers_catch_unwritten_entries(monkeypatch):
    """The NaN poison the suite runs with makes a skipped write visible."""
    from fastrwa import chunked

    real_scan = chunked.scan

    def scan_that_skips_the_last_step(l, lam, xs, init, with_sum, reverse, emit, chunk_size=None):
        def partial_emit(sel, *state):
            if sel.start != l.shape[1] - 1:
                emit(sel, *state)
        return real_scan(l, lam, xs, init, with_sum, reverse, partial_emit, chunk_size)

    monkeypatch.setattr(chunked, "scan", scan_that_skips_the_last_step)
    with fastrwa.use_backend("torch"):
        y, _ = fastrwa.rwa_scan(torch.randn(1, 5, 2), torch.randn(1, 5, 2))
    assert torch.isnan(y[:, -1]).all() and torch.isfinite(y[:, :-1]).all()


def test_auto_warns_once_and_falls_back_when_the_numba_kernels_fail_to_load(monkeypatch):
    import builtins
    real_import = builtins.__import__

    def failing_import(name, globals=None, locals=None, fromlist=(), level=0):
        if fromlist and "cpu_backend" in fromlist:
            raise RuntimeError("cannot cache function: no locator available")
        return real_import(name, globals, locals, fromlist, level)

    backend._numba_usable.cache_clear()
    monkeypatch.setattr(builtins, "__import__", failing_import)
    try:
        with pytest.warns(RuntimeWarning, match="numba.*RuntimeError.*no locator.*'torch'"):
            assert backend.resolve(torch.device("cpu"), torch.float32) is torch_backend
    finally:
        monkeypatch.undo()
        backend._numba_usable.cache_clear()
    assert backend.resolve(torch.device("cpu"), torch.float32) is cpu_backend
