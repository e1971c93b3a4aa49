"""Backend selection: the dispatch module, use_backend, FASTRWA_BACKEND, "auto", the missing Triton
backend, and gradients taken outside the block that ran the forward."""

import pytest
import torch

import fastrwa
from fastrwa.ops import dispatch
from fastrwa.ops.dispatch import Backend
from fastrwa.reference import rda_scan_reference
from helpers import TOL, assert_close, make_inputs, make_state


def _inputs():
    return torch.randn(1, 4, 2), torch.randn(1, 4, 2)


def test_default_is_auto_and_picks_the_compiled_cpu_kernels_on_cpu(monkeypatch):
    monkeypatch.delenv("FASTRWA_BACKEND", raising=False)
    assert fastrwa.get_backend() == "auto"
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        assert dispatch.resolve(torch.device("cpu"), dtype) == "numba"
    assert dispatch.resolve(torch.device("meta"), torch.float32) == "torch"


def test_every_backend_satisfies_the_contract():
    """The contract is four members (one optional); every backend has the three required
    ones, and its knobs for fastrwa.testing.backend_options."""
    contract = [name for name in vars(Backend) if not name.startswith("_")]
    assert sorted(contract) == ["backward", "forward", "saved_like", "step_"]
    assert dispatch.BACKENDS[-1] == "torch"
    for name in dispatch.BACKENDS:
        module = dispatch.load(name)
        for member in ("forward", "saved_like", "backward"):
            assert callable(getattr(module, member, None)), (name, member)
        assert isinstance(module.options(), module.Options), name
    assert callable(dispatch.load("numba").step_)


def test_importing_fastrwa_imports_neither_triton_nor_numba():
    """Both load with their backend: TRITON_INTERPRET (read when triton is imported) may be
    set after ``import fastrwa``, and a CPU-only user pays no compiler import."""
    import subprocess
    import sys

    code = "import sys, fastrwa; print(sorted({m.split('.')[0] for m in sys.modules} & {'triton', 'numba', 'torch._dynamo'}), 'torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out == ["[]", "False"], out


WITHOUT_TRITON = """
import sys
class NoTriton:
    # An import finder for a machine without triton: `import triton` fails as it would there.
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, NoTriton())
"""


def test_triton_is_not_a_dependency_of_a_cpu_install():
    """Triton (1 GB) comes with CUDA builds of PyTorch and with the [dev] extra, not with
    ``pip install fastrwa``."""
    import pathlib
    import tomllib

    project = tomllib.loads((pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml")
                            .read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("triton")]
    assert [d for d in project["optional-dependencies"]["dev"] if d.startswith("triton")]


def test_without_triton_everything_but_the_triton_backend_works():
    """On a machine without triton: fastrwa and its layers, models, trainer and generate CLI
    import, every CPU backend runs, and asking for Triton says how to get it."""
    import subprocess
    import sys

    code = WITHOUT_TRITON + """
import os, torch, fastrwa, fastrwa.nn, fastrwa.models, fastrwa.train, fastrwa.generate
os.environ["TRITON_INTERPRET"] = "1"
z, a = torch.randn(2, 5, 3), torch.randn(2, 5, 3)
for name in ("auto", "numba", "torch"):
    with fastrwa.use_backend(name):
        assert fastrwa.rwa_scan(z, a)[0].shape == (2, 5, 3)
try:
    with fastrwa.use_backend("triton"):
        fastrwa.rwa_scan(z, a)
except ModuleNotFoundError as error:
    print(error)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert "'triton' needs the triton package" in result.stdout, result.stdout
    assert "pip install triton" in result.stdout and "CUDA builds of PyTorch" in result.stdout
    assert "Warning" not in result.stderr, result.stderr


def test_numba_backend_refuses_non_cpu_tensors():
    with fastrwa.use_backend("numba"), pytest.raises(RuntimeError, match="numba.*CPU.*meta"):
        dispatch.resolve(torch.device("meta"), torch.float32)


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


def test_triton_backend_refuses_float64(request):
    device = "cuda" if request.config.getoption("--cuda") else "cpu"   # cpu: the interpreter
    z, a = (x.to(device, torch.float64) for x in _inputs())
    with fastrwa.use_backend("triton"), pytest.raises(TypeError, match="triton.*float64"):
        fastrwa.rwa_scan(z, a)


def test_auto_keeps_cpu_tensors_off_triton_even_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert dispatch.resolve(torch.device("cpu"), torch.float32) == "numba"


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend must be one of .*'numpy'"):
        with fastrwa.use_backend("numpy"):
            pass


def test_poisoned_buffers_catch_unwritten_entries(monkeypatch):
    """The NaN poison the suite runs with makes a skipped write visible."""
    from fastrwa.ops import chunked

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
    def failing_load(name):
        if name == "numba":
            raise RuntimeError("cannot cache function: no locator available")
        return loaded(name)

    loaded = dispatch.load
    dispatch.clear_cache()
    monkeypatch.setattr(dispatch, "load", failing_load)
    try:
        with pytest.warns(RuntimeWarning, match="'numba'.*RuntimeError.*no locator.*'torch'"):
            assert dispatch.resolve(torch.device("cpu"), torch.float32) == "torch"
        assert dispatch.resolve(torch.device("cpu"), torch.float32) == "torch"  # no 2nd warning
        with fastrwa.use_backend("numba"), pytest.raises(RuntimeError, match="no locator"):
            fastrwa.rwa_scan(torch.randn(1, 4, 2), torch.randn(1, 4, 2))
    finally:
        monkeypatch.undo()
        dispatch.clear_cache()
    assert dispatch.resolve(torch.device("cpu"), torch.float32) == "numba"


PAIRS = [pytest.param(f, b, marks=[pytest.mark.interpreter] if "triton" in (f, b) else [])
         for f in ("torch", "numba", "triton") for b in ("torch", "numba", "triton") if f != b]


@pytest.mark.parametrize("forward,outside", PAIRS)
def test_backward_outside_the_block_uses_the_forward_s_backend(forward, outside):
    """A forward under use_backend(X) and .backward() under another backend gives the
    reference's gradients: the backward runs on X, with X's saved tensors."""
    z, a, g = make_inputs(2, 9, 3, dtype=torch.float32, attention="sigmoid", seed=3)
    state = make_state(2, 3, dtype=torch.float32)
    leaves = [x.clone().requires_grad_() for x in (z, a, g)]
    with fastrwa.use_backend(forward):
        y, _ = fastrwa.rda_scan(*leaves, "sigmoid", state)
    with fastrwa.use_backend(outside):
        grads = torch.autograd.grad(y.sum(), leaves)
    ref = [x.double().requires_grad_() for x in (z, a, g)]
    y_ref, _ = rda_scan_reference(*ref, "sigmoid", tuple(s.double() for s in state))
    for got, want in zip(grads, torch.autograd.grad(y_ref.sum(), ref)):
        assert_close(got, want, TOL[torch.float32]["grad"], f"{forward} -> {outside}")
