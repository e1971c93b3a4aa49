"""Where a prompt's prefill is cut: ``PackedLM.prefill(a)`` then ``extend(b)`` leave the
state and logits of ``prefill(a + b)`` bit for bit, at every cut (what lets the server keep
a prompt's state at any byte, :mod:`fastrwa.serve.prefix_cache`); the eager parallel
forward's sums depend on the cut (within float rounding), so it is not
:class:`~fastrwa.models.decoding.Extendable`; and a row's state is copied out of and into a
cache exactly (``read_row``/``write_row_``)."""

from __future__ import annotations

import random

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, PackedLM
from fastrwa.models.decoding import Extendable
from fastrwa.ops.decode_host import PREFILL_ROWS


def _same(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.stacked, b.stacked))


@pytest.mark.parametrize("layer,weights", [("rda", "float32"), ("rwa", "float32"),
                                           ("rda", "int8")])
def test_packed_prefill_is_split_invariant(layer, weights):
    """Many prompts (around the prefill's chunk of ``PREFILL_ROWS`` positions), each cut at
    several points, some into three pieces and some into single positions."""
    torch.manual_seed(0)
    packed = PackedLM(ByteLM(LMConfig(d_model=32, n_layers=2, layer=layer)).eval(), weights)
    assert isinstance(packed, Extendable)
    whole, parts = packed.allocate_cache(1), packed.allocate_cache(1)
    rng = random.Random(0)
    lengths = [2, 3, 9, PREFILL_ROWS - 1, PREFILL_ROWS, PREFILL_ROWS + 1, 2 * PREFILL_ROWS + 7]
    for P in lengths:
        ids = torch.randint(0, 257, (1, P))         # (BOS inside a prompt too)
        expected = packed.prefill(ids, whole).clone()
        cuts = {1, P - 1, rng.randrange(1, P), rng.randrange(1, P)} - {0, P}
        plans = [[c] for c in sorted(cuts)] + [sorted(cuts)[:2]]
        for plan in plans:
            start = 0
            for end in [*plan, P]:
                piece = ids[:, start:end]
                logits = (packed.extend(piece, parts) if start
                          else packed.prefill(piece, parts))
                start = end
            assert torch.equal(logits, expected), f"P={P} cut at {plan}"
            assert _same(parts, whole), f"P={P} cut at {plan}"


def test_extend_at_batch_rows_continues_each_row():
    """At a batch of rows (the chunk is ``PREFILL_ROWS // B`` positions) too."""
    torch.manual_seed(1)
    packed = PackedLM(ByteLM(LMConfig(d_model=32, n_layers=2)).eval())
    ids = torch.randint(0, 256, (3, 150))
    whole, parts = packed.allocate_cache(3), packed.allocate_cache(3)
    expected = packed.prefill(ids, whole).clone()
    packed.prefill(ids[:, :37], parts)
    assert torch.equal(packed.extend(ids[:, 37:], parts), expected)
    assert _same(parts, whole)


def test_extend_checks_its_arguments():
    packed = PackedLM(ByteLM(LMConfig(d_model=16, n_layers=1)).eval())
    cache = packed.allocate_cache(1)
    for bad in (torch.zeros(1, 0, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long),
                torch.tensor([[300]])):
        with pytest.raises(ValueError):
            packed.extend(bad, cache)


def test_eager_forward_is_not_extendable():
    """The eager decoder is not Extendable: its parallel forward cut in two differs from the
    whole within rounding (so the server keeps no prompt states with it)."""
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=64, n_layers=2)).eval()
    assert not isinstance(model, Extendable)
    ids = torch.randint(0, 256, (1, 40))
    with torch.no_grad():
        whole, _ = model(ids)
        head, state = model(ids[:, :17])
        tail, _ = model(ids[:, 17:], state=state)
    torch.testing.assert_close(tail[:, -1], whole[:, -1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("token_shift", [True, False])
def test_rows_are_copied_out_and_in_exactly(token_shift):
    torch.manual_seed(2)
    model = ByteLM(LMConfig(d_model=16, n_layers=2, token_shift=token_shift)).eval()
    big, one = model.allocate_cache(3), model.allocate_cache(1)
    model.prefill(torch.randint(0, 256, (3, 5)), big)
    saved = big.read_row(2)
    big.write_row_(0, saved)
    one.write_row_(0, saved)
    for buf, single in zip(big.stacked, one.stacked):
        assert torch.equal(buf[:, 0], buf[:, 2]) and torch.equal(single[:, 0], buf[:, 2])
    assert saved[0].data_ptr() != big.stacked[0][:, 2].data_ptr()       # (a copy)
    with pytest.raises(ValueError, match="row must be"):
        big.read_row(3)
    with pytest.raises(ValueError, match="saved must be"):
        big.write_row_(0, saved[:2])
