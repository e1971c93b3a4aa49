"""ByteLM's streaming step replayed from a CUDA graph: what ``generate``/``stream`` run on
CUDA by default (``weights="auto"``), so a token costs one graph launch instead of a few
dozen kernel launches from Python. ``ByteLM.step_`` (``weights="eager"``) stays the
reference: the graph holds exactly its kernels, on the same buffers.
"""

from __future__ import annotations

from typing import Iterator, Optional, Protocol

import torch
from torch import Tensor

from .cache import InferenceCache
from .config import LMConfig
from .decoding import Sampling, check_rows, draw_and_step, draw_sampled

# Eager steps run before a capture (Triton compiles its kernels, cuBLAS picks its workspace
# there: neither may happen inside a capture); their effect on the state is undone.
WARMUP_STEPS = 2


class Capturable(Protocol):
    """What :class:`CUDAGraphDecoder` captures (a :class:`fastrwa.models.ByteLM` on CUDA):
    its configuration (the BOS id), caches, prefill and in-place step, whose range check of
    the ids (a read back to the host) can be turned off."""

    config: LMConfig

    def allocate_cache(self, batch: int) -> InferenceCache: ...
    def prefill(self, tokens: Tensor, cache: InferenceCache) -> Tensor: ...
    def step_(self, token: Tensor, cache: InferenceCache, check: bool = True) -> Tensor: ...


class CUDAGraphDecoder:
    """The decoder of :meth:`ByteLM.generate` on CUDA: the prompt through
    :meth:`ByteLM.prefill`, each token through one replay of a graph of
    ``ByteLM.step_(token, cache, check=False)`` captured for that cache (on its first step).

    The graph reads the token from a buffer of its own and writes the logits into the
    cache's work buffer, as the eager step does; the cache's state advances in place. Tokens
    are not range-checked (they come from the sampler, which draws ids of the vocabulary).
    Each ``generate()`` call captures once (two warm-up steps and a capture, which frees
    PyTorch's cached blocks): a few tokens cost more than eagerly.
    """

    kind = "CUDA graph"

    def __init__(self, model: Capturable):
        self.model = model
        self._cache = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._token: Tensor | None = None
        self._logits: Tensor | None = None

    # -- the decoder contract (fastrwa.models.decoding.Decoder) --------------------------
    def allocate_cache(self, batch: int) -> InferenceCache:
        """The model's cache of ``batch`` rows."""
        return self.model.allocate_cache(batch)

    def prefill(self, tokens: Tensor, cache: InferenceCache) -> Tensor:
        """The model's parallel prefill (no graph)."""
        return self.model.prefill(tokens, cache)

    def step_(self, token: Tensor, cache: InferenceCache, *,
              rows: Optional[int] = None) -> Tensor:
        """One replay of the graph captured for ``cache``: every row advances (a graph has
        a fixed batch; ``rows`` is checked, and the rows past it step too)."""
        if rows is not None:
            check_rows(rows, cache.batch)
        # (on the cache's device: a capture on another current device would record nothing)
        with torch.cuda.device(cache.device):
            if cache is not self._cache:
                self._capture(cache)
            self._token.copy_(token)
            self._graph.replay()
        return self._logits

    def draw(self, logits: Tensor, sampling: Sampling, forbidden: int) -> Tensor:
        """:func:`fastrwa.models.decoding.draw_sampled`."""
        return draw_sampled(logits, sampling, forbidden)

    def sample_steps(self, logits: Tensor, cache: InferenceCache, max_new_tokens: int,
                     temperature: float = 1.0, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                     forbidden: Optional[int] = None) -> Iterator[Tensor]:
        """:meth:`draw` and :meth:`step_` in turn (:func:`fastrwa.models.decoding.draw_and_step`);
        ``forbidden`` defaults to the BOS id."""
        return draw_and_step(self, logits, cache, max_new_tokens, temperature, top_k, top_p,
                             generator, forbidden=self.model.config.bos_token
                             if forbidden is None else forbidden)

    def _capture(self, cache) -> None:
        model = self.model
        self._token = torch.zeros(cache.batch, dtype=torch.int64, device=cache.device)
        saved = [t.clone() for t in cache.stacked]
        side = torch.cuda.Stream(cache.device)
        side.wait_stream(torch.cuda.current_stream(cache.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_STEPS):
                model.step_(self._token, cache, check=False)
        torch.cuda.current_stream(cache.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._logits = model.step_(self._token, cache, check=False)
        for buf, value in zip(cache.stacked, saved):     # the warm-up steps undone
            buf.copy_(value)
        self._graph, self._cache = graph, cache
