"""The Triton backend compiled on a CUDA GPU, at its production launch (default blocks, the
"auto" algorithm and both forced ones), at shapes that cross many chunks and leave partial
channel blocks: too slow for the interpreter, so these run only under ``pytest --cuda``
(CI, with no GPU, deselects them). The op suite's "triton-*" columns cover the rest on CUDA.
"""

import pytest
import torch

import fastrwa
from fastrwa.ops import triton_host
from fastrwa.ops.dispatch import resolve as resolve_name
from fastrwa.testing import backend_options
from helpers import (ATTENTIONS, TOL, assert_close, compare_gradients, make_inputs,
                     make_state, reference, run)

pytestmark = pytest.mark.cuda

B, T, D = 3, 200, 70      # T: 6 chunks of 32 and a partial one; D: partial blocks of 32 and 16


@pytest.fixture(autouse=True)
def on_cuda():
    with torch.device("cuda"):
        yield


def test_auto_runs_cuda_tensors_on_triton():
    assert resolve_name(torch.device("cuda"), torch.float32) == "triton"
    assert resolve_name(torch.device("cuda"), torch.bfloat16) == "triton"
    assert resolve_name(torch.device("cuda"), torch.float64) == "torch"


@pytest.mark.parametrize("algorithm", ["auto", "looped", "segments"])
@pytest.mark.parametrize("attention", ("rwa",) + ATTENTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reverse", [False, True])
def test_default_blocks_forward_and_gradients(algorithm, attention, dtype, reverse):
    z, a, g = make_inputs(B, T, D, dtype=dtype, attention=attention, seed=3)
    if attention == "rwa":
        attention, g = "exp", None
    state = make_state(B, D, dtype=torch.float32)
    with backend_options("triton", algorithm=algorithm):
        y, final = run(z, a, g, attention, state, final=True, reverse=reverse)
        y_ref, final_ref = reference(z, a, g, attention, state, reverse)
        assert y.device.type == "cuda" and y.dtype == dtype
        assert_close(y, y_ref, TOL[dtype]["y"], "y")
        assert_close(final.average(), final_ref.average(), TOL[dtype]["y"], "final average")
        compare_gradients(z, a, g, attention, state, reverse, None, dtype)


@pytest.mark.parametrize("algorithm", ["looped", "segments"])
def test_one_long_sequence(algorithm):
    """B=1, T=20,000: one program per channel block walks 625 chunks (looped) or the chunks
    run in parallel (segments); both equal the float64 PyTorch backend."""
    z, a, g = make_inputs(1, 20_000, 64, dtype=torch.float32, seed=5)
    with backend_options("triton", algorithm=algorithm):
        y, _ = fastrwa.rda_scan(z, a, g, "softplus")
    with fastrwa.use_backend("torch"):
        y_ref, _ = fastrwa.rda_scan(z.double(), a.double(), g.double(), "softplus")
    assert_close(y, y_ref, TOL[torch.float32]["y"], "y")


def test_float16_and_minus_inf_masks_at_default_blocks():
    z, a, g = make_inputs(2, 100, 40, dtype=torch.float32, seed=7)
    a[:, 10:50] = float("-inf")
    y, _ = fastrwa.rda_scan(z.half(), a.half(), g.half(), "exp")
    y_ref, _ = reference(z.half(), a.half(), g.half(), "exp")
    assert_close(y, y_ref, TOL[torch.float16]["y"], "y")


def test_nan_in_gives_nan_out():
    z, a, g = make_inputs(2, 70, 40, dtype=torch.float32, seed=9)
    z[1, 5, 3] = float("nan")
    y, _ = fastrwa.rda_scan(z, a, g)
    assert torch.isnan(y[1, 5:, 3]).all() and torch.isfinite(y[0]).all()


def test_prepared_step_replays_in_a_cuda_graph():
    """The in-place step kernel captured once in a CUDA graph, replayed per token, equals a scan."""
    n, width = 12, 50
    z, a, g = make_inputs(4, n, width, dtype=torch.float32, seed=11)
    y_full, _ = fastrwa.rda_scan(z, a, g, "sigmoid")
    state = fastrwa.ScanState.empty(4, width, dtype=torch.float32, device="cuda")
    z_t, a_t, g_t, out = (torch.empty(4, width) for _ in range(4))
    empty = [s.clone() for s in state]
    restart = lambda: [s.copy_(e) for s, e in zip(state, empty)]   # noqa: E731
    step = lambda: fastrwa.rda_step_(z_t, a_t, g_t, state, out, "sigmoid")   # noqa: E731
    for x in (z_t, a_t, g_t):
        x.normal_()
    with torch.no_grad():
        step()                                        # compile before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    restart()
    for t in range(n):
        z_t.copy_(z[:, t]), a_t.copy_(a[:, t]), g_t.copy_(g[:, t])
        graph.replay()
        assert_close(out, y_full[:, t].double(), TOL[torch.float32]["y"], f"y at {t}")


def test_default_blocks_are_what_the_launcher_uses():
    """The tests above run the launcher's defaults, not the op suite's small blocks."""
    assert triton_host.options().block_t >= 16 and triton_host.options().block_d >= 16


def test_byte_lm_step_replays_in_a_cuda_graph():
    """ByteLM.step_(check=False) captured once, replayed per token, equals the eager step."""
    from fastrwa.models import ByteLM, LMConfig
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=64, n_layers=2)).cuda().eval()
    tokens = torch.randint(0, 256, (3, 10))
    eager, graphed = model.allocate_cache(3), model.allocate_cache(3)
    token = torch.empty(3, dtype=torch.int64)
    with torch.no_grad():
        token.copy_(tokens[:, 0])
        model.step_(token, graphed, check=False)              # warm-up (compiles), then reset
        graphed.load_(eager.state)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = model.step_(token, graphed, check=False)
        graphed.load_(eager.state)
        for t in range(10):
            want = model.step_(tokens[:, t], eager).clone()
            token.copy_(tokens[:, t])
            graph.replay()
            assert torch.allclose(logits, want, atol=1e-5, rtol=1e-5), t


@pytest.mark.parametrize("batch", [1, 3])
def test_generate_replays_a_cuda_graph_by_default(batch):
    """On CUDA, generate()/stream() with the default weights run CUDAGraphDecoder: the same
    greedy tokens as the eager step (so its warm-up steps leave the state as the prefill
    left it), and sampling runs."""
    from fastrwa.models import ByteLM, LMConfig
    from fastrwa.models.graphed import CUDAGraphDecoder
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=64, n_layers=2)).cuda().eval()
    assert isinstance(model.decoder("auto"), CUDAGraphDecoder)
    prompt = torch.randint(0, 256, (batch, 7))
    runs = {weights: model.generate(prompt, 24, top_k=1, weights=weights)
            for weights in ("eager", "auto", "graph")}
    assert torch.equal(runs["auto"], runs["eager"]) and torch.equal(runs["graph"], runs["eager"])
    gen = torch.Generator(device="cuda").manual_seed(1)
    sampled = model.generate(prompt, 24, temperature=0.8, top_p=0.9, generator=gen)
    assert sampled.shape == (batch, 31) and bool((sampled[:, 7:] < 256).all())
    streamed = torch.stack(list(model.stream(prompt, 10, top_k=1)), 1)
    assert torch.equal(streamed, model.generate(prompt, 10, top_k=1, weights="eager")[:, 7:])
