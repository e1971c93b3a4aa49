"""pytest-benchmark cases: ``pytest bench/ --benchmark-only`` (``--benchmark-disable`` runs each
once, as CI does, so they cannot rot). Timings are reported, never asserted; the ratios to
``copy_`` and to ``torch.nn.LSTM`` come from ``python bench/run.py``.
"""

import pytest
import torch

import fastrwa
from common import OPS, forward_backward_fn, forward_fn, inputs
from fastrwa.models import ByteLM, LMConfig

SHAPE = (4, 2048, 256)          # 8 MB per float32 tensor


def test_copy_baseline(benchmark):
    """copy_ of the bytes of one forward of rda_scan (z, a, g read; y written)."""
    src = torch.randn(2 * SHAPE[0] * SHAPE[1] * SHAPE[2])
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("path", ["numba", "torch"])
@pytest.mark.parametrize("op", ["rwa", "rda-exp", "rda-sigmoid"])
def test_scan_forward(benchmark, path, op):
    z, a, g = inputs(OPS[op], *SHAPE, torch.float32)
    benchmark(forward_fn(OPS[op], z, a, g, path))


@pytest.mark.parametrize("path", ["numba", "torch"])
@pytest.mark.parametrize("op", ["rwa", "rda-exp"])
def test_scan_forward_backward(benchmark, path, op):
    z, a, g = inputs(OPS[op], *SHAPE, torch.float32)
    benchmark(forward_backward_fn(OPS[op], z, a, g, path))


@pytest.mark.parametrize("layer", ["RDA", "LSTM", "GRU"])
def test_rnn_layer_forward_backward(benchmark, layer):
    torch.manual_seed(0)
    B, T, H = 8, 256, 128
    model = fastrwa.nn.RDA(H, H) if layer == "RDA" else getattr(torch.nn, layer)(
        H, H, batch_first=True)
    x = torch.randn(B, T, H)

    def step():
        out = model(x)[0]
        out.backward(torch.ones_like(out))
    benchmark(step)


def test_lm_streaming_step(benchmark):
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=256, n_layers=4)).eval()
    cache = model.allocate_cache(1)
    token = torch.tensor([65])
    with torch.no_grad():
        model.prefill(torch.randint(0, 256, (1, 16)), cache)
        logits = benchmark(model.step_, token, cache)
    assert logits.shape == (1, 257) and torch.isfinite(logits).all()
