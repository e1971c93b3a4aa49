"""A draw with settings per row (the server's streams, issue 61 item 4): every decoder's
``draw`` given one ``Sampling`` per row draws each row as it would alone (a ``(1, V)`` row a
call), from its own generator, in row order: the same ids and the same generator states
after; a skipped row (``None``) or one nothing can be drawn from is -1. The fused sampler's
top-k keeps exactly the k largest logits."""

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, PackedLM
from fastrwa.models.decoding import Sampling, draw_each

V, FORBIDDEN = 257, 256


def settings(i: int) -> Sampling:
    """Row ``i``'s settings: temperatures (a tiny one too), top-k and top-p mixed."""
    return Sampling(temperature=[1.0, 0.7, 1e-38, 2.0][i % 4],
                    top_k=[None, 1, 5, 300][i // 4 % 4], top_p=[None, 0.9, 0.3][i % 3],
                    generator=torch.Generator().manual_seed(i))


def crowd_logits(B: int) -> torch.Tensor:
    torch.manual_seed(0)
    logits = torch.randn(B, V) * 3
    logits[5, 7] = float("nan")                      # (nothing can be drawn from these)
    logits[9, :] = float("-inf")
    logits[11, 3] = float("inf")
    logits[13, :FORBIDDEN] = float("-inf")
    return logits


def alone(decoder, logits: torch.Tensor, samplings: list) -> list:
    """Each row drawn by itself, a call a row (-1: skipped or refused)."""
    ids = []
    for row, sampling in enumerate(samplings):
        if sampling is None:
            ids.append(-1)
            continue
        try:
            ids.append(int(decoder.draw(logits[row:row + 1], sampling, FORBIDDEN)))
        except ValueError:
            ids.append(-1)
    return ids


def decoders():
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    return {"fused": PackedLM(model), "eager": model.decoder("eager")}


@pytest.mark.parametrize("kind", ["fused", "eager"])
@pytest.mark.parametrize("B", [1, 7, 48])
def test_a_draw_per_row_is_each_rows_draw_alone(kind, B):
    decoder = decoders()[kind]
    logits = crowd_logits(max(B, 14))[:B].contiguous()
    mine, theirs = [settings(i) for i in range(B)], [settings(i) for i in range(B)]
    for row in range(2, B, 6):
        mine[row] = theirs[row] = None
    expected = alone(decoder, logits, theirs)
    got = decoder.draw(logits, mine, FORBIDDEN)
    assert got.dtype == torch.int64 and got.shape == (B,) and got.device.type == "cpu"
    assert got.tolist() == expected
    for a, b in zip(mine, theirs):          # (each generator advanced as alone: one draw)
        if a is not None:
            assert torch.equal(a.generator.get_state(), b.generator.get_state())


def test_a_draw_per_row_through_draw_each_calls_the_decoders_own_draw():
    decoder = decoders()["eager"]
    logits = crowd_logits(14)
    samplings = [settings(i) for i in range(14)]
    seen = []

    def draw(rows, sampling, forbidden):
        seen.append(rows.shape)
        return decoder.draw(rows, sampling, forbidden)
    assert draw_each(draw, logits, samplings, FORBIDDEN).tolist() == \
        alone(decoder, logits, [settings(i) for i in range(14)])
    assert seen == [(1, V)] * 14


@pytest.mark.parametrize("top_k", [1, 2, 5, 40, 255])
def test_the_fused_top_k_keeps_the_k_largest_logits(top_k):
    """At a temperature so high every kept id weighs about the same, 400 draws reach every
    one of the k largest logits below ``forbidden`` and nothing else."""
    torch.manual_seed(1)
    logits = torch.randn(1, V)
    logits[0, FORBIDDEN:] = 100.0                       # (never drawn)
    largest = set(logits[0, :FORBIDDEN].topk(top_k).indices.tolist())
    decoder = decoders()["fused"]
    rows = [Sampling(1e30, top_k, None, torch.Generator().manual_seed(i)) for i in range(400)]
    drawn = decoder.draw(logits.expand(400, V).contiguous(), rows, FORBIDDEN).tolist()
    assert set(drawn) == largest if top_k <= 40 else set(drawn) <= largest
