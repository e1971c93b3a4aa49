"""How a run's processes share the work: data parallelism (each process its own rows of the
global batch) times context parallelism (``--context-parallel N``: the ``N`` processes of a
context group share rows, each holding a contiguous slice of the BPTT segment along time).

Process ``r`` of ``W`` is context rank ``r % N`` of data replica ``r // N``: a context group
is ``N`` consecutive ranks (on one machine, when each holds whole groups). docs/distributed.md.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch import Tensor


class Layout(NamedTuple):
    """This process's place in the run."""

    data_rank: int                  # which data replica
    data_world: int                 # data replicas (world // context_world)
    context_rank: int               # which slice of the segment
    context_world: int              # --context-parallel
    context_group: Optional[dist.ProcessGroup]   # None without context parallelism

    @property
    def last_context_rank(self) -> int:
        """The global rank of this context group's last slice (the segment's end)."""
        return self.data_rank * self.context_world + self.context_world - 1


def layout(context_parallel: int) -> Layout:
    """This process's :class:`Layout`; every process calls it (it makes the context groups).
    Raises ``ValueError`` unless ``context_parallel`` divides the number of processes."""
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if world % context_parallel:
        raise ValueError(f"--context-parallel {context_parallel} must divide the number of "
                         f"processes ({world}): each data replica is a group of "
                         f"{context_parallel} processes"
                         + (" (run it under torchrun)" if world == 1 else ""))
    group = None
    if context_parallel > 1:
        for replica in range(world // context_parallel):      # (every rank makes every group)
            ranks = list(range(replica * context_parallel, (replica + 1) * context_parallel))
            made = dist.new_group(ranks)
            if rank in ranks:
                group = made
    return Layout(rank // context_parallel, world // context_parallel,
                  rank % context_parallel, context_parallel, group)


def _cut(batch, cut):
    """A batch of ``cut(t)`` of its ``x``, ``target``, ``mask`` and document ``starts``
    (keeping ``new_pass``)."""
    starts = getattr(batch, "starts", None)
    out = type(batch)(cut(batch.x), cut(batch.target), cut(batch.mask),
                      *(() if starts is None else (cut(starts),)))
    if hasattr(batch, "new_pass"):
        out.new_pass = batch.new_pass
    return out


def rows(batch, lo: int, hi: int):
    """Rows ``lo:hi`` of a batch (a data replica's share, or one accumulation micro-batch)."""
    return _cut(batch, lambda t: t[lo:hi])


def time_slice(batch, place: Layout):
    """This process's contiguous slice along time of a batch's ``x``, ``target`` and ``mask``
    ``(B, T, ...)`` (lengths differ by at most one; the earlier slices are the longer)."""
    if place.context_world == 1:
        return batch
    k, n = place.context_rank, place.context_world
    return _cut(batch, lambda t: torch.tensor_split(t, n, dim=1)[k])


def share_of_the_loss(slice_length: int, segment: int, place: Layout) -> float:
    """What multiplies a slice's mean loss so that data parallelism's average of the
    gradients over all processes is the gradient of the mean over each segment's tokens:
    ``N * slice_length / segment`` (1 without context parallelism)."""
    return place.context_world * slice_length / segment


def from_the_last_slice(state, place: Layout):
    """The carried state of the whole segment, on every process of the context group: the
    state after the last slice, broadcast from its process (the next segment starts from it
    on the first slice; the others hold it for the checkpoint). ``state`` is a pytree of
    tensors (detached)."""
    if place.context_world == 1:
        return state

    def broadcast(t):
        if not isinstance(t, Tensor):
            return t
        t = t.detach().clone()
        dist.broadcast(t, src=place.last_context_rank, group=place.context_group)
        return t

    return torch.utils._pytree.tree_map(broadcast, state)
