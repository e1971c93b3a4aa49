"""The log-probability the model gives each token of a sequence, given the tokens before it:
:func:`score`, from :meth:`ByteLM.forward` (the parallel forward, in the model's own dtype)
and a float64 ``log_softmax`` of its logits over the whole vocabulary (the 256 bytes and
BOS), as a harness scoring a text computes it; :func:`scores_of`, the same of the logits a
decoder's step gave (what a generated token was drawn from).

A sequence is scored in one call or in pieces: ``score(model, more, past=earlier)`` carries
``earlier``'s state, so its first token is scored given everything before it. The first
token of a sequence with no past has no log-probability (NaN): start a text with the BOS id
(``model.config.bos_token``, 256) to score its first byte, as the byte tokenizer does for an
empty text, lm-eval's rolling windows do with their prefix token and ``ByteLM.generate``
does with an empty prompt. BOS may appear anywhere (a document boundary): it is one more
id the model reads.

Example:
    >>> import torch
    >>> from fastrwa.models import ByteLM, LMConfig
    >>> from fastrwa.models.scoring import score
    >>> model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    >>> whole = score(model, [256, *b"hi there"], top=2)
    >>> whole.logprobs.shape, whole.logprobs.dtype, bool(whole.logprobs[0].isnan())
    (torch.Size([9]), torch.float64, True)
    >>> whole.top_ids.shape            # (T, top): the most likely ids at each position
    torch.Size([9, 2])
    >>> first = score(model, [256, *b"hi "])
    >>> rest = score(model, b"there", past=first)
    >>> torch.allclose(torch.cat([first.logprobs, rest.logprobs]), whole.logprobs, equal_nan=True)
    True
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import torch
from torch import Tensor

from .cache import LMState
from .lm import ByteLM


@dataclasses.dataclass
class Scores:
    """What :func:`score` returns for a sequence of ``T`` tokens (on the CPU).

    ``logprobs`` ``(T,)`` float64: each token's log-probability given the tokens before it
    (NaN for a first token with no past); ``top_ids`` ``(T, top)`` int64 and
    ``top_logprobs`` ``(T, top)`` float64: at each position the ``top`` most likely ids
    and their log-probabilities, most likely first (NaN rows for a first token with no
    past); ``state``: the model's state after the last token, and ``next_logprobs``
    ``(V,)`` float64: the distribution of the token after it (what the next piece's first
    token is scored by; ``None`` when ``T`` is 0 and there was no past)."""

    logprobs: Tensor
    top_ids: Tensor
    top_logprobs: Tensor
    state: Optional[LMState]
    next_logprobs: Optional[Tensor]


@torch.no_grad()
def score(model: ByteLM, tokens: Sequence[int], top: int = 0,
          past: Optional[Scores] = None) -> Scores:
    """The log-probability of each of ``tokens`` (ids in ``[0, vocab_size)``: bytes and
    BOS) given the ones before it, and after ``past`` (a :func:`score` of what comes
    before, or ``None``: the sequence starts here), from ``model``'s forward (module doc).
    ``top``: how many of the most likely ids to return at each position (0 or more, at
    most the vocabulary). ``tokens`` may be empty (then only ``past`` is carried).

    Example::

        >>> from fastrwa.models import LMConfig
        >>> s = score(ByteLM(LMConfig(d_model=8, n_layers=1)), [256, 104, 105])
        >>> s.logprobs.tolist()[0], len(s.logprobs)
        (nan, 3)
    """
    V = model.config.vocab_size
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= V:
        raise ValueError(f"top must be an int in [0, {V}], got {top!r}")
    ids = torch.as_tensor(list(tokens), dtype=torch.int64)
    T = ids.numel()
    state = past.state if past is not None else None
    before = past.next_logprobs if past is not None else None
    if T == 0:
        return Scores(torch.empty(0, dtype=torch.float64), torch.empty(0, top, dtype=torch.int64),
                      torch.empty(0, top, dtype=torch.float64), state, before)
    device = model.embed.weight.device
    logits, state = model(ids.to(device)[None], state)
    after = logits[0].double().log_softmax(-1).cpu()            # (T, V): of the next token
    # row t: the distribution token t is drawn from (the past's last one for t = 0)
    nan_row = torch.full((1, V), float("nan"), dtype=torch.float64)
    dist = torch.cat([before[None] if before is not None else nan_row, after[:-1]])
    logprobs, top_ids, top_logprobs = _pick(dist, ids, top)
    if before is None and top:                  # (no past: no alternatives either)
        top_ids[0] = -1
    return Scores(logprobs, top_ids, top_logprobs, state, after[-1])


@torch.no_grad()
def scores_of(logits: Tensor, tokens: Sequence[int], top: int = 0) -> tuple:
    """Per row ``i`` of ``logits`` ``(B, V)`` (a step's, on any device): the
    log-probability of ``tokens[i]`` under it (float64 ``log_softmax`` over the whole
    vocabulary: the model's distribution, before temperature, top-k or top-p) and its
    ``top`` most likely ids and their log-probabilities, most likely first: ``(logprobs
    (B,), top_ids (B, top), top_logprobs (B, top))`` on the CPU, as in :class:`Scores`.

    Example::

        >>> lp, ids, top_lp = scores_of(torch.tensor([[0.0, 1.0, 2.0]]), [1], top=1)
        >>> round(float(lp[0]), 4), ids.tolist(), round(float(top_lp[0, 0]), 4)
        (-1.4076, [[2]], -0.4076)
    """
    dist = logits.detach().double().log_softmax(-1).cpu()
    return _pick(dist, torch.as_tensor(list(tokens), dtype=torch.int64), top)


def _pick(dist: Tensor, ids: Tensor, top: int) -> tuple:
    """``dist`` ``(T, V)`` log-probabilities: row ``t``'s of ``ids[t]``, and its ``top``."""
    logprobs = dist.gather(1, ids[:, None])[:, 0]
    if not top:
        T = dist.shape[0]
        return (logprobs, torch.empty(T, 0, dtype=torch.int64),
                torch.empty(T, 0, dtype=torch.float64))
    top_logprobs, top_ids = dist.topk(top, dim=-1)
    return logprobs, top_ids, top_logprobs


__all__ = ["Scores", "score", "scores_of"]
