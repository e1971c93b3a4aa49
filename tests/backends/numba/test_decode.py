"""The float32 activations of the fused decode step (``kernels/cpu/activations.py``) against
float64 PyTorch: the accuracy its docstring states, NaN and infinities kept."""

import numpy as np
import pytest
import torch

from fastrwa.kernels.codes import OUTPUT_FUNCTION_CODE
from fastrwa.kernels.cpu.activations import gelu_row, output_row

X = np.concatenate([np.linspace(-30, 30, 20001), np.geomspace(1e-30, 1e-2, 300),
                    -np.geomspace(1e-30, 1e-2, 300), [0.0, 88.5, -88.5, 1e30, -1e30]])
X32 = X.astype(np.float32)
EXACT = torch.from_numpy(X32.astype(np.float64))


def _out(name: str) -> np.ndarray:
    out = np.empty_like(X32)
    output_row(OUTPUT_FUNCTION_CODE[name], X32, 0, out, 0, len(X32))
    return out


@pytest.mark.parametrize("name,exact", [("tanh", torch.tanh), ("sigmoid", torch.sigmoid),
                                        ("relu", torch.relu), ("identity", lambda x: x)])
def test_output_functions_within_a_few_ulp(name, exact):
    got = torch.from_numpy(_out(name).astype(np.float64))
    want = exact(EXACT)
    ulp = torch.from_numpy(np.spacing(np.abs(want.numpy()).astype(np.float32)).astype(np.float64))
    # (below float32's smallest normal number the results may be 0: fmath.fexp has no
    # subnormal results)
    assert ((got - want).abs() <= 4 * ulp + 1.2e-38).all(), \
        float(((got - want).abs() / ulp).max())


def test_gelu_within_3e7_of_x():
    out = X32.copy()
    gelu_row(out, 0, len(out))
    want = torch.nn.functional.gelu(EXACT)
    err = (torch.from_numpy(out.astype(np.float64)) - want).abs()
    assert (err <= 3e-7 * EXACT.abs() + 1e-37).all(), float((err / EXACT.abs()).max())


@pytest.mark.parametrize("name", ["tanh", "sigmoid", "relu", "gelu"])
def test_nan_and_infinities(name):
    x = np.array([np.nan, np.inf, -np.inf], dtype=np.float32)
    if name == "gelu":
        gelu_row(x, 0, 3)
        out = x
    else:
        out = np.empty_like(x)
        output_row(OUTPUT_FUNCTION_CODE[name], x, 0, out, 0, 3)
    assert np.isnan(out[0])
    expected = {"tanh": [1.0, -1.0], "sigmoid": [1.0, 0.0], "relu": [np.inf, 0.0]}
    if name in expected:
        assert out[1:].tolist() == expected[name]
