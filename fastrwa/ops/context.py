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
from .autograd import weighted_scan_op
from .dispatch import ScanArgs, state_dtype
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
    decayed = (m0 + lam).masked_fill(torch.isneginf(lam), float("-inf"))
    m = torch.maximum(decayed, m1)
    shift = m.clamp(min=torch.finfo(m.dtype).min)      # (nothing seen: exp(-inf - shift) = 0)
    keep = torch.exp((decayed - shift).masked_fill(torch.isposinf(decayed), 0.0))
    take = torch.exp((m1 - shift).masked_fill(torch.isposinf(m1), 0.0))
    return m, n0 * keep + n1 * take, d0 * keep + d1 * take


SLOTS = 12          # integers in every agreement gather (the op's and the layers')
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


def _check_alike(args: ScanArgs, group, first: int) -> bool:
    """Every rank's arguments passed its checks, and every rank called with the same batch,
    width, dtype, functions, direction and grad mode, and only the first rank in scan order
    with an ``initial_state``: checked on every rank from one gather of a few integers, so
    that all raise (none waits). Returns whether any rank's inputs need a gradient (then
    every rank's backward joins the gather's all-reduce)."""
    z, a, g, attention, discount, state, reverse, _ = args
    B, T, D = z.shape
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (z, a, g, *(state or ())))
    everyone = agree({"call": CALL_SCAN, "batch B": B, "width D": D,
                      "dtype": DTYPES.index(z.dtype),
                      "attention": ATTENTION_CODE[attention],
                      "discount": DISCOUNT_CODE[discount], "reverse": int(reverse),
                      "grad mode": int(torch.is_grad_enabled()), "needs grad": int(grad),
                      "initial_state": int(state is not None)}, group, z.device)
    same_everywhere(everyone, ("call", "batch B", "width D", "dtype", "attention",
                               "discount", "reverse", "grad mode"))
    holders = [rank for rank, has in enumerate(everyone["initial_state"]) if has]
    if holders not in ([], [first]):
        raise ValueError(f"context parallel: initial_state is the state before the whole "
                         f"sequence: pass it on rank {first} only (the first slice in scan "
                         f"order), got it on ranks {holders}")
    return any(everyone["needs grad"])


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
