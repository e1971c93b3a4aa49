"""Bad input raises TypeError/ValueError whose message names the argument and what was expected."""

import pytest
import torch

import fastrwa

B, T, D = 2, 5, 3


def ok(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def state(dtype=torch.float32, b=B, d=D, device="cpu"):
    return fastrwa.ScanState.empty(b, d, dtype=dtype, device=device)


CASES = [
    # (callable, exception, words the message must contain)
    (lambda: fastrwa.rwa_scan([[1.0]], ok(B, T, D)), TypeError, ["z", "torch.Tensor", "list"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), 3.0), TypeError, ["a", "torch.Tensor", "float"]),
    (lambda: fastrwa.rwa_scan(ok(T, D), ok(T, D)), ValueError, ["z", "(B, T, D)", "(5, 3)"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T + 1, D)), ValueError,
     ["a", "same shape", "(2, 5, 3)", "(2, 6, 3)"]),
    (lambda: fastrwa.rda_scan(ok(B, T, D), ok(B, T, D), ok(B, T, 4)), ValueError,
     ["g", "same shape", "(2, 5, 4)"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D, dtype=torch.float64)), TypeError,
     ["a", "dtype", "torch.float32", "torch.float64"]),
    (lambda: fastrwa.rwa_scan(torch.ones(B, T, D, dtype=torch.int64), ok(B, T, D)), TypeError,
     ["z", "floating", "torch.int64"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D, device="meta")), ValueError,
     ["a", "device", "cpu", "meta"]),
    (lambda: fastrwa.rda_scan(ok(B, T, D), ok(B, T, D), ok(B, T, D), attention="tanh"),
     ValueError, ["attention", "tanh", "exp", "sigmoid", "softplus", "relu"]),
    (lambda: fastrwa.rda_scan(ok(B, T, D), ok(B, T, D), ok(B, T, D), attention=None),
     ValueError, ["attention", "None"]),
    (lambda: fastrwa.weighted_scan(ok(B, T, D), ok(B, T, D), ok(B, 1, D)), ValueError,
     ["log_decay", "same shape"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), initial_state="x"), TypeError,
     ["initial_state", "ScanState", "str"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), initial_state=(ok(B, D), ok(B, D))),
     TypeError, ["initial_state", "ScanState"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), initial_state=state(b=3)), ValueError,
     ["initial_state.m", "(2, 3)", "(3, 3)"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), initial_state=state(torch.float64)),
     TypeError, ["initial_state.m", "torch.float32", "torch.float64"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D, dtype=torch.bfloat16), ok(B, T, D, dtype=torch.bfloat16),
                              initial_state=state(torch.bfloat16)),
     TypeError, ["initial_state.m", "torch.float32", "bfloat16"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), initial_state=state(device="meta")),
     ValueError, ["initial_state.m", "device", "meta"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D),
                              initial_state=fastrwa.ScanState(ok(B, D), [0.0], ok(B, D))),
     TypeError, ["initial_state.n", "torch.Tensor", "list"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), output_final_state=1), TypeError,
     ["output_final_state", "bool", "int"]),
    (lambda: fastrwa.rwa_step(ok(B, T, D), ok(B, T, D)), ValueError, ["z_t", "(B, D)", "(2, 5, 3)"]),
    (lambda: fastrwa.rda_step(ok(B, D), ok(B, D), ok(B, D + 1)), ValueError,
     ["g_t", "same shape", "(2, 4)"]),
    (lambda: fastrwa.rda_step(ok(B, D), ok(B, D), ok(B, D), attention="max"), ValueError,
     ["attention", "max"]),
    (lambda: fastrwa.rwa_step(ok(B, D), ok(B, D), state=state(d=4)), ValueError,
     ["state.m", "(2, 3)", "(2, 4)"]),
    (lambda: fastrwa.rwa_step(ok(B, D), ok(B, D), state=(1, 2, 3)), TypeError,
     ["state.m", "torch.Tensor", "int"]),
    (lambda: fastrwa.rwa_scan(ok(1, T, D), ok(1, T, D), cu_seqlens=[0, 5]), TypeError,
     ["cu_seqlens", "torch.Tensor", "list"]),
    (lambda: fastrwa.rwa_scan(ok(1, T, D), ok(1, T, D), cu_seqlens=torch.tensor([0.0, 5.0])),
     TypeError, ["cu_seqlens", "int64", "float32"]),
    (lambda: fastrwa.rwa_scan(ok(1, T, D), ok(1, T, D), cu_seqlens=torch.tensor([5])),
     ValueError, ["cu_seqlens", "(N + 1,)", "(1,)"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), cu_seqlens=torch.tensor([0, 5])),
     ValueError, ["cu_seqlens", "B = 1", "(2, 5, 3)"]),
    (lambda: fastrwa.rwa_scan(ok(1, T, D), ok(1, T, D), cu_seqlens=torch.tensor([0, 3, 2, 5])),
     ValueError, ["cu_seqlens", "never decrease", "T = 5", "[0, 3, 2, 5]"]),
    (lambda: fastrwa.rwa_scan(ok(1, T, D), ok(1, T, D), cu_seqlens=torch.tensor([0, 4])),
     ValueError, ["cu_seqlens", "end at T = 5"]),
    (lambda: fastrwa.rwa_scan(ok(1, T, D), ok(1, T, D), cu_seqlens=torch.tensor([0, 2, 5]),
                              initial_state=state(b=1)),
     ValueError, ["initial_state.m", "(2, 3)", "(1, 3)"]),
    (lambda: fastrwa.rwa_scan(ok(B, T, D), ok(B, T, D), reverse="yes"), TypeError,
     ["reverse", "bool", "str"]),
]


@pytest.mark.parametrize("call,exc,words", CASES)
def test_bad_input_message(call, exc, words):
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} missing from: {message}"
