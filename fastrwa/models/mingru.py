"""The minGRU baseline of the language-model comparison ("Were RNNs All We Needed?", Feng et
al. 2024): a GRU whose gates see the input only, run as a log-space parallel scan in PyTorch,
stacked in the same pre-norm blocks (norm, MLP, residuals), embedding, final norm and tied
head as :class:`fastrwa.models.ByteLM`.

    z_t = sigmoid(W_z x_t)      h~_t = g(W_h x_t)
    g(v) = v + 1/2 (v >= 0), sigmoid(v) (v < 0)
    h_t = (1 - z_t) * h_{t-1} + z_t * h~_t

``g`` keeps ``h~`` positive, so ``log h_t`` is a cumulative log-sum-exp (:func:`min_gru_scan`;
tests/models/test_baselines.py checks it against the recurrence, one step at a time).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .checks import check_tokens
from .config import LMConfig
from .sampling import Sampler
from .stack import stacked_parts


CHUNK = 512           # steps of min_gru_scan's log-space scan read at once


def log_g(v: Tensor) -> Tensor:
    """``log g(v)``: ``log(v + 1/2)`` for ``v >= 0``, ``log sigmoid(v)`` below."""
    return torch.where(v >= 0, torch.log(F.relu(v) + 0.5), -F.softplus(-v))


def min_gru_scan(k: Tensor, v: Tensor, h0: Optional[Tensor] = None) -> Tensor:
    """Every ``h_t`` of minGRU, ``(B, T, D)``, from the gate and candidate pre-activations
    ``k``, ``v`` ``(B, T, D)`` and the state before the first step ``h0`` ``(B, D)``
    (positive; ``None``: zero), as the paper's log-space scan:
    ``log h_t = a_t + logcumsumexp_s(log b_s - a_s)`` with ``a_t = sum_{s<=t} log(1 - z_s)``
    and ``b_s = z_s h~_s`` (``h0`` enters as ``b_0`` with ``a_0 = 0``).

    It computes in float32 (or float64 for float64 inputs) whatever the inputs' dtype or an
    autocast region, and returns that dtype. ``exp(a)`` and ``exp(-a)`` meet in the product,
    so the rounding error grows with the length scanned at once (in float32 about ``1e-7``
    per step, relative): the scan runs in chunks of ``CHUNK`` steps, each from the state the
    one before ended in, which bounds it (tests/models/test_baselines.py: 1e-4 at T = 4000)."""
    dtype = torch.float64 if k.dtype == torch.float64 else torch.float32
    h = None if h0 is None else h0.to(dtype)
    out = []
    with torch.autocast(k.device.type, enabled=False):
        for lo in range(0, k.shape[1], CHUNK):
            out.append(_scan(k[:, lo:lo + CHUNK].to(dtype), v[:, lo:lo + CHUNK].to(dtype), h))
            h = out[-1][:, -1]
    return torch.cat(out, dim=1) if out else k.new_empty(k.shape, dtype=dtype)


def _scan(k: Tensor, v: Tensor, h0: Optional[Tensor]) -> Tensor:
    log_coeffs = -F.softplus(k)                                   # log(1 - z)   [B, T, D]
    log_values = -F.softplus(-k) + log_g(v)                       # log(z h~)    [B, T, D]
    if h0 is not None:
        log_coeffs = F.pad(log_coeffs, (0, 0, 1, 0))
        log_values = torch.cat([torch.log(h0)[:, None], log_values], dim=1)
    a = torch.cumsum(log_coeffs, dim=1)                           # [B, T(+1), D]
    h = torch.exp(a + torch.logcumsumexp(log_values - a, dim=1))
    return h if h0 is None else h[:, 1:]


class MinGRU(nn.Module):
    """A minGRU layer of width ``d``: ``(k, v) = W x`` (no bias), the scan, an output
    projection. ``y, h_last = layer(x (B, T, d), h (B, d) or None)``."""

    def __init__(self, d: int):
        super().__init__()
        self.proj = nn.Linear(d, 2 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, h: Optional[Tensor] = None) -> tuple[Tensor, Optional[Tensor]]:
        k, v = self.proj(x).chunk(2, dim=-1)
        if x.shape[1] == 0:                      # no step: the state is unchanged
            return self.out(k), h
        states = min_gru_scan(k, v, h)
        return self.out(states.to(x.dtype)), states[:, -1]


class MinGRUBlock(nn.Module):
    """Pre-norm -> minGRU -> residual -> pre-norm -> MLP -> residual (ByteLM's block with
    minGRU as the mixing layer and no output gate)."""

    def __init__(self, config: LMConfig):
        super().__init__()
        d = config.d_model
        self.norm1 = nn.RMSNorm(d)
        self.mix = MinGRU(d)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, config.mlp_ratio * d), nn.GELU(),
                                 nn.Linear(config.mlp_ratio * d, d))

    def forward(self, x: Tensor, h: Optional[Tensor]) -> tuple[Tensor, Optional[Tensor]]:
        y, h = self.mix(self.norm1(x), h)
        x = x + y
        return x + self.mlp(self.norm2(x)), h


class MinGRULM(Sampler, nn.Module):
    """Byte-level LM: embedding -> ``n_layers`` :class:`MinGRUBlock` -> RMSNorm -> head
    (tied to the embedding with ``tie_embeddings``); ``config.layer`` is "mingru".

    ``logits, state = model(tokens, state=None)``: ``tokens`` ``(B, T)`` ids, logits
    ``(B, T, vocab_size)``; ``state`` is a tuple of one ``(B, d_model)`` hidden state per
    block (positive, float32), carried to the next call to continue the stream. An empty
    input (``T = 0``) gives back the state it was given.

    Example:
        >>> import torch
        >>> from fastrwa.models import LMConfig, MinGRULM
        >>> model = MinGRULM(LMConfig(layer="mingru", d_model=32, n_layers=2))
        >>> logits, state = model(torch.randint(0, 256, (2, 16)))
        >>> logits.shape, len(state), state[0].shape
        (torch.Size([2, 16, 257]), 2, torch.Size([2, 32]))
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        if config.layer != "mingru":
            raise ValueError(f"MinGRULM needs LMConfig.layer 'mingru', got {config.layer!r}")
        self.config = config
        self.embed, self.blocks, self.norm, self.head = stacked_parts(config, MinGRUBlock)

    def forward(self, tokens: Tensor, state: Optional[tuple] = None) -> tuple[Tensor, tuple]:
        """Logits ``(B, T, vocab_size)`` and the state after the last position."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        self._check_state(state, tokens.shape[0])
        x = self.embed(tokens)
        if tokens.shape[1] == 0:
            return self.head(self.norm(x)), state
        new = []
        for block, h in zip(self.blocks, state or (None,) * len(self.blocks)):
            x, h = block(x, h)
            new.append(h)
        return self.head(self.norm(x)), tuple(new)

    def _check_state(self, state: Optional[tuple], batch: int) -> None:
        if state is None:
            return
        n, d = len(self.blocks), self.config.d_model
        if not isinstance(state, (tuple, list)) or len(state) != n:
            raise ValueError(f"state must be a tuple of {n} ({batch}, {d}) tensors (one per "
                             f"block), as forward returned it, got {type(state).__name__}"
                             + (f" of {len(state)}" if isinstance(state, (tuple, list)) else ""))
        for i, h in enumerate(state):
            if not isinstance(h, Tensor) or not h.is_floating_point():
                raise TypeError(f"state[{i}] must be a floating-point tensor ({batch}, {d}), "
                                f"got {type(h).__name__ if not isinstance(h, Tensor) else h.dtype}")
            if tuple(h.shape) != (batch, d):
                raise ValueError(f"state[{i}] must have shape ({batch}, {d}) (batch, d_model), "
                                 f"got {tuple(h.shape)}")
        if torch.compiler.is_compiling():
            return
        negative = torch.stack([(h < 0).any() for h in state])     # one host sync per call
        if bool(negative.any()):                                   # (it runs every decode step)
            i = int(negative.nonzero()[0])
            raise ValueError(f"state[{i}] must be >= 0 (minGRU's states are positive; its "
                             f"scan reads their logarithm), got a minimum of "
                             f"{float(state[i].min())}")
