"""The server's prefix cache: the decoder states after prompts already seen, so that a new
prompt starts from the state after its longest cached prefix and only the rest is prefilled
(``--prefix-cache-mb``; :class:`fastrwa.serve.rows.DecoderRows` drives it at admission).

A recurrent model's state after ``k`` ids is the same size whatever ``k`` (an RDA/RWA block
keeps ``3 x d_model`` floats and its previous input): a state can be kept at any id, not on a
grid of blocks. What is kept for a prompt being prefilled, at the ids (its cuts) where its
prefill is split:

* the end of the prompt (the next request with the same prompt prefills nothing);
* its branch point: the longest prefix it shares with a prompt seen before (a system
  prompt, a document asked several questions), so that every later prompt sharing it hits
  there, at whatever id the prompts part;
* every ``every`` ids (a grid), so that the first prompt to part from an earlier one
  already starts within ``every`` ids of the branch.

Keys are exact (the ids themselves: a dict of byte strings, whose lookup compares the keys
in full after the hash), looked up by the longest stored key that is a prefix of the prompt.
Values are opaque here (the rows store a row's state and the logits after it) with their
size in bytes; the least recently used are evicted past ``capacity`` bytes. A hit cannot
change a stream's bytes only if the decoder's prefill may be cut anywhere bit for bit
(:class:`fastrwa.models.decoding.Extendable`): the rows use a cache with such a decoder only.

Example:
    >>> cache = PrefixCache(capacity=1 << 20, every=4)
    >>> plan = cache.plan(key_of([1, 2, 3, 4, 5, 6]))       # (nothing stored yet)
    >>> plan.start, plan.cuts
    (0, [4, 6])
    >>> for cut in plan.cuts:
    ...     cache.store(key_of([1, 2, 3, 4, 5, 6][:cut]), f"state after {cut}", 100)
    >>> plan = cache.plan(key_of([1, 2, 3, 4, 5, 9, 9]))    # (parts from it after 5 ids)
    >>> plan.start, plan.value, plan.cuts
    (4, 'state after 4', [5, 7])
"""

from __future__ import annotations

import bisect
import collections
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

ID_BYTES = 2        # (a key holds each id as 2 bytes, big-endian: ids 0..256, BOS included)


def key_of(ids: Sequence[int] | np.ndarray) -> bytes:
    """The key of a prompt ``ids`` (ints in ``[0, 65536)``): ``ID_BYTES`` bytes an id, so the
    key of the prompt's first ``k`` ids is ``key[:k * ID_BYTES]``."""
    return np.asarray(ids, dtype=">u2").tobytes()


class Plan(NamedTuple):
    """How to prefill a prompt: from the stored ``value`` after its first ``start`` ids
    (``None`` and 0: from the initial state), then in pieces ending at each of ``cuts``
    (ascending, the last the prompt's length unless ``start`` is; empty when the whole prompt
    was stored), storing the state after each."""

    start: int
    value: Any
    cuts: list


class PrefixCache:
    """States after prompts' prefixes (module doc), at most ``capacity`` bytes of them (an
    int >= 0), with a state kept every ``every`` ids (an int >= 1) of a prompt prefilled.
    Counters: ``queries`` (prompts planned), ``hits`` (of them, started from a stored state),
    ``ids_saved`` (ids not prefilled thanks to one), ``ids_prefilled``, ``evictions``."""

    def __init__(self, capacity: int, every: int = 1024):
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0 (bytes), got {capacity!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1 (ids), got {every!r}")
        self.capacity, self.every = capacity, every
        self._entries: collections.OrderedDict[bytes, tuple[Any, int]] = \
            collections.OrderedDict()               # key -> (value, bytes); oldest use first
        self._sorted: list[bytes] = []              # the keys in order (branch points)
        self._lengths: collections.Counter[int] = collections.Counter()   # key lengths
        self.nbytes = 0
        self.queries = self.hits = self.ids_saved = self.ids_prefilled = self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def plan(self, key: bytes) -> Plan:
        """The plan of the prompt of ``key`` (:func:`key_of`, at least one id); counts a
        query, and a hit if it starts from a stored state (marked as used)."""
        n = len(key) // ID_BYTES
        shared = self._shared(key)
        start, value = self._longest(key, shared)
        if value is not None:
            self._entries.move_to_end(key[:start * ID_BYTES])
        cuts = {n} | set(range((start // self.every + 1) * self.every, n, self.every))
        if start < shared < n:
            cuts.add(shared)
        self.queries += 1
        self.hits += value is not None
        self.ids_saved += start
        self.ids_prefilled += n - start
        return Plan(start, value, sorted(c for c in cuts if c > start))

    def cached(self, key: bytes) -> int:
        """How many ids of the prompt of ``key`` its longest stored prefix covers (0: none);
        a look only (no query counted, nothing marked as used)."""
        return self._longest(key, self._shared(key))[0]

    def _longest(self, key: bytes, shared: int) -> tuple[int, Any]:
        """The longest stored prefix of ``key`` no longer than ``shared`` ids: its length in
        ids and its value (0 and ``None``: none)."""
        for length in sorted((k for k in self._lengths if k <= shared * ID_BYTES),
                             reverse=True):
            found = self._entries.get(key[:length])
            if found is not None:
                return length // ID_BYTES, found[0]
        return 0, None

    def _shared(self, key: bytes) -> int:
        """The most ids ``key`` shares with a stored key (its neighbours in order have it)."""
        i = bisect.bisect_left(self._sorted, key)
        best = 0
        for other in self._sorted[max(0, i - 1):i + 1]:
            best = max(best, _common(key, other) // ID_BYTES)
        return best

    def store(self, key: bytes, value: Any, nbytes: int) -> None:
        """Keep ``value`` (``nbytes`` bytes) as the state after the prompt of ``key``,
        evicting the least recently used past the capacity (a value larger than it is not
        kept); a key already stored is marked as used, its value kept. The key's own bytes
        count against the capacity too (a long prompt's key can weigh as much as a state)."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        nbytes += len(key)
        if nbytes > self.capacity:
            return
        while self.nbytes + nbytes > self.capacity:
            old, (_, size) = self._entries.popitem(last=False)
            self._forget(old, size)
            self.evictions += 1
        self._entries[key] = (value, nbytes)
        bisect.insort(self._sorted, key)
        self._lengths[len(key)] += 1
        self.nbytes += nbytes

    def _forget(self, key: bytes, size: int) -> None:
        del self._sorted[bisect.bisect_left(self._sorted, key)]
        self._lengths[len(key)] -= 1
        if not self._lengths[len(key)]:
            del self._lengths[len(key)]
        self.nbytes -= size

    def clear(self) -> None:
        """Forget every state (the counters are kept)."""
        self._entries.clear()
        self._sorted.clear()
        self._lengths.clear()
        self.nbytes = 0


def _common(a: bytes, b: bytes) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (bytes)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    x = np.frombuffer(a, np.uint8, n) != np.frombuffer(b, np.uint8, n)
    return int(np.argmax(x))


def megabytes(value: Optional[float]) -> int:
    """``--prefix-cache-mb`` in bytes (``None`` or 0: no cache)."""
    return int((value or 0) * 2 ** 20)


__all__ = ["PrefixCache", "Plan", "key_of", "megabytes"]
