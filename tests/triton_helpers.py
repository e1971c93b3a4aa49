"""What the Triton variant tests share (tests/backends/triton/): small blocks that give a
sequence several chunks and segments, inputs, and two checks of a launch knob's variant: the
defaults' bits, and the float64 reference."""

import fastrwa
import torch
from fastrwa.state import ScanState
from fastrwa.testing import backend_options
from helpers import assert_close, leaf, loss_and_grads, make_inputs, make_state, reference

# (the backward's channel block unlike the forward's: the op tests' blocks are alike)
SMALL = dict(block_t=4, block_d=4, block_d_backward=2, segment_chunks=2)


def inputs(packed: bool, T: int, lengths: list, D: int, device: str, seed: int):
    """``z, a, g``, an initial state and ``cu_seqlens`` (``None`` unless ``packed``): 2
    sequences of ``T`` steps, or the ``lengths`` packed one after another."""
    T = sum(lengths) if packed else T
    z, a, g = (x.to(device) for x in make_inputs(1 if packed else 2, T, D,
                                                 dtype=torch.float32, seed=seed))
    h0 = [x.float().to(device) for x in make_state(len(lengths) if packed else 2, D)]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(device) if packed else None
    return z, a, g, h0, cu


def scan(leaves: list, reverse: bool, cu):
    """``rda_scan`` (exp attention) of ``leaves`` = ``z, a, g, m0, n0, d0``, with its final
    state: what the variant tests run and differentiate (one forward: the gradients are taken
    through its graph)."""
    return fastrwa.rda_scan(*leaves[:3], "exp", initial_state=ScanState(*leaves[3:]),
                            output_final_state=True, reverse=reverse, cu_seqlens=cu)


def same_bits_as_default(knob: dict, algorithm: str, reverse: bool, packed: bool,
                          device: str, blocks: dict, T: int, lengths: list, D: int = 5):
    """A knob's variant (``algorithm`` among its knobs: another algorithm) against the
    launcher's defaults on the same inputs: ``y``, the final
    state and the gradients of the inputs and of an initial state, bit for bit (``blocks``:
    the other knobs, each thread owning its channel columns; ``T``: the steps, or with
    ``packed`` the sequences' ``lengths`` one after another), and the variant's ``y``
    against the float64 reference."""
    z, a, g, h0, cu = inputs(packed, T, lengths, D, device, seed=21)
    got = []
    for knobs in ({}, knob):
        leaves = [leaf(x) for x in (z, a, g, *h0)]
        with fastrwa.use_backend("triton"), backend_options(
                "triton", **{"algorithm": algorithm, **blocks, **knobs}):
            y, final = out = scan(leaves, reverse, cu)
            got.append((y, final.m, final.n, final.d, *loss_and_grads(lambda: out, leaves)))
    for default, variant in zip(*got):
        assert torch.equal(default, variant), knob
    y_ref, _ = reference(z.cpu(), a.cpu(), g.cpu(), "exp", ScanState(*(x.cpu() for x in h0)),
                         reverse=reverse, cu_seqlens=None if cu is None else cu.cpu())
    assert_close(got[1][0].cpu(), y_ref, 1e-5, f"{knob} vs the reference")


def agrees_with_the_reference(leaves: list, reverse: bool, cu, knobs: dict) -> None:
    """:func:`scan` of ``leaves`` (``z, a, g, m0, n0, d0``) on the Triton backend at
    ``knobs`` against the float64 reference: ``y``, the final state's gauge-free parts (its
    log-total and its average) and the gradients of every leaf."""
    with fastrwa.use_backend("triton"), backend_options("triton", **knobs):
        y, final = out = scan(leaves, reverse, cu)
        grads = loss_and_grads(lambda: out, leaves)
    cpu = [leaf(x.detach().cpu()) for x in leaves]
    ref_out = reference(*cpu[:3], "exp", ScanState(*cpu[3:]), reverse=reverse,
                        cu_seqlens=None if cu is None else cu.cpu())
    y_ref, final_ref = ref_out
    assert_close(y.cpu(), y_ref, 1e-5, "y")
    assert_close((final.m + final.d.log()).cpu(), final_ref.m + final_ref.d.log(), 1e-5,
                 "log-total")
    assert_close((final.n / final.d).cpu(), final_ref.n / final_ref.d, 1e-5, "average")
    for name, got_x, want_x in zip("z a g m0 n0 d0".split(), grads,
                                    loss_and_grads(lambda: ref_out, cpu)):
        assert_close(got_x.cpu(), want_x, 1e-4, f"gradient of {name}")
