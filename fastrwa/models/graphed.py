"""ByteLM's streaming step replayed from a CUDA graph: what ``generate``/``stream`` run on
CUDA by default (``weights="auto"``), so a token costs one graph launch instead of a few
dozen kernel launches from Python. ``ByteLM.step_`` (``weights="eager"``) stays the
reference: the graph holds exactly its kernels, on the same buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Eager steps run before a capture (Triton compiles its kernels, cuBLAS picks its workspace
# there: neither may happen inside a capture); their effect on the state is undone.
WARMUP_STEPS = 2


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

    def __init__(self, model):
        self.model = model
        self._cache = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._token: Tensor | None = None
        self._logits: Tensor | None = None

    def prefill(self, context: Tensor, cache) -> Tensor:
        return self.model.prefill(context, cache)

    def step_(self, token: Tensor, cache) -> Tensor:
        # (on the cache's device: a capture on another current device would record nothing)
        with torch.cuda.device(cache.device):
            if cache is not self._cache:
                self._capture(cache)
            self._token.copy_(token)
            self._graph.replay()
        return self._logits

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
