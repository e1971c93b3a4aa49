"""torch.compile sees the scan as one custom op: full graphs, no graph break, same numbers;
inside a compiled graph the op still refuses bad packed offsets (``cu_seqlens``)."""

import subprocess
import sys
import textwrap

import pytest
import torch

import fastrwa


def _loss(z, a, g):
    y, state = fastrwa.rda_scan(z, a, g, attention="sigmoid", output_final_state=True)
    return (y * y).mean() + state.average().mean()


def _grads(loss_fn, inputs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    loss_fn(*leaves).backward()
    return [x.grad for x in leaves]


def test_op_compiles_fullgraph_forward_and_backward():
    torch.manual_seed(0)
    inputs = [torch.randn(2, 33, 8, requires_grad=True) for _ in range(3)]
    explained = torch._dynamo.explain(_loss)(*inputs)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(_loss, fullgraph=True)
    for c, e in zip(_grads(compiled, inputs), _grads(_loss, inputs)):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


def test_step_compiles_fullgraph():
    torch.manual_seed(1)
    z, a = torch.randn(3, 6), torch.randn(3, 6)
    _, state = fastrwa.rwa_scan(torch.randn(3, 5, 6), torch.randn(3, 5, 6),
                                output_final_state=True)
    assert torch._dynamo.explain(fastrwa.rwa_step)(z, a, state).graph_break_count == 0
    y_c, st_c = torch.compile(fastrwa.rwa_step, fullgraph=True)(z, a, state)
    y_e, st_e = fastrwa.rwa_step(z, a, state)
    torch.testing.assert_close(y_c, y_e)
    torch.testing.assert_close(st_c.average(), st_e.average())


def _tiny_lm():
    from fastrwa.models import ByteLM, LMConfig

    torch.manual_seed(0)
    return ByteLM(LMConfig(d_model=16, n_layers=2, mlp_ratio=2))


def test_language_model_training_step_compiles_without_graph_breaks():
    model = _tiny_lm()
    data = torch.randint(0, 256, (2, 17))

    def loss_fn(tokens):
        logits, _ = model(tokens[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 tokens[:, 1:].reshape(-1))

    explained = torch._dynamo.explain(loss_fn)(data)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(loss_fn, fullgraph=True)
    loss_c = compiled(data)
    loss_c.backward()
    grads_c = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss_e = loss_fn(data)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-5, atol=1e-6)
    for gc, p in zip(grads_c, model.parameters()):
        torch.testing.assert_close(gc, p.grad, rtol=1e-4, atol=1e-6)


def test_language_model_generate_step_compiles_without_graph_breaks():
    model = _tiny_lm().eval()
    prompt = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        _, state = model(prompt)
        token = torch.tensor([3, 4])
        explained = torch._dynamo.explain(model.step)(token, state)
        assert explained.graph_break_count == 0, explained.break_reasons
        step = torch.compile(model.step, fullgraph=True)
        logits_c, _ = step(token, state)
        logits_e, _ = model.step(token, state)
    torch.testing.assert_close(logits_c, logits_e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("save", [False, True])
def test_opcheck_on_every_backend(backend, save):
    """torch.library.opcheck (schema, fake tensor, autograd registration, AOT dispatch) on
    the custom op, saving for the backward or not (a backward must then recompute)."""
    from fastrwa.ops.autograd import scan_op

    z, a, g = (torch.randn(1, 6, 3, dtype=backend.dtype, requires_grad=True) for _ in range(3))
    torch.library.opcheck(scan_op, (z, a, g, None, None, None, None, "sigmoid", "sigmoid",
                                    False, save, backend.name))


def test_double_backward_and_torch_func_are_clear_errors():
    """Not supported, and said so (docs/api.md), instead of PyTorch's internal messages."""
    z = torch.randn(1, 5, 3, dtype=torch.float64, requires_grad=True)
    y, _ = fastrwa.rwa_scan(z, z)
    (gz,) = torch.autograd.grad(y.sum(), z, create_graph=True)
    with pytest.raises(RuntimeError, match="no second derivative"):
        gz.sum().backward()
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.grad(lambda x: fastrwa.rwa_scan(x, x)[0].sum())(z.detach())
    with pytest.raises(RuntimeError, match="torch.func transforms"):
        torch.func.vmap(lambda x: fastrwa.rwa_scan(x[None], x[None])[0])(torch.randn(4, 5, 3))


def test_packed_sequences_compile_fullgraph():
    z, a = torch.randn(1, 9, 3, requires_grad=True), torch.randn(1, 9, 3)
    cu = torch.tensor([0, 4, 9])

    def loss(z, a, cu):
        y, state = fastrwa.rwa_scan(z, a, cu_seqlens=cu, output_final_state=True)
        return y.sum() + state.n.sum()

    explained = torch._dynamo.explain(loss)(z, a, cu)
    assert explained.graph_break_count == 0, explained.break_reasons
    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(z, a, cu), z)[0]
    want = torch.autograd.grad(loss(z, a, cu), z)[0]
    torch.testing.assert_close(got, want)


def test_in_place_step_compiles_fullgraph_and_matches_eager():
    """rda_step_ is one op node in a compiled graph (it writes its state and out in place)."""
    torch.manual_seed(2)
    z, a, g = torch.randn(3, 2, 5)
    states = [fastrwa.ScanState.empty(2, 5) for _ in range(2)]
    outs = [torch.empty(2, 5) for _ in range(2)]

    def step(z, a, g, state, out):
        return fastrwa.rda_step_(z, a, g, state, out, attention="softplus")

    with torch.no_grad():
        explained = torch._dynamo.explain(step)(z, a, g, states[0], outs[0])
        assert explained.graph_break_count == 0, explained.break_reasons
        states = [fastrwa.ScanState.empty(2, 5) for _ in range(2)]
        compiled = torch.compile(step, fullgraph=True)
        for t in range(3):
            compiled(z + t, a - t, g, states[0], outs[0])
            step(z + t, a - t, g, states[1], outs[1])
            torch.testing.assert_close(outs[0], outs[1])
            for mine, theirs in zip(states[0], states[1]):
                torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("token_shift", [True, False])
def test_language_model_in_place_decode_compiles_fullgraph(token_shift):
    """ByteLM.step_ with check=False (what a CUDA-graph decode loop captures) compiles
    without a graph break and gives the eager logits, step after step, from the same cache
    contents."""
    from fastrwa.models import ByteLM, LMConfig

    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=2, mlp_ratio=2, token_shift=token_shift)).eval()
    caches = [model.allocate_cache(2), model.allocate_cache(2)]
    with torch.no_grad():
        explained = torch._dynamo.explain(model.step_)(torch.tensor([1, 2]), caches[0],
                                                       check=False)
        assert explained.graph_break_count == 0, explained.break_reasons
    caches = [model.allocate_cache(2), model.allocate_cache(2)]
    compiled = torch.compile(model.step_, fullgraph=True)
    for t in range(4):
        token = torch.tensor([t, 3 * t + 1])
        got = compiled(token, caches[0], check=False).clone()
        want = model.step_(token, caches[1]).clone()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_compiled_decode_step_refuses_an_id_out_of_range():
    """Compiled with its range check (check=True, the default), ByteLM.step_ refuses id 300
    as the eager step does (the check runs eagerly, a graph break), instead of inductor's
    raw index error, and leaves the cache as it was."""
    from fastrwa.models import ByteLM, LMConfig

    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    cache = model.allocate_cache(2)
    before = [t.clone() for t in cache.stacked]
    compiled = torch.compile(model.step_)
    with torch.no_grad():
        compiled(torch.tensor([1, 2]), cache)
        before = [t.clone() for t in cache.stacked]
        with pytest.raises(ValueError, match=r"token must be ids in \[0, 257\), got values in "
                                             r"\[2, 300\]"):
            compiled(torch.tensor([2, 300]), cache)
    for t, b in zip(cache.stacked, before):
        torch.testing.assert_close(t, b, rtol=0, atol=0)


def test_opcheck_in_place_step_op(backend):
    from fastrwa.ops.autograd import step_op

    z, a, g = torch.randn(3, 2, 4, dtype=backend.dtype)
    state = fastrwa.ScanState.empty(2, 4, dtype=torch.float64 if backend.exact else torch.float32)
    torch.library.opcheck(step_op, (z, a, g, *state, torch.empty(2, 4, dtype=backend.dtype),
                                    "sigmoid", "sigmoid", backend.name))


def test_use_backend_holds_in_a_compiled_graph(monkeypatch):
    """A function compiled inside use_backend("torch") runs that backend's forward and
    backward and gives the eager numbers; run again under "numba", it runs numba's forward
    and backward (the graph is traced again), and back under "torch", torch's."""
    from fastrwa.ops import dispatch

    calls = []
    for backend in ("torch", "numba"):
        module = dispatch.load(backend)
        for fn in ("forward", "backward"):
            original = getattr(module, fn)
            monkeypatch.setattr(module, fn, lambda *a, _o=original, _n=(backend, fn), **k:
                                calls.append(_n) or _o(*a, **k))
    torch._dynamo.reset()
    inputs = [torch.randn(2, 9, 4, requires_grad=True) for _ in range(3)]
    function = torch.compile(_loss, fullgraph=True)
    with fastrwa.use_backend("torch"):
        compiled = _grads(function, inputs)
        assert calls == [("torch", "forward"), ("torch", "backward")], calls
        eager = _grads(_loss, inputs)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)
    calls.clear()
    with fastrwa.use_backend("numba"):
        compiled = _grads(function, inputs)
    with fastrwa.use_backend("torch"):
        _grads(function, inputs)
    assert [b for b, _ in calls] == ["numba", "numba", "torch", "torch"], calls
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-6)


_COMPILED_BAD_OFFSETS = textwrap.dedent("""
    import sys, torch, fastrwa
    backend = sys.argv[1]
    @torch.compile(backend="eager", fullgraph=True)
    def f(z, a, cu):
        return fastrwa.rwa_scan(z, a, cu_seqlens=cu)[0]
    z, a = torch.randn(1, 6, 3), torch.randn(1, 6, 3)
    with fastrwa.use_backend(backend):
        print(f(z, a, torch.tensor([0, 2, 6])).shape)   # good offsets compile and run
        for bad in ([0, 9, 6], [0, 4, 2, 6], [0, 2, 7], [-3, 2, 6], [0, 2, 5]):
            try:
                f(z, a, torch.tensor(bad))
            except Exception as error:
                assert "cu_seqlens must start at 0, never decrease and end at T = 6" in \\
                    str(error), error
            else:
                raise SystemExit(f"offsets {bad} were accepted")
    print("refused")
""")


@pytest.mark.parametrize("name", ["numba", "torch"])
def test_bad_offsets_are_refused_inside_a_compiled_graph(name):
    """A compiled graph skips the public checks, so the op checks packed offsets itself:
    offsets past T or decreasing are refused, never read out of bounds (they crashed the
    process or returned uninitialised memory). In a child process, as the old failure was
    a crash."""
    done = subprocess.run([sys.executable, "-c", _COMPILED_BAD_OFFSETS, name],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("refused")
