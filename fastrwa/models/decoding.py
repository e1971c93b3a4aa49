"""What a decoder of the byte LM does: the contract between its decoders (the eager
``ByteLM`` step, :class:`fastrwa.models.graphed.CUDAGraphDecoder`,
:class:`fastrwa.models.PackedLM`) and what drives them (``ByteLM.generate``/``stream`` and
beam search, the Hugging Face ``generate()``, the server's rows in ``fastrwa.serve.rows``),
which use nothing else of a decoder. ``ByteLM.decoder(weights)`` picks one.

A decoder keeps no state between calls but what its caches hold (an
:class:`~fastrwa.models.cache.InferenceCache` it allocated: the state of ``B`` rows, updated
in place). Shapes: ``B`` a cache's rows, ``T`` positions, ``V`` the vocabulary (257: the
bytes and BOS). Ids ``>= forbidden`` are never drawn (``forbidden``: the BOS id, 256, after
the bytes).

Example:
    >>> import torch
    >>> from fastrwa.models import ByteLM, LMConfig
    >>> from fastrwa.models.decoding import Decoder, Sampling
    >>> model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    >>> decoder: Decoder = model.decoder("auto")          # (a float32 CPU model: a PackedLM)
    >>> cache = decoder.allocate_cache(2)
    >>> logits = decoder.prefill(torch.tensor([[72, 105], [79, 107]]), cache)
    >>> sampling = Sampling(temperature=0.8, generator=torch.Generator().manual_seed(0))
    >>> token = decoder.draw(logits, sampling, forbidden=256)     # (B,): one id per row
    >>> decoder.step_(token, cache).shape
    torch.Size([2, 257])
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator, Optional, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from .cache import InferenceCache
from .sampling import check_sampling_args, sample


@dataclasses.dataclass
class Sampling:
    """How the next id of a row is drawn: ``softmax(logits / temperature)`` over the ids
    kept by ``top_k`` and ``top_p`` (``None``: all), at random numbers of ``generator`` (on
    the logits' device; ``None``: PyTorch's default one). The arguments of ``generate``;
    a server stream has one of its own."""

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    generator: Optional[torch.Generator] = None


def draw_each(draw: Callable[[Tensor, Sampling, int], Tensor], logits: Tensor,
              samplings: Sequence[Optional[Sampling]], forbidden: int) -> Tensor:
    """:meth:`Decoder.draw` for a list of settings, one per row of ``logits`` ``(B,
    V)``, by a decoder's own ``draw`` called on each row ``(1, V)`` in turn: CPU int64
    ``(B,)``, -1 for a row skipped (``None``) or one the draw refused (``ValueError``).

    Example:
        >>> import torch
        >>> from fastrwa.models.sampling import sample
        >>> def draw(logits, s, forbidden):
        ...     return sample(logits, s.temperature, s.top_k, s.top_p, s.generator, forbidden)
        >>> logits = torch.tensor([[0.0, 5.0, 9.0], [float("nan"), 0.0, 0.0], [3.0, 0.0, 0.0]])
        >>> draw_each(draw, logits, [Sampling(top_k=1), Sampling(), None], 2).tolist()
        [1, -1, -1]
    """
    ids = torch.full((len(samplings),), -1, dtype=torch.int64)
    for row, sampling in enumerate(samplings):
        if sampling is not None:
            try:
                ids[row] = int(draw(logits[row:row + 1], sampling, forbidden))
            except ValueError:
                pass
    return ids


def draw_sampled(logits: Tensor, sampling: "Sampling | Sequence[Optional[Sampling]]",
                 forbidden: int) -> Tensor:
    """The eager decoders' :meth:`Decoder.draw` (``ByteLM``, ``CUDAGraphDecoder``):
    :func:`fastrwa.models.sampling.sample` on the logits' device with one
    :class:`Sampling` for every row; with a list of them, one per row, a row a call
    (:func:`draw_each`)."""
    if isinstance(sampling, (list, tuple)):
        return draw_each(draw_sampled, logits, sampling, forbidden)
    return sample(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                  sampling.generator, forbidden)


class Decoder(Protocol):
    """What ``ByteLM.decoder(weights)`` returns: the model's step in one of its forms.

    ``kind`` names it for messages (the server's startup line and ``/health``)."""

    kind: str

    def allocate_cache(self, batch: int) -> InferenceCache:
        """A cache of ``batch`` rows (an int >= 0) this decoder steps, holding the initial
        state (each layer's learned prior)."""

    def prefill(self, tokens: Tensor, cache: InferenceCache) -> Tensor:
        """Run ``tokens`` ``(B, T)`` (``B`` the cache's rows, ``T >= 1``) from the initial
        state, leave the state after them in ``cache`` and return the last position's
        logits ``(B, V)`` (valid until the cache's next prefill or step). Arguments are
        checked before anything is written."""

    def step_(self, token: Tensor, cache: InferenceCache, *,
              rows: Optional[int] = None) -> Tensor:
        """Advance ``cache`` in place by one id per row, ``token`` ``(B,)`` int64 on the
        cache's device, and return the logits after it ``(B, V)``: a buffer the next step
        overwrites. ``rows``: only rows ``[0, rows)`` must advance (``None``: all), the others'
        ids are not read and their state after the call is unspecified (a decoder may step
        every row: a CUDA graph has a fixed batch); only the first ``rows`` rows of the
        logits are defined."""

    def draw(self, logits: Tensor, sampling: Sampling | Sequence[Optional[Sampling]],
             forbidden: int) -> Tensor:
        """One id per row of ``logits`` ``(B, V)`` (what :meth:`prefill` or :meth:`step_`
        returned, or rows of it), ``(B,)`` int64 on their device, drawn with ``sampling`` in
        row order, never one ``>= forbidden``: the draw of :meth:`sample_steps`. A row per
        call draws each row with its own settings and generator. NaN or ``+inf`` logits, or
        a row with every id excluded: ``ValueError`` naming the row.

        ``sampling`` may also be a list (or tuple) of ``B`` settings, one per row (``None``: the
        row is skipped): each row is drawn with its own settings and generator, in row
        order, the id it would get drawn alone (a ``(1, V)`` row a call), in one call where
        the decoder can (the server's streams; ``PackedLM``: one compiled call,
        :func:`draw_each` otherwise). Then the ids are a CPU int64 ``(B,)``, -1 where the row
        was skipped or nothing can be drawn from it (drawn alone, that row raises the
        ``ValueError``)."""

    def sample_steps(self, logits: Tensor, cache: InferenceCache, max_new_tokens: int,
                     temperature: float = 1.0, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                     forbidden: Optional[int] = None) -> Iterator[Tensor]:
        """``max_new_tokens`` ids ``(B,)``: the first drawn from ``logits`` (what
        :meth:`prefill` or :meth:`step_` returned for ``cache``), each next from the logits
        of a step that reads the one before (none after the last): :func:`draw_and_step`'s
        tokens (a decoder may fuse the loop). ``forbidden`` defaults to the BOS id.
        Arguments are checked when it is called (``ValueError``), before the first id."""


@runtime_checkable
class Extendable(Decoder, Protocol):
    """A decoder whose prefill may be cut anywhere: :meth:`extend` continues from the state
    a cache holds, and ``prefill(a)`` then ``extend(b)`` leave the state and logits of
    ``prefill(a + b)`` bit for bit, at any cut (:class:`fastrwa.models.PackedLM`; the eager
    parallel forward's sums depend on where the sequence is cut, within float rounding:
    not one). The server keeps prompts' states for reuse only with such a decoder."""

    def extend(self, tokens: Tensor, cache: InferenceCache) -> Tensor:
        """:meth:`Decoder.prefill` from the state in ``cache`` rather than the initial one:
        ``tokens`` ``(B, T)``, ``T >= 1``; returns the last position's logits ``(B, V)``."""


def check_forbidden(forbidden: object, vocab_size: int) -> int:
    """``forbidden`` after checking it is an int in ``[1, vocab_size]`` (ids from it on are
    never drawn: at least one id is left); else a ``ValueError`` naming it."""
    if isinstance(forbidden, bool) or not isinstance(forbidden, int) \
            or not 0 < forbidden <= vocab_size:
        raise ValueError(f"forbidden must be an int in [1, {vocab_size}] (ids from it on are "
                         f"never drawn), got {forbidden!r}")
    return forbidden


def check_rows(rows: object, batch: int) -> int:
    """``rows`` of :meth:`Decoder.step_` after checking it is an int in ``[0, batch]`` (the
    cache's rows); else a ``ValueError`` naming it."""
    if isinstance(rows, bool) or not isinstance(rows, int) or not 0 <= rows <= batch:
        raise ValueError(f"rows must be an int in [0, {batch}] (the cache's rows), "
                         f"got {rows!r}")
    return rows


def draw_and_step(decoder: Decoder, logits: Tensor, cache: InferenceCache,
                  max_new_tokens: int, temperature: float = 1.0, top_k: Optional[int] = None,
                  top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                  *, forbidden: int) -> Iterator[Tensor]:
    """:meth:`Decoder.sample_steps` from the decoder's :meth:`~Decoder.draw` and
    :meth:`~Decoder.step_` (what the eager step and the CUDA graph run; ``PackedLM`` fuses
    the same loop): the arguments are checked now, the ids drawn as the iterator is read."""
    check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    V = logits.shape[-1] if isinstance(logits, Tensor) and logits.dim() == 2 else None
    if V is None or logits.shape[0] != cache.batch:
        got = tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__
        raise ValueError(f"logits must have shape (B, V) = ({cache.batch}, V) (what prefill "
                         f"or step_ returned for this cache), got {got}")
    check_forbidden(forbidden, V)
    return _draw_and_step(decoder, logits, cache, max_new_tokens,
                          Sampling(temperature, top_k, top_p, generator), forbidden)


def _draw_and_step(decoder: Decoder, logits: Tensor, cache: InferenceCache,
                   max_new_tokens: int, sampling: Sampling, forbidden: int) -> Iterator[Tensor]:
    for i in range(max_new_tokens):
        token = decoder.draw(logits, sampling, forbidden)
        yield token
        if i + 1 < max_new_tokens:
            logits = decoder.step_(token, cache)


__all__ = ["Decoder", "Extendable", "Sampling", "check_forbidden", "check_rows", "draw_and_step"]
