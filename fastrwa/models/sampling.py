"""Sampling one token from logits, and the checks of ``generate``'s arguments (shared by
:class:`fastrwa.models.ByteLM` and the baselines)."""

from __future__ import annotations

from typing import Callable, Iterator, NoReturn, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor

from ..ops import decode_host

# The largest float32: the sampler computes in float32, so a temperature above it is inf
# there (and -inf / inf is NaN: every draw failed with a raw "probability tensor" error).
FLOAT32_MAX = float(torch.finfo(torch.float32).max)


def check_generate_args(prompt: object, vocab_size: int, max_new_tokens: object,
                        temperature: object, top_k: object, top_p: object,
                        beam_size: object) -> None:
    """Raise ``TypeError``/``ValueError`` naming the argument of ``generate`` that is wrong."""
    if not isinstance(prompt, Tensor) or prompt.dim() != 2:
        got = tuple(prompt.shape) if isinstance(prompt, Tensor) else type(prompt).__name__
        raise ValueError(f"prompt must be integer ids of shape (B, P) or (P,), got {got}")
    if prompt.is_floating_point() or prompt.is_complex() or prompt.dtype == torch.bool:
        raise TypeError(f"prompt must hold integer token ids, got dtype {prompt.dtype}")
    if prompt.numel():
        low, high = int(prompt.min()), int(prompt.max())
        if low < 0 or high >= vocab_size:
            raise ValueError(f"prompt must be ids in [0, {vocab_size}), "
                             f"got values in [{low}, {high}]")
    check_sampling_args(max_new_tokens, temperature, top_k, top_p)
    if isinstance(beam_size, bool) or not isinstance(beam_size, int) or beam_size < 1:
        raise ValueError(f"beam_size must be a positive int, got {beam_size!r}")


def check_temperature(temperature: object, name: str = "temperature") -> None:
    """Raise ``ValueError`` naming the argument ``name`` unless ``temperature`` is a number
    in ``(0, FLOAT32_MAX]`` (a temperature too small for float32 is fine: it samples
    greedily, :func:`sample`)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not 0 < temperature <= FLOAT32_MAX:
        raise ValueError(f"{name} must be a finite number > 0 and at most {FLOAT32_MAX!r} "
                         f"(the largest float32: the sampler computes in float32), "
                         f"got {temperature!r}")


def check_sampling_args(max_new_tokens: object, temperature: object, top_k: object,
                        top_p: object) -> None:
    """Raise ``ValueError`` naming the first of ``generate``'s sampling arguments that is
    wrong: ``temperature`` must fit float32 (:func:`check_temperature`), and ``top_p``, at
    most 1, must be a positive float32 too (a smaller one would keep no id)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    check_temperature(temperature)
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    if top_p is not None:
        check_top_p(top_p)


def check_top_p(top_p: object, name: str = "top_p") -> None:
    """Raise ``ValueError`` naming the argument ``name`` unless ``top_p`` is a number in
    ``(0, 1]`` that is not 0 in float32 (a smaller one would keep no id)."""
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1 \
            or torch.tensor(top_p, dtype=torch.float32).item() == 0:
        raise ValueError(f"{name} must be in (0, 1] and at least 1.4e-45 (the smallest "
                         f"float32: the sampler computes in float32), got {top_p!r}")


def prepare_prompt(prompt: object, vocab_size: int, bos_token: int, max_new_tokens: object,
                   temperature: object, top_k: object, top_p: object,
                   beam_size: object) -> tuple[Tensor, Tensor]:
    """Check ``generate``'s arguments; ``(prompt, context)``: the prompt as ``(B, P)`` int64
    ids, and what the model reads first (the prompt, or the BOS id for an empty one)."""
    if isinstance(prompt, Tensor) and prompt.dim() == 1:
        prompt = prompt[None]
    check_generate_args(prompt, vocab_size, max_new_tokens, temperature, top_k, top_p,
                        beam_size)
    prompt = prompt.long()
    context = prompt if prompt.shape[1] else prompt.new_full((prompt.shape[0], 1), bos_token)
    return prompt, context


def collect(prompt: Tensor, tokens: Iterator[Tensor], max_new_tokens: int) -> Tensor:
    """``(B, P + max_new_tokens)``: the prompt, then each ``(B,)`` token of ``tokens``."""
    B, P = prompt.shape
    out = prompt.new_empty((B, P + max_new_tokens))
    out[:, :P] = prompt
    for i, token in enumerate(tokens):
        out[:, P + i] = token
    return out


def sample_loop(logits: Tensor, step: Callable[[Tensor], Tensor], max_new_tokens: int,
                temperature: float, top_k: Optional[int], top_p: Optional[float],
                generator: Optional[torch.Generator], forbidden: int,
                draw: Optional[Callable] = None) -> Iterator[Tensor]:
    """Yield ``max_new_tokens`` tokens ``(B,)``: each sampled from ``logits`` ``(B, V)``, the
    last position's, which ``step(token)`` then advances (not after the last token).
    ``draw``: :func:`sample` (the default) or :func:`sample_fused`."""
    draw = draw or sample
    for i in range(max_new_tokens):
        token = draw(logits, temperature, top_k, top_p, generator, forbidden)
        yield token
        if i + 1 < max_new_tokens:
            logits = step(token)


def check_logits(logits: Tensor, top: Tensor) -> None:
    """Raise ``ValueError`` naming the first row of ``logits`` ``(B, V)`` whose maximum
    ``top`` ``(B, 1)`` is not finite: the model produced NaN or ``+inf`` there, or every
    token is excluded (``-inf``). Nothing could be sampled from such a row (the softmax is
    NaN). One read back to the host."""
    finite = torch.isfinite(top)
    if bool(finite.all()):
        return
    row = int((~finite[:, 0]).nonzero()[0, 0])
    values = logits[row]
    if bool(torch.isnan(values).any()):
        problem = "hold NaN: the model produced NaN (a NaN weight or input, or an overflow)"
    elif bool((values == float("inf")).any()):
        problem = "hold +inf: the model produced an infinite logit (an overflow)"
    else:
        problem = "are all -inf: every token is excluded"
    raise ValueError(f"the logits of row {row} {problem}; no token can be drawn from them")


def sample(logits: Tensor, temperature: float, top_k: Optional[int], top_p: Optional[float],
           generator: Optional[torch.Generator], forbidden: int) -> Tensor:
    """One token per row of ``logits`` ``(B, V)``, never an id ``>= forbidden`` (the BOS id,
    after the 256 bytes: BOS starts a text, and neither it nor any id a larger vocabulary
    adds is a byte, so generated text could not be decoded with them).

    ``softmax(logits / temperature)``, computed as ``(logits - max) / temperature`` so that a
    temperature too small for float32 (the quotient overflows, or the temperature itself
    rounds to 0) gives its limit, the greedy choice (shared among tied maxima), not NaN.
    Logits holding NaN or ``+inf`` are a ``ValueError`` (:func:`check_logits`)."""
    logits = logits.to(torch.float32, copy=True)
    logits[:, forbidden:] = float("-inf")
    top = logits.amax(dim=-1, keepdim=True)
    check_logits(logits, top)
    at_top = logits == top
    # (<= 0 after the shift: a huge quotient is -inf, the limit; 0 / 0 at the top is set to 0)
    logits = logits.sub_(top).div_(temperature).masked_fill_(at_top, 0.0)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p   # keep the first to reach p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


def sample_fused(logits: Tensor, temperature: float, top_k: Optional[int],
                 top_p: Optional[float], generator: Optional[torch.Generator],
                 forbidden: int) -> Tensor:
    """:func:`sample` in one compiled call for contiguous float32 CPU ``logits`` (the fused
    decode step's: ``fastrwa.models.PackedLM``), any other logits by :func:`sample`. The same
    distribution (where top-p cuts among ids of equal probability, it keeps the lower
    ids; the eager sort keeps its own order's first), drawn by the
    inverse of the cumulative weights at one uniform per row from ``generator``: other
    draws than :func:`sample`'s for the same seed. NaN or ``+inf`` logits, or a row with
    every id excluded, are the same ``ValueError``."""
    if not logits.is_cpu or logits.dtype != torch.float32 or not logits.is_contiguous():
        return sample(logits, temperature, top_k, top_p, generator, forbidden)
    B, V = logits.shape
    token = np.empty(B, dtype=np.int64)     # (NumPy arrays: the server draws a row a call)
    draw_fused(logits.numpy().ravel(), B, V, temperature, top_k, top_p, generator, forbidden,
               token, np.empty(V, dtype=np.float32))
    return torch.from_numpy(token)


def draw_fused(logits: np.ndarray, B: int, V: int, temperature: float, top_k: Optional[int],
               top_p: Optional[float], generator: Optional[torch.Generator], forbidden: int,
               out: np.ndarray, scratch: np.ndarray) -> None:
    """The fused path's draw, written once (:func:`sample_fused`, the loop of
    ``PackedLM.sample_steps``, the server's rows through ``PackedLM.draw``): one id per row
    of ``logits``, a flat float32 NumPy array holding ``(B, V)`` row-major (or more: the rest
    is not read), into ``out`` (int64, ``(B,)``), each drawn by the compiled sampler
    (``kernels/cpu/sampling.py``) at one float64 uniform of ``generator`` (``B`` of them,
    in row order), never an id ``>= forbidden``. ``scratch``: ``V`` float32, overwritten.
    A row nothing can be drawn from (NaN or ``+inf`` logits, every id excluded) is the
    ``ValueError`` of :func:`check_logits` (then ``out`` is incomplete).

    Example:
        >>> import numpy as np, torch
        >>> out = np.empty(1, dtype=np.int64)
        >>> logits = np.array([0.0, 9.0, 1.0, 50.0], dtype=np.float32)
        >>> draw_fused(logits, 1, 4, 1.0, 1, None, torch.Generator().manual_seed(0), 3, out,
        ...            np.empty(4, dtype=np.float32))
        >>> int(out[0])
        1
    """
    uniforms = torch.rand(B, generator=generator, dtype=torch.float64)
    if decode_host.draw(logits, B, V, temperature, top_k, top_p, uniforms.numpy(), forbidden,
                        out, scratch) >= 0:
        refuse_logits(torch.from_numpy(logits[:B * V]).view(B, V), forbidden)


class RowSampling(Protocol):
    """One row's settings for :func:`draw_fused_rows` (``fastrwa.models.decoding.Sampling``:
    checked as ``generate``'s arguments are)."""

    temperature: float
    top_k: Optional[int]
    top_p: Optional[float]
    generator: Optional[torch.Generator]


def draw_fused_rows(logits: np.ndarray, V: int, samplings: Sequence[Optional[RowSampling]],
                    forbidden: int, out: np.ndarray, scratch: np.ndarray) -> int:
    """:func:`draw_fused` for rows each drawn with its own settings and generator, in one
    compiled call: row ``b`` of ``logits`` (flat float32 holding ``(B, V)`` row-major or
    more, ``B = len(samplings)``) with ``samplings[b]`` (``None``: skipped, ``out[b]`` left
    as it is), each at one float64 uniform of its own generator, drawn in row order: the
    ids :func:`draw_fused` draws for each row alone, from the same generators. A row
    nothing can be drawn from gets -1 in ``out`` (int64, ``(B,)``; its uniform was drawn,
    as alone); returns how many did. ``scratch``: ``V`` float32, overwritten.

    Example:
        >>> import numpy as np, torch
        >>> from fastrwa.models.decoding import Sampling
        >>> logits = np.array([0.0, 9.0, 1.0, 50.0, 5.0, 0.0, 1.0, 50.0], dtype=np.float32)
        >>> out = np.zeros(2, dtype=np.int64)
        >>> rows = [Sampling(1.0, 1, None, torch.Generator().manual_seed(0)),
        ...         Sampling(0.5, None, 0.9, torch.Generator().manual_seed(1))]
        >>> draw_fused_rows(logits, 4, rows, 3, out, np.empty(4, dtype=np.float32))
        0
        >>> out.tolist()
        [1, 0]
    """
    B = len(samplings)
    temperatures = np.ones(B, dtype=np.float32)
    top_ks = np.full(B, -1, dtype=np.int64)             # (-1: skipped)
    top_ps = np.ones(B, dtype=np.float64)
    uniforms = torch.empty(B, dtype=torch.float64)
    # (a view of each uniform made in one call; each drawn as torch.rand(1, generator=...)
    # of draw_fused draws it: the same float64 from the generator)
    for b, (sampling, uniform) in enumerate(zip(samplings, uniforms.unbind())):
        if sampling is None:
            continue
        temperatures[b] = sampling.temperature
        top_ks[b] = min(sampling.top_k or 0, V)
        if sampling.top_p is not None:
            top_ps[b] = sampling.top_p
        uniform.uniform_(generator=sampling.generator)
    return decode_host.draw_each(logits, B, V, temperatures, top_ks, top_ps, uniforms.numpy(),
                                 forbidden, out, scratch)


def refuse_logits(logits: Tensor, forbidden: int) -> NoReturn:
    """Raise the ``ValueError`` of :func:`check_logits` for ``logits`` ``(B, V)`` with the
    ids ``>= forbidden`` excluded, as :func:`sample` does (called where a compiled draw
    found a row nothing can be drawn from)."""
    masked = logits.clone()
    masked[:, forbidden:] = float("-inf")
    check_logits(masked, masked.amax(dim=-1, keepdim=True))
    raise RuntimeError("the compiled draw found no id to draw in logits the check accepts "
                       "(a defect: please report it)")


class Sampler:
    """``generate`` and ``stream`` for a language model whose ``forward(tokens, state)``
    returns ``(logits, state)`` and continues a stream from ``state`` (the baselines; ByteLM
    has its own, with beam search and a fused decode step). A model that decodes otherwise
    (the Transformer's key/value cache) overrides :meth:`_decoder`."""

    config: object

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 beam_size: int = 1, generator: Optional[torch.Generator] = None) -> Tensor:
        """Sample a continuation of ``prompt`` ``(B, P)`` or ``(P,)``: ``(B, P +
        max_new_tokens)``, as :meth:`ByteLM.generate` (no beam search: ``beam_size`` must
        be 1)."""
        prompt, _ = prepare_prompt(prompt, self.config.vocab_size, self.config.bos_token,
                                   max_new_tokens, temperature, top_k, top_p, beam_size)
        if beam_size != 1:
            raise ValueError(f"{type(self).__name__}.generate samples only: beam_size must be 1")
        return collect(prompt, self.stream(prompt, max_new_tokens, temperature, top_k, top_p,
                                           generator), max_new_tokens)

    @torch.no_grad()
    def stream(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
               top_k: Optional[int] = None, top_p: Optional[float] = None,
               generator: Optional[torch.Generator] = None) -> Iterator[Tensor]:
        """Yield each sampled token ``(B,)`` as :meth:`ByteLM.stream` does."""
        _, context = prepare_prompt(prompt, self.config.vocab_size, self.config.bos_token,
                                    max_new_tokens, temperature, top_k, top_p, 1)
        if max_new_tokens == 0:
            return
        logits, step = self._decoder(context)
        yield from sample_loop(logits, step, max_new_tokens, temperature, top_k, top_p,
                               generator, self.config.bos_token)

    def _decoder(self, context: Tensor) -> tuple[Tensor, Callable[[Tensor], Tensor]]:
        """The last position's logits ``(B, V)`` after reading ``context``, and the step that
        reads one token ``(B,)`` more and returns the next logits: ``forward`` with the
        state carried."""
        logits, state = self(context)

        def step(token: Tensor) -> Tensor:
            nonlocal state
            logits, state = self(token[:, None], state)
            return logits[:, -1]
        return logits[:, -1], step
