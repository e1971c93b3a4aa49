"""Context parallelism: one sequence split along time over the ranks of a process group.

Rank ``k`` holds the contiguous slice ``k`` of ``T`` (slices may differ in length, ``0``
included). The scan over a slice acts on the state entering it through a per-channel
summary of ``4 * B * D`` numbers (docs/math.md §7): the total log-decay ``Lam`` of the slice
and the state ``(m, n~, d~)`` the slice leaves from an empty one. So each rank

1. scans its slice from the empty state (the first rank from ``initial_state``) for its
   summary;
2. gathers every rank's summary (one ``all_gather`` of ``4 B D`` floats, whatever ``T``);
3. combines the summaries of the slices before its own, in scan order, with the
   max-stabilised combine of :func:`combine` (in the state dtype: float32, float64 for
   float64 inputs): the exact state entering its slice;
4. scans its slice from that state (the first rank's first scan is already this one).

The combine and the gather are PyTorch operations with autograd (the gather's backward sums
each rank's gradient over the ranks: an ``all_reduce``), and the local scans are the op
with its analytic backward; so the gradient of every input, ``initial_state`` included, is
the gradient of one scan over the whole sequence. Every rank must take part in each call
and, when any rank's inputs need a gradient, in each backward (its outputs then need one
too), through its outputs to its inputs (``.backward()``, or ``torch.autograd.grad`` for
the slice's inputs). The local scans run on any backend.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist
from torch import Tensor

from ..kernels.codes import ATTENTION_CODE, DISCOUNT_CODE
from .chunked import combine_weights, decayed_max
from .autograd import weighted_scan_op
from .contract import ScanArgs, state_dtype
from .transforms import log_decay


class _AllGather(torch.autograd.Function):
    """``(world, *x.shape)``: every rank's ``x``; backward: the sum over ranks of the
    gradient of this rank's part (all-reduce, which gloo and NCCL both have)."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor):
        group, ctx.group = ctx.group, None    # (a graph kept alive past the backward must not
        grad = grad.contiguous().clone()      # keep the group into interpreter teardown, where
        dist.all_reduce(grad, group=group)    # gloo's threads abort the process)
        return grad[dist.get_rank(group)], None


class _After(torch.autograd.Function):
    """``y`` (a copy) made to depend on ``earlier``, with a zero gradient for it: autograd
    then runs everything behind ``y`` (its collectives included) before ``earlier``'s
    backward, the same order on every rank."""

    @staticmethod
    def forward(ctx, y: Tensor, earlier: Tensor) -> Tensor:
        ctx.shape, ctx.dtype = earlier.shape, earlier.dtype
        return y.clone()

    @staticmethod
    def backward(ctx, gy: Tensor):
        return gy, torch.zeros(ctx.shape, dtype=ctx.dtype, device=gy.device)


def after(y: Tensor, earlier: Tensor) -> Tensor:
    """``y``, ordered after ``earlier`` in the backward (:class:`_After`): two collectives
    that no data orders (the two directions of a bidirectional layer) must run their
    backward all-reduces in the same order on every rank."""
    return _After.apply(y, earlier)


def combine(state: tuple, lam: Tensor, own: tuple) -> tuple:
    """The state ``state`` ``(m, n~, d~)`` carried through a slice of total log-decay ``lam``
    whose own contributions are the state ``own``: ``N = exp(lam) N_prev + N_own`` for the
    represented numerator and denominator, max-stabilised (``-inf`` in ``lam`` forgets the
    past; an empty state, ``m = -inf``, weighs nothing). Out of place, with autograd."""
    m0, n0, d0 = state
    m1, n1, d1 = own
    m, keep, take = combine_weights(decayed_max(m0, lam), m1, torch.exp)
    return m, n0 * keep + n1 * take, d0 * keep + d1 * take


SLOTS = 16          # integers in every agreement gather (the op's and the layers')
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# what an agreement gather is for (its first value): ranks in different calls are told so
CALL_SCAN, CALL_LAYER, CALL_MODEL = 1, 2, 3


def fingerprint(text: str) -> int:
    """A module's description (class, sizes, options) as one integer for :func:`agree`:
    ranks whose models differ (a layer more, another width or option) then stop together
    instead of waiting in a collective the others never make."""
    return zlib.crc32(text.encode())


def _device_of(group) -> torch.device:
    """Where a tensor for a collective of ``group`` must be when there are no inputs."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather_slots(mine: list, group, device) -> Tensor:
    """``(world, SLOTS)``: every rank's integers (one ``all_gather``), ``mine`` padded."""
    mine = mine + [-1] * (SLOTS - len(mine))
    return _AllGather.apply(torch.tensor(mine, dtype=torch.int64, device=device), group)


def refuse_together(problem: Exception, group) -> None:
    """Raise ``problem`` on this rank after telling the others (who raise too): this rank's
    arguments were refused before a gather of :func:`agree`, which they are waiting in."""
    _gather_slots([1], group, _device_of(group))
    raise problem


def agree(values: dict, group, device=None) -> dict:
    """Every rank's ``values`` (names to integers, at most ``SLOTS - 1``) from one
    ``all_gather``, as ``{name: [value of rank 0, rank 1, ...]}``; raises on every rank
    (none waits) when a rank refused its arguments (:func:`refuse_together`)."""
    assert len(values) < SLOTS, "an agreement gather holds SLOTS - 1 values"
    device = _device_of(group) if device is None else device
    everyone = _gather_slots([0, *values.values()], group, device).tolist()
    refused = [rank for rank, row in enumerate(everyone) if row[0]]
    if refused:
        raise ValueError(f"context parallel: rank(s) {refused} refused their arguments (their "
                         f"error says why); every rank stops")
    return {name: [row[i] for row in everyone] for i, name in enumerate(values, start=1)}


def same_everywhere(values: dict, names) -> None:
    """Raise unless every rank gave the same value for each of ``names`` (of :func:`agree`'s
    result)."""
    for name in names:
        if len(set(values[name])) > 1:
            raise ValueError(f"context parallel: every rank must call with the same {name}; "
                             f"got {values[name]} over the ranks")


def _scan_agreement(args: ScanArgs, group, offsets: int) -> tuple[dict, bool]:
    """One gather of every rank's call (:func:`agree`): the same batch, width, dtype,
    functions, direction, grad mode and packed offsets (``offsets``: 0 for none, else a
    fingerprint of ``cu_seqlens`` plus 1) everywhere, or every rank raises. Returns the
    gathered values (with each rank's slice length and whether it has an
    ``initial_state``) and whether any rank's inputs need a gradient."""
    z, a, g, attention, discount, state, reverse, _ = args
    B, T, D = z.shape
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (z, a, g, *(state or ())))
    everyone = agree({"call": CALL_SCAN, "batch B": B, "width D": D,
                      "dtype": DTYPES.index(z.dtype),
                      "attention": ATTENTION_CODE[attention],
                      "discount": DISCOUNT_CODE[discount], "reverse": int(reverse),
                      "grad mode": int(torch.is_grad_enabled()), "needs grad": int(grad),
                      "initial_state": int(state is not None), "length": T,
                      "cu_seqlens": offsets}, group, z.device)
    same_everywhere(everyone, ("call", "batch B", "width D", "dtype", "attention",
                               "discount", "reverse", "grad mode", "cu_seqlens"))
    return everyone, any(everyone["needs grad"])


def _check_alike(args: ScanArgs, group, first: int) -> bool:
    """Every rank's arguments passed its checks, and every rank called with the same batch,
    width, dtype, functions, direction and grad mode, and only the first rank in scan order
    with an ``initial_state``: checked on every rank from one gather of a few integers, so
    that all raise (none waits). Returns whether any rank's inputs need a gradient (then
    every rank's backward joins the gather's all-reduce)."""
    everyone, grad = _scan_agreement(args, group, 0)
    holders = [rank for rank, has in enumerate(everyone["initial_state"]) if has]
    if holders not in ([], [first]):
        raise ValueError(f"context parallel: initial_state is the state before the whole "
                         f"sequence: pass it on rank {first} only (the first slice in scan "
                         f"order), got it on ranks {holders}")
    return grad


def previous_input(x: Tensor, initial: Tensor, lengths: list, group, grad: bool,
                   dtype: torch.dtype) -> Tensor:
    """The input before this rank's slice, for a token shift: the last input ``(B, I)`` of
    the nearest earlier rank whose slice has tokens, else the sequence's ``initial`` one
    (rank 0's). ``x``: this slice ``(B, T, I)``; ``lengths``: every rank's slice length;
    ``grad``: whether any rank needs gradients (then the gather's all-reduce is in every
    rank's backward); ``dtype``: the inputs' (agreed by every rank), in which every rank
    sends. One ``all_gather`` of ``B * I`` numbers. An empty slice sends a value that
    depends on its ``x`` (an exact 0 added), so that a backward asked for ``x``'s gradient
    (``torch.autograd.grad``) reaches the gather there as on the other ranks."""
    rank = dist.get_rank(group)
    if lengths[rank]:
        mine = x[:, -1]
    else:
        mine = (initial if rank == 0 else torch.zeros_like(initial)) + x.sum().to(initial.dtype) * 0
    mine = mine.to(dtype)
    if grad and not mine.requires_grad:
        mine = mine.detach().requires_grad_()
    gathered = _AllGather.apply(mine, group)                              # (world, B, I)
    earlier = [j for j in range(rank) if lengths[j]]
    previous = initial if rank == 0 else gathered[earlier[-1] if earlier else 0]
    return after(previous, gathered) if grad else previous


def _local(args: ScanArgs, state, backend: str) -> tuple[Tensor, tuple]:
    """The op on this rank's slice from ``state`` (``None``: empty); a slice of length 0
    gives back ``state``."""
    z = args.z
    sdt = state_dtype(z.dtype)
    if z.shape[1] == 0:
        if state is None:
            B, _, D = z.shape
            state = (torch.full((B, D), float("-inf"), dtype=sdt, device=z.device),
                     z.new_zeros((B, D), dtype=sdt), z.new_zeros((B, D), dtype=sdt))
        # (an exact 0 from the empty inputs: the summary stays in their graph, so that a
        # backward asked for their gradients, torch.autograd.grad, still reaches the gather)
        nothing = sum(t.sum() for t in (z, args.a, args.g) if t is not None).to(sdt) * 0
        return z[:, :0].clone(), tuple(t + nothing for t in state)
    return weighted_scan_op(args._replace(initial_state=None if state is None else tuple(state)),
                            backend)


def context_parallel_scan(args: ScanArgs, backend: str, group) -> tuple[Tensor, tuple]:
    """The scan of the whole sequence whose slice this rank holds (module doc): ``(y,
    final)``, ``y`` this slice's outputs and ``final`` the state after this slice (the last
    rank in scan order holds the whole sequence's)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    first = world - 1 if args.reverse else 0
    grad = _check_alike(args, group, first)
    sdt = state_dtype(args.z.dtype)
    y, own = _local(args, args.initial_state if rank == first else None, backend)
    lam = log_decay(None if args.g is None else args.g.to(sdt), args.discount)
    B, _, D = args.z.shape
    total = args.z.new_zeros((B, D), dtype=sdt) if lam is None else lam.to(sdt).sum(dim=1)
    summary = torch.stack([total, *own])                                 # (4, B, D)
    if grad and not summary.requires_grad:      # (a rank whose inputs need none: it still
        summary = summary.detach().requires_grad_()   # joins the backward's all-reduce)
    summaries = _AllGather.apply(summary, group)                          # (world, 4, B, D)
    if rank != first:
        before = range(rank) if not args.reverse else range(world - 1, rank, -1)
        state = (torch.full((B, D), float("-inf"), dtype=sdt, device=args.z.device),
                 args.z.new_zeros((B, D), dtype=sdt), args.z.new_zeros((B, D), dtype=sdt))
        for j in before:
            state = combine(state, summaries[j, 0], tuple(summaries[j, 1:]))
        y, own = _local(args, state, backend)
    # (the first rank's outputs, or an empty slice's, do not depend on the summaries; the
    # backward must still reach the gather on every rank, from whichever output it starts)
    if grad:
        y, own = after(y, summaries), tuple(after(t, summaries) for t in own)
    return y, own


# -- packed sequences over the ranks ---------------------------------------------------------
def _empty(n: int, D: int, dtype, device) -> tuple:
    """``n`` empty states ``(m, n~, d~)`` = ``(-inf, 0, 0)``."""
    return (torch.full((n, D), float("-inf"), dtype=dtype, device=device),
            torch.zeros((n, D), dtype=dtype, device=device),
            torch.zeros((n, D), dtype=dtype, device=device))


class Pieces:
    """Rank ``rank``'s slice ``[lo, hi)`` of packed sequences with global offsets ``cu``: its
    local offsets (``local``), the global sequence of each piece (``sequence``), whether
    the piece first in scan order continues a sequence begun on an earlier rank in scan
    order (``continued``; that piece is index 0 forward, the last one in reverse), and, per
    rank ``j``, whether what leaves its slice is independent of what enters it
    (``resets[j]``: a sequence begins in it, in scan order)."""

    def __init__(self, cu: list, lengths: list, rank: int, reverse: bool):
        edges = [sum(lengths[:j]) for j in range(len(lengths) + 1)]
        lo, hi = edges[rank], edges[rank + 1]
        bounds = sorted(set(cu))
        self.lo, self.hi, self.reverse = lo, hi, reverse
        self.local = [0, *(b - lo for b in bounds if lo < b < hi), hi - lo] if hi > lo else [0]
        # (bisect: with empty sequences at an offset, the one that holds the position)
        self.sequence = [max(i for i, c in enumerate(cu[:-1]) if c <= lo + start)
                         for start in self.local[:-1]]
        if reverse:
            self.continued = hi > lo and hi not in bounds
            self.resets = [any(edges[j] < b <= edges[j + 1] for b in bounds)
                           for j in range(len(lengths))]
        else:
            self.continued = hi > lo and lo not in bounds
            self.resets = [any(edges[j] <= b < edges[j + 1] for b in bounds)
                           for j in range(len(lengths))]

    @property
    def entry(self) -> int:
        """The index of the piece first in scan order (the one a carry enters)."""
        return len(self.local) - 2 if self.reverse else 0

    @property
    def exit(self) -> int:
        """The index of the piece last in scan order (what leaves the slice)."""
        return 0 if self.reverse else len(self.local) - 2


def _pieces_scan(args: ScanArgs, pieces: Pieces, initial, carry, backend: str) -> tuple:
    """The op on this rank's pieces (local ``cu_seqlens``), each from its sequence's row of
    ``initial`` (``None``: empty), the continued piece from ``carry`` (``None``: empty);
    ``(y, finals)`` with a state row per piece."""
    z = args.z
    sdt, D, P = state_dtype(z.dtype), z.shape[2], len(pieces.local) - 1
    if initial is None:
        rows = _empty(P, D, sdt, z.device)
    else:
        index = torch.tensor(pieces.sequence, device=z.device)
        rows = tuple(t.to(sdt).index_select(0, index) for t in initial)
    if pieces.continued:
        k = pieces.entry
        enter = _empty(1, D, sdt, z.device) if carry is None else tuple(t.to(sdt) for t in carry)
        rows = tuple(torch.cat([r[:k], e, r[k + 1:]]) for r, e in zip(rows, enter))
    cu = torch.tensor(pieces.local, dtype=torch.int64, device=z.device)
    return weighted_scan_op(args._replace(initial_state=rows, cu_seqlens=cu), backend)


def context_parallel_packed_scan(args: ScanArgs, backend: str, group, cu: list,
                                 lengths: list, grad: bool) -> tuple[Tensor, tuple]:
    """:func:`context_parallel_scan` of packed sequences whose global offsets ``cu`` span
    the ranks' slices (``lengths``, rank order is time order): each sequence runs as if
    alone, from its row of ``initial_state`` (given on every rank, the same ``N`` rows, or
    on none: empty), one that spans ranks carried over them. Each rank's summary is its
    slice's if one sequence runs through it, or, when a sequence begins in it, the state it
    leaves with and a log-decay of ``-inf`` (nothing before it counts); the combine of the
    earlier ranks' summaries enters the piece that continues a sequence begun before.
    Returns ``(y, final)``: ``final`` ``(1, D)`` each, the state after this slice of the
    sequence it ends in (its own, for an empty slice the entering one)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    z = args.z
    sdt, D = state_dtype(z.dtype), z.shape[2]
    pieces = Pieces(cu, lengths, rank, args.reverse)
    if lengths[rank]:
        y, finals = _pieces_scan(args, pieces, args.initial_state, None, backend)
        own = tuple(f[pieces.exit:pieces.exit + 1] for f in finals)
        if pieces.resets[rank]:
            total = torch.full((1, D), float("-inf"), dtype=sdt, device=z.device)
        else:
            lam = log_decay(None if args.g is None else args.g.to(sdt), args.discount)
            total = z.new_zeros((1, D), dtype=sdt) if lam is None else lam.to(sdt).sum(dim=1)
    else:
        y, own = _local(args._replace(initial_state=None, cu_seqlens=None), None, backend)
        total = z.new_zeros((1, D), dtype=sdt)
    summary = torch.stack([total, *own])                                 # (4, 1, D)
    if grad and not summary.requires_grad:
        summary = summary.detach().requires_grad_()
    summaries = _AllGather.apply(summary, group)                          # (world, 4, 1, D)
    before = range(rank) if not args.reverse else range(world - 1, rank, -1)
    carry = _empty(1, D, sdt, z.device)
    for j in before:
        carry = combine(carry, summaries[j, 0], tuple(summaries[j, 1:]))
    if pieces.continued:
        y, finals = _pieces_scan(args, pieces, args.initial_state, carry, backend)
        own = tuple(f[pieces.exit:pieces.exit + 1] for f in finals)
    elif not lengths[rank]:
        own = carry
    if grad:
        y, own = after(y, summaries), tuple(after(t, summaries) for t in own)
    return y, own


def packed_over_ranks(args: ScanArgs, backend: str, group) -> tuple[Tensor, tuple]:
    """Check a context-parallel call with ``cu_seqlens`` over the ranks (the same offsets,
    batch, width, dtype, functions, direction and grad mode everywhere, the offsets ending
    at the sum of the slices' lengths, ``initial_state`` on every rank or none), then run
    :func:`context_parallel_packed_scan`; every rank raises together."""
    cu = args.cu_seqlens.tolist()
    everyone, grad = _scan_agreement(args, group, fingerprint(repr(cu)) + 1)
    lengths = everyone["length"]
    if cu[-1] != sum(lengths):
        raise ValueError(f"context parallel: cu_seqlens are the whole packed sequence's "
                         f"offsets and must end at its length {sum(lengths)} (the slices' "
                         f"{lengths}), got {cu[-1]}")
    if len(set(everyone["initial_state"])) > 1:
        raise ValueError(f"context parallel with cu_seqlens: initial_state holds a row per "
                         f"sequence, and sequences begin on every rank: pass the same one on "
                         f"every rank or on none, got it on ranks "
                         f"{[r for r, has in enumerate(everyone['initial_state']) if has]}")
    return context_parallel_packed_scan(args, backend, group, cu, lengths, grad)
