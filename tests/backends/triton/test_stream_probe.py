"""bench/stream_probe.py, the cost model's bandwidth probe, under the interpreter: it reads
every element of each segment once (its sums against torch's), in the looped layout (one
segment a sequence) and the segments layout, with a ragged last chunk, a ragged last
segment and a ragged channel block."""

import pytest
import torch

from bench.stream_probe import BT, read


def _sums(z, a, g, cps):
    """Each (sequence, segment)'s per-channel sum of ``z + a + g``, from torch."""
    B, T, D = z.shape
    steps = cps * BT
    x = (z.float() + a.float() + g.float())
    rows = [x[i, s:s + steps].sum(0) for i in range(B) for s in range(0, max(T, 1), steps)]
    return torch.stack(rows)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cps", [1, 2, 4])
def test_the_probe_reads_each_segment_whole(dtype, cps):
    gen = torch.Generator().manual_seed(3)
    z, a, g = (torch.randn(2, 61, 40, generator=gen).to(dtype) for _ in range(3))
    got = read(z, a, g, cps)       # (61 steps: 4 chunks, the last of 13; 40 channels: 2 blocks)
    want = _sums(z, a, g, cps)
    assert got.shape == want.shape == (2 * -(-4 // cps), 40)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_bad_arguments_are_named():
    x = torch.zeros(1, 4, 2)
    with pytest.raises(ValueError, match="cps must be at least 1"):
        read(x, x, x, 0)
    with pytest.raises(ValueError, match="z, a, g must be"):
        read(x, x, x[:, :3], 1)
