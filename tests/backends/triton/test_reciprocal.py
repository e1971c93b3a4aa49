"""``reciprocal`` (kernels/triton/common.py), the division the Triton kernels use: with its
Newton step (float32 inputs) within 1 ulp of ``1 / x`` and exact at powers of two, without
it (bfloat16, float16) within 4e-7 relative, over the denominators the kernels pass.

Under the interpreter ``rsqrt`` is numpy's; compiled on a card (``pytest --cuda``) it is
``rsqrt.approx.ftz`` (``MUFU.RSQ``), whose error is what the bounds are about."""

import pytest
import torch
import triton
import triton.language as tl

from fastrwa.kernels.triton.common import reciprocal

X_BLOCK = 1024     # elements a program


@triton.jit
def _reciprocal_kernel(x_ptr, y_ptr, N, NEWTON: tl.constexpr, BLOCK: tl.constexpr):
    o_x = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)                     # [BLOCK]
    mask_x = o_x < N                                                          # [BLOCK]
    b_x = tl.load(x_ptr + o_x, mask=mask_x, other=1.0)                        # [BLOCK]
    tl.store(y_ptr + o_x, reciprocal(b_x, NEWTON), mask=mask_x)


def _denominators(device: str) -> torch.Tensor:
    """float32 ``d~`` in ``[1, 2**20]`` (log-uniform: up to a million steps of weight 1),
    ``1 + e`` and ``2 + e`` (``e`` in ``[0, 1]``: sigmoid and ``log1p``), and powers of two."""
    gen = torch.Generator().manual_seed(11)

    def u(n: int) -> torch.Tensor:
        return torch.rand(n, generator=gen, dtype=torch.float64)

    x = torch.cat([torch.exp2(20 * u(60_000)), 1 + u(20_000), 2 + u(20_000),
                   torch.exp2(torch.arange(0, 21, dtype=torch.float64))])
    return x.float().to(device)


def _reciprocals(x: torch.Tensor, newton: bool) -> torch.Tensor:
    y = torch.empty_like(x)
    _reciprocal_kernel[(triton.cdiv(x.numel(), X_BLOCK),)](x, y, x.numel(), NEWTON=newton,
                                                            BLOCK=X_BLOCK)
    return y.double().cpu()


def _check(device: str) -> None:
    x = _denominators(device)
    exact = 1 / x.double().cpu()
    ulp = torch.exp2(torch.floor(torch.log2(exact)) - 23)      # float32's spacing at 1 / x
    newton = _reciprocals(x, True)
    assert ((newton - exact).abs() <= ulp).all(), (newton - exact).abs().div(ulp).max()
    powers = exact == torch.exp2(torch.round(torch.log2(exact)))
    assert torch.equal(newton[powers], exact[powers])
    plain = _reciprocals(x, False)
    assert ((plain - exact).abs() / exact).max() <= 4e-7


@pytest.mark.interpreter
def test_reciprocal_within_its_bounds():
    _check("cpu")


@pytest.mark.cuda
def test_reciprocal_within_its_bounds_on_the_card():
    _check("cuda")
