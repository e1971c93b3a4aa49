"""The Transformer baseline of the language-model comparison: a nanoGPT-style byte
Transformer (pre-norm blocks of causal ``scaled_dot_product_attention`` with rotary positions
and a GELU MLP, a final RMSNorm, the head tied to the embedding) with a context of
``config.context`` bytes (a run's BPTT).

A stream longer than the context is scored with sliding windows of ``C = context`` bytes
whose starts are ``C // 2`` apart: a byte at position ``i`` of the stream is predicted from
the window starting at ``max(0, (i // (C // 2) - 1) * (C // 2))``, recomputed from nothing,
so it sees between ``C // 2 + 1`` and ``C`` bytes, itself included (all up to it near
the stream's start).
Training windows (``T <= C``, no state) are the first such window. The ``state`` that
``forward`` returns is the stream's bytes since the next window's start; generation keeps a
key/value cache of that window and, when the window moves on, refills it from the bytes the
new window keeps, so that sampling reads the same logits as ``forward``.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from .checks import check_tokens
from .config import LMConfig
from .sampling import Sampler
from .stack import stacked_parts

KV = tuple[Tensor, Tensor]           # keys and values (B, heads, L, head_dim)


def rotate(x: Tensor, start: int) -> Tensor:
    """Rotary position embedding of ``x`` ``(B, H, T, E)`` at positions ``start ..
    start + T - 1`` (pairs of channels ``(j, j + E/2)`` rotated by ``pos / 10000^(2j/E)``),
    computed in float32 (float64 for float64 ``x``) and returned in ``x``'s dtype."""
    dtype, x = x.dtype, x.to(torch.float64 if x.dtype == torch.float64 else torch.float32)
    E, T = x.shape[-1], x.shape[-2]
    freq = 10000.0 ** (-torch.arange(0, E // 2, device=x.device, dtype=x.dtype) * 2 / E)
    angle = torch.arange(start, start + T, device=x.device, dtype=x.dtype)[:, None] * freq
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)          # [T, E/2]
    x1, x2 = x[..., :E // 2], x[..., E // 2:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(dtype)


class SelfAttention(nn.Module):
    """Causal multi-head self-attention with rotary positions; ``past`` (keys and values of
    the positions before ``x``, at positions ``0 ..``) for cached decoding."""

    def __init__(self, d: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, past: Optional[KV] = None) -> tuple[Tensor, KV]:
        q, k, v = rearrange(self.qkv(x), "b t (three h e) -> three b h t e", three=3,
                            h=self.n_heads)
        start = 0 if past is None else past[0].shape[2]
        q, k = rotate(q, start), rotate(k, start)
        if past is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
            T = q.shape[2]        # query i (at start + i) sees keys 0 .. start + i
            allowed = torch.arange(start + T, device=x.device)[None] <= \
                torch.arange(start, start + T, device=x.device)[:, None]        # [T, start+T]
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(rearrange(y, "b h t e -> b t (h e)")), (k, v)


class TransformerBlock(nn.Module):
    """Pre-norm -> causal self-attention -> residual -> pre-norm -> MLP -> residual."""

    def __init__(self, config: LMConfig):
        super().__init__()
        d = config.d_model
        self.norm1 = nn.RMSNorm(d)
        self.attn = SelfAttention(d, config.n_heads)
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, config.mlp_ratio * d), nn.GELU(),
                                 nn.Linear(config.mlp_ratio * d, d))

    def forward(self, x: Tensor, past: Optional[KV] = None) -> tuple[Tensor, KV]:
        y, kv = self.attn(self.norm1(x), past)
        x = x + y
        return x + self.mlp(self.norm2(x)), kv


class TransformerLM(Sampler, nn.Module):
    """Byte-level Transformer: embedding -> ``n_layers`` :class:`TransformerBlock` (``n_heads``
    heads, rotary positions) -> RMSNorm -> head (tied with ``tie_embeddings``);
    ``config.layer`` is "transformer", the context ``config.context`` bytes.

    ``logits, state = model(tokens, state=None)``: ``tokens`` ``(B, T)`` ids, logits
    ``(B, T, vocab_size)`` from sliding windows (the module's docstring); ``state`` the
    ``(B, L)`` ids (``L < context``) since the next window's start, to continue the stream.
    A trainer does not carry it across training windows (``carries_state_in_training``):
    each window is trained from nothing, as nanoGPT does.

    Example:
        >>> import torch
        >>> from fastrwa.models import LMConfig, TransformerLM
        >>> model = TransformerLM(LMConfig(layer="transformer", d_model=32, n_layers=2,
        ...                                n_heads=2, context=8))
        >>> logits, state = model(torch.randint(0, 256, (2, 20)))
        >>> logits.shape, state.shape
        (torch.Size([2, 20, 257]), torch.Size([2, 4]))
    """

    carries_state_in_training = False

    def __init__(self, config: LMConfig):
        super().__init__()
        if config.layer != "transformer":
            raise ValueError(f"TransformerLM needs LMConfig.layer 'transformer', "
                             f"got {config.layer!r}")
        self.config = config
        self.embed, self.blocks, self.norm, self.head = stacked_parts(config, TransformerBlock)

    @property
    def stride(self) -> int:
        """Bytes between the starts of consecutive windows: half the context."""
        return self.config.context // 2

    def _window(self, tokens: Tensor) -> Tensor:
        """Logits of windows ``(N, W)`` (``W <= context``) read from nothing."""
        x = self.embed(tokens)
        for block in self.blocks:
            x, _ = block(x)
        return self.head(self.norm(x))

    def forward(self, tokens: Tensor, state: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
        """Logits ``(B, T, vocab_size)`` and the state: the ids since the next window's start."""
        tokens = check_tokens(tokens, self.config.vocab_size)
        if state is not None:
            state = check_tokens(state, self.config.vocab_size, name="state")
            if state.shape[0] != tokens.shape[0] or state.shape[1] >= self.config.context:
                raise ValueError(f"state must be the (B, L < context) ids that forward returned "
                                 f"for these {tokens.shape[0]} rows (context "
                                 f"{self.config.context}), got {tuple(state.shape)}")
        stream = tokens if state is None else torch.cat([state, tokens], dim=1)   # [B, N]
        B, N = stream.shape
        S, before = self.stride, N - tokens.shape[1]
        if N <= 2 * S:                              # one window from the stream's start
            logits = self._window(stream)
        else:                                       # windows w = 0 .. n-2 start at w * S
            n = -(-N // S)                          # strides of S covering the stream
            padded = F.pad(stream, (0, n * S - N))
            windows = padded.unfold(1, 2 * S, S)                        # [B, n - 1, 2S]
            out = self._window(rearrange(windows, "b w t -> (b w) t"))
            out = out.reshape(B, windows.shape[1], 2 * S, out.shape[-1])    # [B, n - 1, 2S, V]
            # window 0 scores its 2S positions, window w >= 1 its second half
            logits = torch.cat([out[:, 0], rearrange(out[:, 1:, S:], "b w t v -> b (w t) v")],
                               dim=1)[:, :N]
        return logits[:, before:], stream[:, max(0, (N // S - 1) * S):]

    def _decoder(self, context: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """:meth:`Sampler._decoder` with a key/value cache of the current window (refilled
        from the bytes the window keeps when it moves on), so that sampling reads the
        logits of ``forward``."""
        logits, window = self(context)
        cache = self._prefill(window)

        def step(token: Tensor) -> Tensor:
            nonlocal window, cache
            if window.shape[1] == 2 * self.stride:            # the next window starts
                window = window[:, self.stride:]
                cache = self._prefill(window)
            window = torch.cat([window, token[:, None]], dim=1)
            logits, cache = self._extend(token[:, None], cache)
            return logits[:, -1]
        return logits[:, -1], step

    def _prefill(self, window: Tensor) -> list:
        """Per block, the keys and values of ``window`` ``(B, L)`` read from its start."""
        return self._extend(window, [None] * len(self.blocks))[1]

    def _extend(self, tokens: Tensor, cache: list) -> tuple[Tensor, list]:
        """Logits of ``tokens`` after the cached window, and the cache with them."""
        x = self.embed(tokens)
        new = []
        for block, past in zip(self.blocks, cache):
            x, kv = block(x, past)
            new.append(kv)
        return self.head(self.norm(x)), new
