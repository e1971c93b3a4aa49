"""The rows of a batch the engine steps: a capacity-``N`` cache of a decoder
(:class:`fastrwa.models.decoding.Decoder`, what ``ByteLM.decoder(weights)`` returns) whose
rows ``[0, n)`` hold the ``n`` streams in flight (kept compact: a stream that leaves is
replaced by the last one), with each stream's prompt prefilled alone at batch 1, exactly as
``ByteLM.generate`` prefills it, and its state copied into a free row
(:meth:`DecoderRows.prefill_many` stages several prompts in one batched prefill with the
same bits, but on CPU it is no faster than one after another, which gives the earlier
prompts their first byte sooner: the engine prefills one at a time; docs/serve.md). Each
step is the decoder's ``step_`` over rows ``[0, n)``, then one call of the decoder's
``draw`` over those rows, each with its stream's own settings and generator (a list of
:class:`Sampling`): the decoder contract is all the server uses of the model.

With a prefix cache (:mod:`.prefix_cache`, ``--prefix-cache-mb``) and a decoder whose prefill
may be cut anywhere bit for bit (:class:`~fastrwa.models.decoding.Extendable`: the fused CPU
decoder), a prompt starts from the state kept after its longest prefix seen before (copied
into the staging row, ``InferenceCache.write_row_``) and only the rest is prefilled, in
pieces whose ends' states are kept (``read_row``): the same state and logits as one prefill
of the whole prompt, so the same bytes.

* The fused CPU decode step (a :class:`fastrwa.models.PackedLM`: what ``generate`` runs for
  a float32 ``ByteLM`` on CPU by default) steps rows ``[0, n)`` only, in one kernel call, and
  draws every row in one call of the compiled sampler, each from one float64 uniform of its
  stream's generator, as ``generate`` draws at batch 1. The kernel computes each row on its
  own (a weight row is read once for four batch rows, but each row's sums are its own, in
  the same order): a row's logits are the
  same bits at batch 1 and inside any batch (checked by tests/serve/test_engine.py), so a
  stream's bytes are ``generate``'s for the same prompt, settings and seed, whatever else is
  in the batch.
* The other decoders (the eager step, the CUDA graph on a GPU) step all ``N`` rows (a CUDA
  graph has a fixed batch; rows past ``n`` hold stale state whose logits are ignored) and
  draw with ``fastrwa.models.sampling.sample`` on the model's device, as ``generate`` draws
  there: on CUDA the logits stay on the GPU and each stream's generator is a CUDA generator
  (``torch.Generator("cuda")``; a CPU generator cannot draw from CUDA logits), so a stream's
  bytes are ``generate(..., generator=torch.Generator("cuda").manual_seed(seed))``'s on that
  device. The matrix products may pick other kernels at another batch size: bytes are
  ``generate``'s within float rounding, not bit for bit.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, runtime_checkable

import numpy as np
import torch
from torch import Tensor

from ..models import ByteLM
from ..models.decoding import Decoder, Extendable, Sampling
from .prefix_cache import ID_BYTES, Plan, PrefixCache, key_of

# What temperature 0 (greedy) is sampled with: float32's smallest normal number. Every id
# below the maximum gets weight 0 (the quotient overflows), the maximum 1: the greedy choice
# (among tied maxima, one drawn by the stream's generator), as generate(temperature=GREEDY).
GREEDY_TEMPERATURE = float(np.finfo(np.float32).tiny)


class Rows(Protocol):
    """What the engine (:class:`fastrwa.serve.batcher.Engine`) steps: :class:`DecoderRows`
    (or the tests' scripted rows). ``tokens[i]`` is row ``i``'s next input;
    ``device``, where the draws are made (its streams' generators are made there), is
    optional (CPU)."""

    capacity: int
    kind: str
    tokens: np.ndarray

    def prefill(self, context: Tensor) -> None: ...
    def draw_staged(self, sampling: Sampling) -> int: ...
    def place(self, row: int) -> None: ...
    def move(self, src: int, dst: int) -> None: ...
    def step(self, n: int) -> None: ...
    def draw(self, row: int, sampling: Sampling) -> int: ...
    def draw_rows(self, samplings: Sequence[Optional[Sampling]]) -> list: ...
    # (and, for requests with logprobs, ``logits(row=None)``: DecoderRows.logits)


class DecoderRows:
    """The rows of a decoder's cache (module doc): ``cache`` (``capacity`` rows),
    ``staging`` (one row, where a prompt is prefilled), ``tokens`` (each row's next input)."""

    def __init__(self, decoder: Decoder, capacity: int, forbidden: int,
                 prefix_cache: Optional[PrefixCache] = None):
        """``decoder``: ``model.decoder(weights)``; ``forbidden``: the first id never drawn
        (the BOS id); ``prefix_cache``: where prompts' states are kept for reuse (used only
        when the decoder's prefill may be cut anywhere, :class:`Extendable`; else
        ``self.prefix_cache`` is ``None``)."""
        self.decoder, self.capacity, self.forbidden = decoder, capacity, forbidden
        self.prefix_cache = prefix_cache if isinstance(decoder, Extendable) else None
        self.kind = decoder.kind
        self.cache = decoder.allocate_cache(capacity)
        self.staging = decoder.allocate_cache(1)          # each prompt's prefill, at batch 1
        self.device = self.cache.device
        self.tokens = np.zeros(capacity, dtype=np.int64)  # each row's next input
        # (what the step reads: the same memory on the CPU, a copy made each step on a GPU)
        self._token = torch.from_numpy(self.tokens) if self.device.type == "cpu" \
            else torch.zeros(capacity, dtype=torch.int64, device=self.device)
        self._staged: Optional[Tensor] = None
        self._prompts: list = []                          # (state, logits) of each staged
        self._selected = 0
        self._stagings: dict = {}                         # rows -> a cache (prefill_many)
        self._initial = self.staging.read_row(0)          # (the state before any id)
        self._logits: tuple = ()

    def prefill(self, context: Tensor) -> None:
        """Stage one prompt, ``context`` ``(1, P)`` (:meth:`prefill_many` of one)."""
        self.prefill_many([context])

    def prefill_many(self, contexts: list) -> None:
        """Stage the prompts ``contexts`` (each ``(1, P)``, on any device; at least one): the
        state after each and its last logits, as ``generate``'s prefill leaves them;
        the first selected (:meth:`select`) for :meth:`draw_staged` and :meth:`place`.

        With a decoder whose prefill may be cut anywhere (:class:`Extendable`) the prompts
        run together, each from the state after its longest prefix in the prefix cache (if
        any) and cut where the cache keeps states: in rounds, each one call of
        ``extend`` over the prompts not yet done, as many positions as the nearest cut
        (all of a batch of prompts of one length: one call). A row's state and logits are
        the same bits at any batch and any cut, so each prompt's are its own prefill's.
        Other decoders prefill the prompts one after another at batch 1."""
        pending = [self.begin(context) for context in contexts]
        self._run(pending)
        self._prompts = [(p.state, p.logits) for p in pending]
        self.select(0)

    def begin(self, context: Tensor) -> "Pending":
        """Start prefilling ``context`` ``(1, P)`` in pieces (:meth:`advance`): from the
        state after its longest prefix in the prefix cache, looked up when its first piece
        runs (so a prompt that waits behind others with the same prefix starts from their
        states). A decoder that cannot be cut (not :class:`Extendable`) prefills it whole
        now."""
        context = context.to(self.device)
        if not isinstance(self.decoder, Extendable):
            logits = self.decoder.prefill(context, self.staging)
            return Pending(context, b"", Plan(context.shape[1], (self.staging.read_row(0),
                                                                  logits), []), self._initial)
        key = key_of(context[0].cpu().numpy()) if self.prefix_cache is not None else b""
        return Pending(context, key, None, self._initial)

    def _plan(self, pending: "Pending") -> None:
        """Where ``pending`` starts (its longest prefix in the prefix cache now) and where
        it stops to keep states."""
        cache = self.prefix_cache
        n = pending.context.shape[1]
        plan = cache.plan(pending.key) if cache is not None else Plan(0, None, [n])
        pending.at, pending.todo = plan.start, list(plan.cuts)
        if plan.value is not None:
            pending.state, pending.logits = plan.value

    def uncached(self, context: Tensor) -> int:
        """How many ids of ``context`` ``(1, P)`` a prefill would run now: those past its
        longest prefix in the prefix cache (all ``P`` without a cache)."""
        n = context.shape[1]
        if self.prefix_cache is None:
            return n
        return n - self.prefix_cache.cached(key_of(context[0].cpu().numpy()))

    def advance(self, pending: "Pending", budget: int) -> bool:
        """Prefill at most ``budget`` (>= 1) more ids of ``pending``; True when its prompt is
        all in, then it is the staged prompt (:meth:`draw_staged`, :meth:`place`). Its state
        and logits are those of its whole prefill at once (:class:`Extendable`)."""
        self._run([pending], budget)
        if pending.todo:
            return False
        self._prompts = [(pending.state, pending.logits)]
        self.select(0)
        return True

    def select(self, index: int) -> None:
        """Make the prompt ``index`` of the last :meth:`prefill_many` the staged one."""
        self._selected = index
        self._staged = self._prompts[index][1]

    def _run(self, pending: list, budget: Optional[int] = None) -> None:
        """Advance ``pending`` prompts together by at most ``budget`` ids each (``None``: to
        their ends), keeping states in the prefix cache at their plans' cuts."""
        cache, spent = self.prefix_cache, 0
        for p in pending:
            if p.todo is None:
                self._plan(p)
        while budget is None or spent < budget:
            active = [p for p in pending if p.todo]
            if not active:
                return
            length = min(p.todo[0] - p.at for p in active)
            if budget is not None:
                length = min(length, budget - spent)
            spent += length
            work = self._stagings.get(len(active))
            if work is None:
                work = self._stagings[len(active)] = self.decoder.allocate_cache(len(active))
            for row, p in enumerate(active):
                work.write_row_(row, p.state)
            out = self.decoder.extend(torch.cat([p.context[:, p.at:p.at + length]
                                                 for p in active]), work)
            for row, p in enumerate(active):
                p.at += length
                p.state, p.logits = work.read_row(row), out[row:row + 1].clone()
                if p.at == p.todo[0]:
                    p.todo.pop(0)
                    if cache is not None:
                        size = sum(t.numel() * t.element_size() for t in (*p.state, p.logits))
                        cache.store(p.key[:p.at * ID_BYTES], (p.state, p.logits), size)

    def draw_staged(self, sampling: Sampling) -> int:
        """The first id of the stream just prefilled, drawn from its prompt's logits."""
        return self.decoder.draw(self._staged, sampling, self.forbidden).item()

    def place(self, row: int) -> None:
        """Copy the staged prompt's state into ``row``."""
        self.cache.write_row_(row, self._prompts[self._selected][0])

    def move(self, src: int, dst: int) -> None:
        """Row ``src``'s state (and next input) into row ``dst``."""
        self.cache.write_row_(dst, self.cache.read_row(src))
        self.tokens[dst] = self.tokens[src]

    def step(self, n: int) -> None:
        """Advance rows ``[0, n)`` by their ``tokens`` (the decoder may step every row)."""
        if self.device.type != "cpu":
            self._token.copy_(torch.from_numpy(self.tokens))
        self._logits = self.decoder.step_(self._token, self.cache, rows=n)[:n]

    def draw(self, row: int, sampling: Sampling) -> int:
        """Row ``row``'s next id, from the logits of the last step."""
        return self.decoder.draw(self._logits[row:row + 1], sampling, self.forbidden).item()

    def draw_rows(self, samplings: Sequence[Optional[Sampling]]) -> list:
        """The next id of each of the last step's rows ``[0, n)``, ``samplings[i]`` row
        ``i``'s settings and generator (``None``: skipped, its entry ``None``), in one call
        of the decoder's draw: per row the id :meth:`draw` would give it, or the
        ``ValueError`` its draw raises (NaN logits)."""
        ids = self.decoder.draw(self._logits, samplings, self.forbidden).tolist()
        out: list = [None] * len(samplings)
        for row, (token, sampling) in enumerate(zip(ids, samplings)):
            if sampling is None:
                continue
            if token < 0:           # (drawn alone, the row raises the draw's ValueError)
                try:
                    token = self.draw(row, sampling)
                except ValueError as exc:
                    token = exc
            out[row] = token
        return out

    def logits(self, row: Optional[int] = None) -> Tensor:
        """The logits ``(1, V)`` that row ``row``'s last draw read (``None``: the prompt just
        prefilled), until the next step or prefill: what a request's ``logprobs`` are of."""
        return self._staged if row is None else self._logits[row:row + 1]


class Pending:
    """A prompt being prefilled in pieces (:meth:`DecoderRows.begin`): its ids ``context``
    ``(1, P)`` and prefix-cache ``key``, the ids in so far (``at``), the cuts still to reach
    (``todo``, ascending, the last ``P``: empty when done; ``None`` until its plan is made,
    at its first piece), and the state and last logits after ``at`` ids."""

    def __init__(self, context: Tensor, key: bytes, plan: Optional[Plan], initial: tuple):
        self.context, self.key = context, key
        self.at, self.todo = (0, None) if plan is None else (plan.start, list(plan.cuts))
        self.state, self.logits = plan.value if plan is not None and plan.value is not None \
            else (initial, None)


@runtime_checkable
class PiecewiseRows(Protocol):
    """Rows that prefill a prompt in pieces across steps (:class:`DecoderRows`: the
    engine's ``prefill_chunk``). Optional: ``uncached(context) -> int``, the ids a prefill
    of ``context`` would run now (past a cached prefix); without it, the prompt's length."""

    def begin(self, context: Tensor) -> Pending: ...
    def advance(self, pending: Pending, budget: int) -> bool: ...


def make_rows(model: ByteLM, weights: object, capacity: int,
              prefix_cache_bytes: int = 0) -> DecoderRows:
    """The rows of ``capacity`` streams for ``model`` with ``weights`` as
    ``ByteLM.generate`` takes it (``model.decoder(weights)``), with a prefix cache of
    ``prefix_cache_bytes`` (0: none; used only with a decoder that may be cut anywhere)."""
    cache = PrefixCache(prefix_cache_bytes) if prefix_cache_bytes else None
    return DecoderRows(model.decoder(weights), capacity, model.config.bos_token, cache)
