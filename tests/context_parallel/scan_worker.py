"""One rank of tests/context_parallel/test_scan_and_layers.py: ``python scan_worker.py RANK
WORLD STORE LENGTHS [triton]`` (``LENGTHS`` comma-separated, one slice length per rank).

Every rank builds the same float64 inputs for the whole sequence, computes the single-process
scan and its gradients (the reference), then its own slice with ``context_group`` over gloo,
and checks its outputs and its gradients against the reference's slice, for RWA and the four
RDA attentions, with and without an initial state, both directions, on the numba and torch
backends, and for extreme logits and ``-inf`` masks that span a rank boundary; then float32
within 2e-5 on numba and torch, and on Triton's interpreter (reversed) with ``triton``. Prints
``OK`` and exits 0, or raises (exit 1) naming the case.
"""

import os
import sys

import torch
import torch.distributed as dist

import fastrwa

rank, world, store, lengths = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
lengths = [int(n) for n in lengths.split(",")]
dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
group = dist.group.WORLD
lo, hi = sum(lengths[:rank]), sum(lengths[:rank + 1])
T, B, D = sum(lengths), 2, 3
TOL = 1e-12


def scan(kind, z, a, g, state, reverse, context_group=None):
    if kind == "rwa":
        return fastrwa.rwa_scan(z, a, state, output_final_state=True, reverse=reverse,
                                context_group=context_group)
    return fastrwa.rda_scan(z, a, g, kind, state, output_final_state=True, reverse=reverse,
                            context_group=context_group)


def average(state):
    """What a state represents, n / d (0 for an empty state, d = 0)."""
    return state.n / state.d.clamp(min=torch.finfo(state.d.dtype).tiny)


def check(name, got, want, tol=TOL):
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    err = float((got - want).abs().max()) if want.numel() else 0.0
    if not err <= tol * scale:
        raise AssertionError(f"rank {rank}: {name}: max error {err:.3g} (scale {scale:.3g})")


def case(kind, reverse, with_state, inputs, backend, label, dtype=torch.float64, tol=TOL):
    gen = torch.Generator().manual_seed(7)
    z, a, g = (t.to(dtype).requires_grad_() for t in inputs)
    w = torch.randn(B, T, D, generator=gen, dtype=torch.float64).to(dtype)
    wf = torch.randn(B, D, generator=gen, dtype=torch.float64).to(dtype)
    state = None
    if with_state:
        m0 = torch.randn(B, D, generator=gen, dtype=torch.float64).to(dtype)
        n0 = torch.randn(B, D, generator=gen, dtype=torch.float64).to(dtype)
        d0 = (torch.rand(B, D, generator=gen, dtype=torch.float64) + 1.0).to(dtype)
        state = fastrwa.ScanState(*(t.requires_grad_() for t in (m0, n0, d0)))
    leaves = [z, a, g] + (list(state) if state is not None else [])
    # the reference: one scan of the whole sequence; the loss reads the final state through
    # its average (what the state represents)
    with fastrwa.use_backend(backend):
        y, final = scan(kind, z, a, g, state, reverse)
    loss = (y * w).sum() + (average(final) * wf).sum()
    want = torch.autograd.grad(loss, leaves, allow_unused=True)
    # this rank's slice
    first, last = (world - 1, 0) if reverse else (0, world - 1)
    zs, as_, gs = (t.detach()[:, lo:hi].clone().requires_grad_() for t in (z, a, g))
    mine = None
    if with_state and rank == first:
        mine = fastrwa.ScanState(*(t.detach().clone().requires_grad_() for t in state))
    with fastrwa.use_backend(backend):
        ys, fs = scan(kind, zs, as_, gs, mine, reverse, group)
    check(f"{label}: y", ys.detach(), y.detach()[:, lo:hi], tol)
    part = (ys * w[:, lo:hi]).sum()
    if rank == last:
        check(f"{label}: final average", average(fs).detach(), average(final).detach(), tol)
        part = part + (average(fs) * wf).sum()
    own = [zs, as_, gs] + (list(mine) if mine is not None else [])
    got = torch.autograd.grad(part, own, allow_unused=True)
    names = ["gz", "ga", "gg", "gm0", "gn0", "gd0"]
    for name, gv, wv in zip(names, got, want):
        if name in ("gz", "ga", "gg"):
            wv = wv[:, lo:hi] if wv is not None else None
        if kind == "rwa" and name == "gg":
            continue
        if gv is None and wv is not None and wv.numel() == 0:
            continue                                   # (an empty slice: nothing to compare)
        if gv is None or wv is None:
            if not (gv is None and wv is None):
                raise AssertionError(f"rank {rank}: {label}: {name} missing on one side")
            continue
        check(f"{label}: {name}", gv, wv, tol)


def inputs(extreme=None):
    gen = torch.Generator().manual_seed(3)
    z, a, g = (torch.randn(B, T, D, generator=gen, dtype=torch.float64) for _ in range(3))
    if extreme == "large":
        a = a.sign() * 1e4 + a                    # weights of e^(+-1e4) (stabilisation)
    if extreme == "masked":
        # -inf logits from before the first boundary to after it, and a decay that forgets
        edge = lengths[0]
        a[:, max(0, edge - 1):min(T, edge + 2)] = float("-inf")
        g[0, edge % T, 1] = float("-inf")
    return z, a, g


for backend in ("numba", "torch"):
    for kind in ("rwa", "exp", "sigmoid", "softplus", "relu"):
        for reverse in (False, True):
            for with_state in (False, True):
                label = f"{backend} {kind} reverse={reverse} state={with_state}"
                case(kind, reverse, with_state, inputs(), backend, label)
    for extreme in ("large", "masked"):
        for kind in ("rwa", "exp", "sigmoid", "softplus", "relu"):
            for reverse in (False, True):
                case(kind, reverse, True, inputs(extreme), backend,
                     f"{backend} {kind} {extreme} reverse={reverse}")

# float32 on every backend, within the suite's float32 tolerance; Triton's (its interpreter
# on CPU tensors, as the suite runs it: TRITON_INTERPRET=1 comes from tests/conftest.py) when
# asked for (``triton`` after the lengths: the interpreter is slow)
with_triton = sys.argv[5:] == ["triton"] and os.environ.get("TRITON_INTERPRET") == "1"
if sys.argv[5:] == ["triton"] and not with_triton:
    raise RuntimeError("the Triton cases need TRITON_INTERPRET=1 on CPU tensors")
# (Triton reversed only: the exchange between ranks is the layer above the backends, run
# both ways by numba and torch above; the reversed scan is the one whose chunk and state
# indices Triton walks backwards)
for backend in ("numba", "torch") + (("triton",) if with_triton else ()):
    for kind in ("rwa", "sigmoid") if backend != "triton" else ("sigmoid",):
        for reverse in (False, True) if backend != "triton" else (True,):
            case(kind, reverse, True, inputs(), backend,
                 f"float32 {backend} {kind} reverse={reverse}", torch.float32, 2e-5)


# packed sequences over the ranks (cu_seqlens, the whole sequence's offsets on every rank): a
# sequence ends one past every rank boundary, so one runs across each (and across an empty
# slice), and an empty one follows the first (tests/context_parallel/layers_worker.py)
EDGES = [sum(lengths[:j]) for j in range(1, world)]
CROSS = sorted({e + 1 for e in EDGES if e + 1 < T})
LAYOUTS = [torch.tensor(sorted([0, T, *CROSS, *CROSS[:1]])),
           torch.tensor([0, T])]     # (one sequence through every rank: real decays carried)


def packed_case(kind, reverse, with_state, backend, label, CU):
    """One packed row (B = 1) over the ranks: this slice's outputs, its inputs' gradients,
    the initial rows' gradients summed over the ranks (each reads the rows of the sequences
    that begin in its slice) and the final state where the whole sequence's ends (the last
    sequence's on the last rank; the first's on rank 0 in reverse)."""
    N = len(CU) - 1
    gen = torch.Generator().manual_seed(11)
    z, a, g = (torch.randn(1, T, D, generator=gen, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    w = torch.randn(1, T, D, generator=gen, dtype=torch.float64)
    state = None
    if with_state:
        state = fastrwa.ScanState(torch.randn(N, D, generator=gen, dtype=torch.float64),
                                  torch.randn(N, D, generator=gen, dtype=torch.float64),
                                  torch.rand(N, D, generator=gen, dtype=torch.float64) + 1.0)
        state = fastrwa.ScanState(*(t.requires_grad_() for t in state))
    leaves = [z, a, g, *(state or ())]

    def run(z, a, g, state, **more):
        if kind == "rwa":
            return fastrwa.rwa_scan(z, a, state, output_final_state=True, reverse=reverse,
                                    cu_seqlens=CU, **more)
        return fastrwa.rda_scan(z, a, g, kind, state, output_final_state=True,
                                reverse=reverse, cu_seqlens=CU, **more)
    with fastrwa.use_backend(backend):
        y, final = run(z, a, g, state)
        want = torch.autograd.grad((y * w).sum(), leaves, allow_unused=True)
        mine = [t.detach()[:, lo:hi].clone().requires_grad_() for t in (z, a, g)]
        rows = None if state is None else fastrwa.ScanState(
            *(t.detach().clone().requires_grad_() for t in state))
        ys, fs = run(*mine, rows, context_group=group)
    check(f"{label}: y", ys.detach(), y.detach()[:, lo:hi])
    got = torch.autograd.grad((ys * w[:, lo:hi]).sum(), [*mine, *(rows or ())],
                              allow_unused=True)
    for name, gv, wv in zip(["gz", "ga", "gg"], got, want):
        if kind == "rwa" and name == "gg":
            continue
        check(f"{label}: {name}", gv if gv is not None else torch.zeros(1, hi - lo, D,
                                                                      dtype=torch.float64),
              wv[:, lo:hi])
    for name, gv, wv in zip(["gm0", "gn0", "gd0"], got[3:], want[3:]):
        gv = torch.zeros_like(wv) if gv is None else gv.clone()
        dist.all_reduce(gv)
        check(f"{label}: {name} summed over the ranks", gv, wv)
    end = 0 if reverse else world - 1
    if rank == end:
        row = 0 if reverse else N - 1
        check(f"{label}: final average", average(fs).detach(),
              average(fastrwa.ScanState(*(t[row:row + 1] for t in final))).detach())


for backend in ("numba", "torch"):
    for kind in ("rwa", "exp", "sigmoid"):
        for reverse in (False, True):
            for with_state in (False, True):
                for CU in LAYOUTS:
                    packed_case(kind, reverse, with_state, backend,
                                f"packed {backend} {kind} reverse={reverse} state={with_state} "
                                f"cu_seqlens={CU.tolist()}", CU)


def refused(words, **mine):
    """Every rank calls; this rank with ``mine`` changed: every rank raises ValueError."""
    z, a, g = (t[:, lo:hi].clone() for t in inputs())
    call = dict(z=z, a=a, g=g, context_group=group) | mine
    try:
        fastrwa.rda_scan(**call)
    except ValueError as exc:
        if words not in str(exc) and "refused their arguments" not in str(exc):
            raise AssertionError(f"rank {rank}: unexpected message {exc}") from exc
        return
    raise AssertionError(f"rank {rank}: no error for {words}")


# a rank with other arguments, or refusing its own: every rank raises, none waits
refused("width D", **({"z": torch.randn(B, hi - lo, D + 1, dtype=torch.float64),
                       "a": torch.randn(B, hi - lo, D + 1, dtype=torch.float64),
                       "g": torch.randn(B, hi - lo, D + 1, dtype=torch.float64)}
                      if rank == world - 1 else {}))
refused("every rank must call with the same", **({"z": torch.randn(1, hi - lo, D, dtype=torch.float64),
                          "a": torch.randn(1, hi - lo, D, dtype=torch.float64),
                          "g": torch.randn(1, hi - lo, D, dtype=torch.float64),
                          "cu_seqlens": torch.tensor([0, T])} if rank == world - 1 else {}))
refused("initial_state", **({"initial_state": fastrwa.ScanState.empty(
    B, D, dtype=torch.float64)} if rank == world - 1 and world > 1 else {}))

# a rank whose inputs need no gradient still joins the backward; the others' are exact
z, a, g = inputs()
zl, al, gl = (t[:, lo:hi].clone().requires_grad_(rank != world - 1) for t in (z, a, g))
ys, _ = fastrwa.rda_scan(zl, al, gl, "sigmoid", context_group=group)
(ys * torch.arange(1, ys.numel() + 1, dtype=ys.dtype).view_as(ys)).sum().backward()
zf, af, gf = (t.clone().requires_grad_() for t in (z, a, g))
yf, _ = fastrwa.rda_scan(zf, af, gf, "sigmoid")
weights = torch.cat([torch.arange(1, B * n * D + 1, dtype=yf.dtype).view(B, n, D)
                     for n in lengths], dim=1)
(yf * weights).sum().backward()
if rank != world - 1:
    for name, got, want in (("gz", zl.grad, zf.grad), ("ga", al.grad, af.grad),
                            ("gg", gl.grad, gf.grad)):
        check(f"no-grad rank: {name}", got, want[:, lo:hi])
dist.barrier()
dist.destroy_process_group()
print("OK", flush=True)
# (gloo's threads can abort a process in the interpreter's teardown, "terminate called
# without an active exception", after everything above succeeded: the check is done, so
# the worker leaves without that teardown)
os._exit(0)
