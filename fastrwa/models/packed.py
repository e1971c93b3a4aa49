"""A byte LM's weights packed for the fused CPU decode step: :class:`PackedLM`."""

from __future__ import annotations

import dataclasses
from typing import Iterator, NamedTuple, Optional, Protocol, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..kernels.codes import (ATTENTION_CODE, DISCOUNT_CODE, OUTPUT_FUNCTION_CODE)
from ..ops import decode_host
from ..ops.decode_host import WEIGHT_FORMATS, Shapes, Weights, dequantize, quantize
from ..ops.numba_common import flat
from .block import Block
from .cache import CachedModel, InferenceCache
from .checks import check_tokens
from .decoding import Sampling, check_forbidden, check_rows, draw_each
from .sampling import check_sampling_args, draw_fused, draw_fused_rows, sample_fused


class Packable(CachedModel, Protocol):
    """What :class:`PackedLM` packs and decodes for (a float32 CPU
    :class:`fastrwa.models.ByteLM`, :func:`unsupported_reason`): an ``nn.Module`` with an
    embedding, blocks, a final norm and a head, which allocates the caches and runs
    ``generate``/``stream`` with a ``PackedLM`` as their ``weights``."""

    norm: nn.RMSNorm
    head: nn.Linear
    training: bool

    def state_dict(self) -> dict: ...
    def allocate_cache(self, batch: int) -> InferenceCache: ...
    def generate(self, prompt: Tensor, max_new_tokens: int, **options) -> Tensor: ...
    def stream(self, prompt: Tensor, max_new_tokens: int, **options) -> Iterator[Tensor]: ...


class _Bindings(NamedTuple):
    """What a cache keeps for a pack (``cache.work["packed"]``): the kernel's work buffers
    (``work``, tensors; ``arrays``, their flat NumPy views), the flat views of the cache's
    state, the kernel's arguments for all of them (``bound``) and, by number of rows, those
    of calls over the first rows only (``cut``)."""

    work: dict
    arrays: dict
    state: tuple
    bound: Optional[decode_host.Bound]
    cut: dict


def unsupported_reason(model: object) -> Optional[str]:
    """Why ``model`` cannot be packed, or ``None``."""
    # (what packing reads: a ByteLM's embedding, blocks, norm and head; this module sits
    # below ByteLM, which decodes through it)
    blocks = getattr(model, "blocks", None)
    if not (isinstance(model, torch.nn.Module) and isinstance(blocks, torch.nn.ModuleList)
            and all(isinstance(block, Block) for block in blocks)
            and all(hasattr(model, name) for name in ("embed", "norm", "head", "config"))):
        return f"model must be a fastrwa.models.ByteLM, got {type(model).__name__}"
    weight = model.embed.weight
    if weight.device.type != "cpu":
        return (f"the fused decode step runs on CPU; the model is on {weight.device} (move "
                f"it with model.cpu(), or generate with weights='eager')")
    if weight.dtype != torch.float32:
        return (f"the fused decode step packs a float32 model; this one is {weight.dtype} "
                f"(model.float(), or generate with weights='eager')")
    return None


class PackedLM:
    """A :class:`ByteLM`'s weights packed once into the layout of the fused CPU decode step
    (``kernels/cpu/decode.py``): each :meth:`step_` is one compiled call through every
    block and the head, whose cost at batch 1 is reading the weight matrices once.

    Args:
        model: a float32 :class:`ByteLM` on CPU. Its weights are copied when packing: a
            later change of the model (training) is not seen; pack again.
        weights: how the matrices are stored: ``"float32"`` (the model's values: logits
            equal the eager :meth:`ByteLM.step`'s within float32 rounding), ``"bfloat16"``
            (half the bytes) or ``"int8"`` (a quarter, a float32 scale per output row). The
            arithmetic is float32 in every case; the embedding, norms and biases stay float32.

    The state lives in an :class:`InferenceCache` (``allocate_cache``), shared with the eager
    path: a cache filled by one may be continued by the other. ``model.generate(...,
    weights="int8")`` packs and decodes in one call; a ``PackedLM`` packs once for many.

    Example:
        >>> import torch
        >>> from fastrwa.models import ByteLM, LMConfig, PackedLM
        >>> model = ByteLM(LMConfig(d_model=32, n_layers=2)).eval()
        >>> packed = PackedLM(model, weights="int8")
        >>> cache = packed.allocate_cache(2)
        >>> logits = packed.prefill(torch.tensor([[72, 105], [79, 107]]), cache)
        >>> packed.step_(torch.tensor([33, 33]), cache).shape
        torch.Size([2, 257])
        >>> model.generate(torch.tensor([72]), 5, weights=packed).shape
        torch.Size([1, 6])
    """

    kind = "fused CPU decode (PackedLM)"

    def __init__(self, model: Packable, weights: str = "float32"):
        problem = unsupported_reason(model)
        if problem:
            raise ValueError(problem)
        self.format = decode_host.check_format(weights)
        self.model = model
        c, blocks = model.config, list(model.blocks)
        L, D = len(blocks), c.d_model
        R, V = blocks[0].mlp[0].out_features, c.vocab_size
        rda = c.layer == "rda"
        mix = blocks[0].mix
        self.shapes = Shapes(
            L=L, D=D, G=mix.num_gates, R=R, V=V, token_shift=c.token_shift,
            gated=c.output_gate, attention=ATTENTION_CODE[mix.attention if rda else "exp"],
            discount=DISCOUNT_CODE["sigmoid" if rda else None],
            f_h=OUTPUT_FUNCTION_CODE[mix.f_h_name if rda else "identity"],
            f_o=OUTPUT_FUNCTION_CODE[mix.f_o_name if rda else "tanh"])
        with torch.no_grad():
            # what dequantized() rebuilds the model from: the values packed, not later ones
            self._snapshot = {k: v.detach().clone() for k, v in model.state_dict().items()}
            linears = dict(proj=[b.mix.proj for b in blocks], up=[b.mlp[0] for b in blocks],
                           down=[b.mlp[2] for b in blocks],
                           gate=[b.gate for b in blocks] if c.output_gate else None)
            self._tensors = {}
            for name in ("proj", "gate", "up", "down"):
                mods = linears[name]
                if mods is None:                  # (no output gate: empty, never read)
                    w = torch.empty(L, 0, D)
                    bias = torch.empty(L, 0)
                elif name == "proj":              # (one discount row per channel)
                    rows = [b.mix.per_channel_rows() if rda else slice(None) for b in blocks]
                    w = torch.stack([m.weight[r] for m, r in zip(mods, rows)])
                    bias = torch.stack([m.bias[r] for m, r in zip(mods, rows)])
                else:
                    w = torch.stack([m.weight for m in mods])
                    bias = torch.stack([m.bias for m in mods])
                self._tensors[name] = (*quantize(w, self.format),
                                       bias.detach().float().contiguous())
            head_w, head_s = quantize(model.head.weight, self.format)
            self._tensors["head"] = (head_w, head_s, torch.zeros(V))
            norms = [n for b in blocks for n in (b.norm1, b.norm2)] + [model.norm]
            self._norms = torch.stack([n.weight.detach().float() for n in norms]).contiguous()
            eps = torch.finfo(torch.float32).eps
            self._eps = torch.tensor([eps if n.eps is None else n.eps for n in norms],
                                     dtype=torch.float32)
            self._embed = self._snapshot["embed.weight"]            # (a float32 copy)
            # the state before the first token (each layer's learned prior), one row each
            initial = [b.mix.initial_state(1) for b in blocks]
            self._initial = [torch.cat([s.scan[k] for s in initial]).float()
                             for k in range(3)]                              # 3 x (L, D)
        self._weights = Weights(
            self.shapes, flat(self._embed), flat(self._norms), self._eps.numpy(),
            tuple(tuple(flat(t) for t in self._tensors[name])
                  for name in ("proj", "gate", "up", "down", "head")))
        self.layout = model.cache_layout()

    @property
    def matrix_bytes(self) -> int:
        """Bytes of weight matrices one step reads: the bound of a step at batch 1."""
        return self._weights.matrix_bytes

    def dequantized(self) -> Packable:
        """The model as it was packed, with its matrices exactly what this pack multiplies
        by (``q * scale`` for int8, the bfloat16 values in float32): its eager forward is the
        reference of the packed step, and measures the validation loss of the format in
        parallel. A new ``ByteLM`` (float32, CPU), sharing nothing with the model."""
        model = type(self.model)(self.model.config)
        model.load_state_dict(self._snapshot)
        model.train(self.model.training)
        with torch.no_grad():
            for name, linears in (("proj", [b.mix.proj for b in model.blocks]),
                                  ("up", [b.mlp[0] for b in model.blocks]),
                                  ("down", [b.mlp[2] for b in model.blocks]),
                                  ("gate", [b.gate for b in model.blocks]
                                   if model.config.output_gate else [])):
                data, scale, _ = self._tensors[name]
                for layer, linear in enumerate(linears):
                    weight = dequantize(data[layer], scale[layer])
                    if name == "proj" and model.config.layer == "rda":
                        # (a grouped discount's row: the first of its channels' copies)
                        rows = model.blocks[layer].mix.per_channel_rows()   # (ascending)
                        _, copies = torch.unique_consecutive(rows, return_counts=True)
                        weight = weight[copies.cumsum(0) - copies]
                    linear.weight.copy_(weight)
            head = dequantize(*self._tensors["head"][:2])
            if model.config.tie_embeddings:        # (the embedding stays as it was)
                model.head.weight = torch.nn.Parameter(head)
            else:
                model.head.weight.copy_(head)
        return model

    # -- streaming ------------------------------------------------------------------------
    def allocate_cache(self, batch: int) -> InferenceCache:
        """An :class:`InferenceCache` for ``batch`` rows (the model's)."""
        now = self.model.cache_layout()
        if now != self.layout:
            raise ValueError(f"the model changed since it was packed (now {now.describe()}, "
                             f"packed {self.layout.describe()}): pack it again")
        return self.model.allocate_cache(batch)

    def _check_cache(self, cache: object) -> InferenceCache:
        """``cache`` was allocated for the model as it was packed (shape, dtype, device)."""
        if not isinstance(cache, InferenceCache):
            raise TypeError(f"cache must be a fastrwa.models.InferenceCache (from "
                            f"packed.allocate_cache(B)), got {type(cache).__name__}")
        if cache.layout != self.layout:
            raise ValueError(f"cache was allocated by a model of another shape, dtype or "
                             f"device ({cache.layout.describe()}); this pack holds "
                             f"{self.layout.describe()}: allocate one with "
                             f"packed.allocate_cache(B)")
        return cache

    def _buffers(self, cache: InferenceCache) -> _Bindings:
        """This cache's kernel buffers and the kernel's arguments for them and this pack's
        weights (made on first use, kept in ``cache.work``; the arguments are made again when
        another pack of the model uses the cache)."""
        found = cache.work.get("packed")
        if found is None:
            work = decode_host.work_buffers(self.shapes, cache.batch)
            arrays = {name: flat(t) for name, t in work.items()}
            state = tuple(flat(t) for t in cache.stacked)
            found = _Bindings(work, arrays, state, None, {})
        if found.bound is None or found.bound.weights is not self._weights:
            bound = decode_host.bind(self._weights, found.state, found.arrays, cache.batch)
            found = cache.work["packed"] = found._replace(bound=bound, cut={})
        return found

    def _bound_rows(self, cache: InferenceCache, rows: int) -> decode_host.Bound:
        """The kernel's arguments for calls over the cache's rows ``[0, rows)``: the cache's
        own with the batch cut to ``rows`` (and a choice of threads of their own)."""
        found = self._buffers(cache)
        if rows == cache.batch:
            return found.bound
        cut = found.cut.get(rows)
        if cut is None:
            cut = found.cut[rows] = dataclasses.replace(found.bound, batch=rows,
                                                        choice=decode_host.Choice())
        return cut

    def _run(self, tokens: Tensor, cache: InferenceCache, name: str) -> Tensor:
        """Advance the cache by ``tokens`` ``(B, T)``: one call for ``T = 1``; for a prompt,
        calls of ``PREFILL_ROWS // B`` positions (at least 1), with buffers for them made
        per prompt (about 20 KB a row at the default size)."""
        work, arrays, state, bound, _ = self._buffers(cache)
        ids = tokens.to(torch.int64)
        T = ids.shape[1]
        chunk = min(T, max(1, decode_host.PREFILL_ROWS // max(1, cache.batch)))
        if T > 1:         # (a prompt: prefill checked every id before anything was written)
            long = decode_host.work_buffers(self.shapes, cache.batch, chunk)
            arrays = {k: flat(v) for k, v in long.items() if k != "logits"} | \
                {"logits": arrays["logits"]}
            bound = decode_host.bind(self._weights, state, arrays, cache.batch)
        for lo in range(0, T, chunk):
            piece = ids[:, lo:lo + chunk].contiguous()
            bad = decode_host.run(bound, flat(piece))
            if bad >= 0:
                self._refuse(ids, bad, name)
        return work["logits"]

    def _refuse(self, ids: Tensor, row: int, name: str) -> None:
        values = ids[row]
        raise ValueError(f"{name} must be ids in [0, {self.shapes.V}), got values in "
                         f"[{int(values.min())}, {int(values.max())}] in row {row}")

    @torch.no_grad()
    def prefill(self, tokens: Tensor, cache: InferenceCache) -> Tensor:
        """Run ``tokens`` ``(B, T)`` (``B`` the cache's batch, ``T >= 1``) from the initial
        state, leave the state in ``cache`` and return the last position's logits ``(B,
        vocab_size)``: a buffer the next step overwrites. The fused kernel runs the prompt
        layer by layer, each product on up to 256 (batch row, position) pairs at once, the
        scan along the positions in order, the head after the last. Checked before anything
        is written."""
        self._check_prompt(tokens, cache)
        for buf, init in zip(cache.stacked, self._initial):
            buf.copy_(init[:, None])
        if cache.stacked[3].numel():
            cache.stacked[3].zero_()
        return self._run(tokens, cache, "tokens")

    @torch.no_grad()
    def extend(self, tokens: Tensor, cache: InferenceCache) -> Tensor:
        """:meth:`prefill` from the state ``cache`` holds rather than the initial one
        (:class:`fastrwa.models.decoding.Extendable`): ``prefill(a)`` then ``extend(b)``
        leave the state and logits of ``prefill(a + b)``, bit for bit, wherever the prompt
        is cut (each position's sums are computed alone, in the same order, whatever the
        positions run with it: tests/models/test_prefix_split.py).

        Example:
            >>> import torch
            >>> from fastrwa.models import ByteLM, LMConfig, PackedLM
            >>> packed = PackedLM(ByteLM(LMConfig(d_model=16, n_layers=1)))
            >>> a, b = packed.allocate_cache(1), packed.allocate_cache(1)
            >>> whole = packed.prefill(torch.tensor([[72, 105, 33]]), a).clone()
            >>> _ = packed.prefill(torch.tensor([[72]]), b)
            >>> torch.equal(packed.extend(torch.tensor([[105, 33]]), b), whole)
            True
        """
        self._check_prompt(tokens, cache)
        return self._run(tokens, cache, "tokens")

    def _check_prompt(self, tokens: object, cache: object) -> None:
        """``tokens`` ``(B, T)`` ids on the CPU for ``cache`` (``B`` its rows, ``T >= 1``)."""
        self._check_cache(cache)
        B = cache.batch
        if not isinstance(tokens, Tensor) or tokens.dim() != 2 or tokens.shape[0] != B \
                or tokens.shape[1] == 0:
            got = tuple(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
            raise ValueError(f"tokens must have shape (B, T) = ({B}, T) with T >= 1 (the "
                             f"cache's batch), got {got}")
        check_tokens(tokens, self.shapes.V, 2)
        if tokens.device.type != "cpu":
            raise ValueError(f"tokens must be on the CPU (the packed model's), "
                             f"got {tokens.device}")

    def step_(self, token: Tensor, cache: InferenceCache, *,
              rows: Optional[int] = None) -> Tensor:
        """One token ``(B,)`` with the state in ``cache``, updated in place; returns the
        logits ``(B, vocab_size)``, a buffer the next step overwrites (as
        :meth:`ByteLM.step_`). Ids outside the vocabulary are refused (``ValueError``)
        before anything is written. ``rows`` (:meth:`fastrwa.models.decoding.Decoder.step_`):
        one call over rows ``[0, rows)`` only, the others left as they were (each row is
        computed on its own: its logits are the same bits whatever the number of rows).
        (No autograd: the kernel reads and writes NumPy views.)"""
        self._check_cache(cache)
        if not (isinstance(token, Tensor) and token.dtype == torch.int64 and token.is_cpu
                and token.dim() == 1 and token.shape[0] == cache.batch):
            self._check_token(token, cache.batch)       # (other integer dtypes pass)
        if rows is None:
            return self._run(token[:, None], cache, "token")
        rows = check_rows(rows, cache.batch)
        ids = token.to(torch.int64).contiguous().numpy()[:rows]
        bad = decode_host.run(self._bound_rows(cache, rows), ids)
        if bad >= 0:
            self._refuse(torch.from_numpy(ids)[:, None], bad, "token")
        return self._buffers(cache).work["logits"]

    @staticmethod
    def _check_token(token: object, batch: int) -> None:
        """``TypeError``/``ValueError`` unless ``token`` is integer ids ``(batch,)`` on the
        CPU."""
        if not isinstance(token, Tensor) or token.is_floating_point() or token.is_complex() \
                or token.dtype == torch.bool:
            got = token.dtype if isinstance(token, Tensor) else type(token).__name__
            raise TypeError(f"token must be a tensor of integer ids (B,), got {got}")
        if token.dim() != 1 or token.shape[0] != batch:
            raise ValueError(f"token must have shape (B,) = ({batch},), "
                             f"got {tuple(token.shape)}")
        if token.device.type != "cpu":
            raise ValueError(f"token must be on the CPU (the packed model's), got {token.device}")

    def draw(self, logits: Tensor, sampling: Sampling | Sequence[Optional[Sampling]],
             forbidden: int) -> Tensor:
        """:meth:`fastrwa.models.decoding.Decoder.draw`: the fused sampler on contiguous
        float32 CPU logits (this pack's), :func:`fastrwa.models.sampling.sample_fused`; with
        settings per row, every row in one compiled call
        (:func:`fastrwa.models.sampling.draw_fused_rows`: each row's id is the one it gets
        drawn alone)."""
        if not isinstance(sampling, (list, tuple)):
            return sample_fused(logits, sampling.temperature, sampling.top_k, sampling.top_p,
                                sampling.generator, forbidden)
        B = len(sampling)
        if not (logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous()
                and logits.dim() == 2 and logits.shape[0] == B):
            return draw_each(self.draw, logits, sampling, forbidden)
        ids = np.full(B, -1, dtype=np.int64)
        draw_fused_rows(logits.detach().numpy().ravel(), logits.shape[1], sampling, forbidden,
                        ids, np.empty(logits.shape[1], dtype=np.float32))
        return torch.from_numpy(ids)

    def sample_steps(self, logits: Tensor, cache: InferenceCache, max_new_tokens: int,
                     temperature: float = 1.0, top_k: Optional[int] = None,
                     top_p: Optional[float] = None, generator: Optional[torch.Generator] = None,
                     forbidden: Optional[int] = None) -> Iterator[Tensor]:
        """An iterator of ``max_new_tokens`` tokens ``(B,)``: the first drawn from ``logits``
        ``(B, vocab_size)`` (float32, contiguous, CPU: what :meth:`prefill` or :meth:`step_`
        returned for ``cache``), each next from the logits of a step that reads the token
        before (not after the last), as :func:`fastrwa.models.sampling.sample_loop` over
        :meth:`step_` with :func:`~fastrwa.models.sampling.sample_fused` (the same tokens
        from the same ``generator``), in one loop: every id is drawn into the array the next
        step reads, so a token costs the draw, the step and the tensor yielded. Never an id
        ``>= forbidden`` (default: the BOS id, as ``generate``). Arguments are checked when
        it is called (as ``generate``'s; ``ValueError``); ``ByteLM.generate`` and ``stream``
        sample so with a ``PackedLM``.

        Example:
            >>> import torch
            >>> from fastrwa.models import ByteLM, LMConfig, PackedLM
            >>> packed = PackedLM(ByteLM(LMConfig(d_model=16, n_layers=1)))
            >>> cache = packed.allocate_cache(1)
            >>> logits = packed.prefill(torch.tensor([[104, 105]]), cache)
            >>> [t.shape for t in packed.sample_steps(logits, cache, 2)]
            [torch.Size([1]), torch.Size([1])]
        """
        self._check_cache(cache)
        B, V = cache.batch, self.shapes.V
        if not isinstance(logits, Tensor) or logits.shape != (B, V) \
                or logits.dtype != torch.float32 or logits.device.type != "cpu" \
                or not logits.is_contiguous():
            got = (f"{tuple(logits.shape)} {logits.dtype} on {logits.device}"
                   if isinstance(logits, Tensor) else type(logits).__name__)
            raise ValueError(f"logits must be contiguous float32 CPU ({B}, {V}) (what "
                             f"prefill or step_ returned for this cache), got {got}")
        check_sampling_args(max_new_tokens, temperature, top_k, top_p)
        forbidden = check_forbidden(self.model.config.bos_token if forbidden is None
                                    else forbidden, V)
        return self._sample_steps(logits.detach(), cache, max_new_tokens, temperature,
                                  top_k, top_p, generator, forbidden)

    @torch.no_grad()
    def _sample_steps(self, logits: Tensor, cache: InferenceCache, max_new_tokens: int,
                      temperature: float, top_k: Optional[int], top_p: Optional[float],
                      generator: Optional[torch.Generator], forbidden: int) -> Iterator[Tensor]:
        B, V = cache.batch, self.shapes.V
        bound = self._buffers(cache).bound
        ids = np.empty(B, dtype=np.int64)       # [B] the drawn ids: the next step's input
        scratch = np.empty(V, dtype=np.float32)
        source = flat(logits)
        for i in range(max_new_tokens):
            draw_fused(source, B, V, temperature, top_k, top_p, generator, forbidden, ids,
                       scratch)
            yield torch.from_numpy(ids.copy())
            if i + 1 < max_new_tokens:
                bad = decode_host.run(bound, ids)
                if bad >= 0:            # (drawn ids are in [0, forbidden): never)
                    self._refuse(torch.from_numpy(ids)[:, None], bad, "a drawn token")
                source = bound.logits

    def generate(self, prompt: Tensor, max_new_tokens: int, **options) -> Tensor:
        """:meth:`ByteLM.generate` with this pack's step (``options`` as there)."""
        return self.model.generate(prompt, max_new_tokens, weights=self, **options)

    def stream(self, prompt: Tensor, max_new_tokens: int, **options) -> Iterator[Tensor]:
        """:meth:`ByteLM.stream` with this pack's step (``options`` as there)."""
        return self.model.stream(prompt, max_new_tokens, weights=self, **options)

    def __repr__(self) -> str:
        return (f"PackedLM(weights={self.format!r}, {self.shapes.L} blocks of "
                f"{self.shapes.D}, {self.matrix_bytes / 1e6:.1f} MB of matrices)")


__all__ = ["PackedLM", "WEIGHT_FORMATS"]
