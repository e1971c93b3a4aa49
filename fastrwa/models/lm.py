"""A byte-level language model of stacked scan layers, with O(1)-state generation."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Iterator, NamedTuple, Optional

import torch
from torch import Tensor, nn

from ..checks import check_context_group, check_no_overlap
from ..nn.checks import check_buffer, check_count, check_input_dtype
from ..nn.functional import rms_norm_into
from ..nn import RDA, RWA, LayerState
from ..nn.masks import last_kept
from ..ops.context import CALL_MODEL, agree, fingerprint, refuse_together, same_everywhere
from ..ops.contract import state_dtype
from ..state import ScanState
from .checks import check_tokens
from .config import LMConfig
from .pretrained import load_pretrained, save_pretrained
from .sampling import check_logits, collect, prepare_prompt, sample_fused, sample_loop


def longest_timescale(depth: int, n_layers: int) -> float:
    """``discount_init="spread"``: block ``depth``'s longest memory, 16 tokens in the first
    block to 1024 in the last (log-spaced)."""
    return 2.0 ** (4 + 6 * depth / max(1, n_layers - 1))


class LMState(NamedTuple):
    """The model's streaming state: one :class:`fastrwa.nn.LayerState` per block."""

    layers: tuple


class Block(nn.Module):
    """Pre-norm -> scan layer (times ``sigmoid(gate(x))`` with ``output_gate``) -> residual
    -> pre-norm -> MLP -> residual."""

    def __init__(self, config: LMConfig):
        super().__init__()
        d = config.d_model
        self.norm1 = nn.RMSNorm(d)
        if config.layer == "rwa":
            self.mix = RWA(d, d, token_shift=config.token_shift,
                           learn_initial_state=config.learn_initial_state)
        else:
            self.mix = RDA(d, d, attention=config.attention, f_h=config.f_h, f_o=config.f_o,
                           preset=config.preset, token_shift=config.token_shift,
                           learn_initial_state=config.learn_initial_state,
                           discount_groups=config.discount_groups)
        self.gate = nn.Linear(d, d) if config.output_gate else None
        self.norm2 = nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, config.mlp_ratio * d), nn.GELU(),
                                 nn.Linear(config.mlp_ratio * d, d))

    def forward(self, x: Tensor, state: Optional[LayerState], mask: Optional[Tensor] = None,
                context_group=None, cu_seqlens: Optional[Tensor] = None
                ) -> tuple[Tensor, LayerState]:
        normed = self.norm1(x)
        h, state = self.mix(normed, state, mask, context_group=context_group,
                            cu_seqlens=cu_seqlens)
        x = x + self._gated(h, normed)
        return x + self.mlp(self.norm2(x)), state

    def step(self, x: Tensor, state: LayerState) -> tuple[Tensor, LayerState]:
        normed = self.norm1(x)
        h, state = self.mix.step(normed, state)
        x = x + self._gated(h, normed)
        return x + self.mlp(self.norm2(x)), state

    def _gated(self, h: Tensor, normed: Tensor) -> Tensor:
        return h if self.gate is None else h * torch.sigmoid(self.gate(normed))

    def step_workspace(self, batch: int, dtype: torch.dtype) -> dict:
        """Buffers for :meth:`step_` (``batch`` rows of ``dtype``), allocated once per decode."""
        d, dev = self.norm1.normalized_shape[0], self.mlp[0].weight.device
        mix = self.mix.step_workspace(batch, dtype)           # (checks batch)
        new = lambda *shape: torch.empty(*shape, dtype=dtype, device=dev)  # noqa: E731
        return dict(mix=mix, normed=new(batch, d), h=new(batch, d), gate=new(batch, d),
                    hidden=new(batch, self.mlp[0].out_features),
                    rstd=torch.empty(batch, 1, dtype=state_dtype(dtype), device=dev),
                    wide=torch.empty(batch, d, dtype=state_dtype(dtype), device=dev))

    @torch.no_grad()
    def step_(self, x: Tensor, state: LayerState, work: dict) -> Tensor:
        """:meth:`step` in place: the residual stream ``x`` ``(B, d)`` and ``state`` are
        updated where they lie, and nothing is allocated (CPU). Inference only: it runs
        without autograd. Every argument is checked before anything is written (``x`` in
        the block's dtype, ``work`` from :meth:`step_workspace` for ``B`` rows, ``state`` as
        :meth:`fastrwa.nn.RDA.step_` checks it): a refused call leaves ``x`` and ``state``
        as they were."""
        self._check_step_(x, state, work)
        return self._step_into(x, state, work)

    def _check_step_(self, x: object, state: object, work: object) -> None:
        d, param = self.norm1.normalized_shape[0], self.mlp[0].weight
        if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != d:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must be a tensor of shape (B, d_model) = (B, {d}), got {got}")
        check_input_dtype(x, "x", param, "block", autocast=False)
        B, dtype, dev = x.shape[0], x.dtype, x.device
        sdt = state_dtype(dtype)
        buffers = dict(normed=(d, dtype), h=(d, dtype), gate=(d, dtype),
                       hidden=(self.mlp[0].out_features, dtype), rstd=(1, sdt), wide=(d, sdt))
        if not isinstance(work, dict) or not {"mix", *buffers} <= work.keys():
            got = sorted(work) if isinstance(work, dict) else type(work).__name__
            raise TypeError(f"work must be the dict of step_workspace(B, dtype) for this block "
                            f"(with {sorted(['mix', *buffers])}), got {got}")
        for name, (width, buffer_dtype) in buffers.items():
            check_buffer(work[name], f"work[{name!r}]", (B, width), buffer_dtype, dev)
        self.mix._check_step_(work["normed"], state, work["h"], work["mix"], "work['mix']")
        if not torch.compiler.is_compiling():
            check_no_overlap([("x", x)], [])

    def _step_into(self, x: Tensor, state: LayerState, work: dict) -> Tensor:
        """The computation of :meth:`step_`, on arguments it has checked."""
        normed, h = work["normed"], work["h"]
        rms_norm_into(x, self.norm1, normed, work["rstd"], work["wide"])
        self.mix._step_into(normed, state, h, work["mix"])
        if self.gate is not None:
            torch.addmm(self.gate.bias, normed, self.gate.weight.t(), out=work["gate"])
            h.mul_(work["gate"].sigmoid_())
        x.add_(h)
        rms_norm_into(x, self.norm2, normed, work["rstd"], work["wide"])
        up, down = self.mlp[0], self.mlp[2]
        torch.addmm(up.bias, normed, up.weight.t(), out=work["hidden"])
        torch.ops.aten.gelu_(work["hidden"])
        torch.addmm(down.bias, work["hidden"], down.weight.t(), out=h)
        return x.add_(h)


@torch.compiler.disable
def _check_ids(token: Tensor, vocab_size: int, out: Tensor) -> None:
    """``ValueError`` unless every id of ``token`` is in ``[0, vocab_size)``: a read back to
    the host, run eagerly also when ``ByteLM.step_`` is compiled (a graph break there: the
    compiled gather would fail with the device's raw index error instead)."""
    low, high = torch.aminmax(token, out=(out[0], out[1]))
    if low.item() < 0 or high.item() >= vocab_size:
        raise ValueError(f"token must be ids in [0, {vocab_size}), got values in "
                         f"[{low.item()}, {high.item()}]")


class InferenceCache:
    """Streaming state allocated once and updated in place (in the style of mamba's cache).

    Holds, per block, the scan state ``m, n, d`` ``(B, d_model)`` and the previous token's
    input ``(B, d_model)``: ``layers * (3 + 1) * B * d_model`` floats, whatever the length.
    ``load_`` copies a state in (after a prefill), ``reorder_`` permutes the batch (beam
    search); :meth:`ByteLM.step_` updates it in place. The next prefill can reuse it.
    """

    def __init__(self, model: "ByteLM", batch: int):
        check_count(batch, "batch")
        d, dev = model.config.d_model, model.embed.weight.device
        dtype = model.embed.weight.dtype
        sdt = state_dtype(dtype)
        self.batch, self.device = batch, dev
        # what the buffers were sized for: ByteLM.step_ and prefill refuse another model's
        self.layout = model._cache_layout()
        # One (layers, B, d_model) tensor per quantity (the fused decode step of PackedLM
        # reads them so); each block's state is a view of its row.
        L, shift = len(model.blocks), model.config.token_shift
        scan = [torch.zeros(L, batch, d, dtype=sdt, device=dev) for _ in range(3)]
        last = torch.zeros(L if shift else 0, batch, d, dtype=dtype, device=dev)
        self.stacked = (*scan, last)
        self.scan = [tuple(t[i] for t in scan) for i in range(L)]
        self.last = [last[i] if shift else None for i in range(L)]
        # Work buffers of ByteLM.step_ (intermediates, not state): a step allocates nothing.
        self.work = dict(x=torch.empty(batch, d, dtype=dtype, device=dev),
                         normed=torch.empty(batch, d, dtype=dtype, device=dev),
                         rstd=torch.empty(batch, 1, dtype=state_dtype(dtype), device=dev),
                         wide=torch.empty(batch, d, dtype=state_dtype(dtype), device=dev),
                         logits=torch.empty(batch, model.config.vocab_size, dtype=dtype,
                                            device=dev),
                         token_range=torch.empty(2, dtype=torch.long, device=dev),
                         blocks=[block.step_workspace(batch, dtype) for block in model.blocks])
        # A fresh cache holds the state before the first token: each layer's learned prior.
        self.load_(LMState(tuple(block.mix.initial_state(batch) for block in model.blocks)))

    @property
    def state(self) -> LMState:
        """The cached state as an :class:`LMState` of views of the buffers."""
        return LMState(tuple(LayerState(ScanState(*s), last)
                             for s, last in zip(self.scan, self.last)))

    @torch.no_grad()
    def load_(self, state: LMState) -> None:
        """Copy ``state`` (an :class:`LMState` of this cache's batch and width, e.g. a
        forward's) into the buffers: its values, not its autograd graph, converted to the
        buffers' dtype and device. Every tensor is checked before any is copied (a refused
        state leaves the cache as it was): no broadcasting, no partial load."""
        if not isinstance(state, LMState) or not isinstance(state.layers, (tuple, list)):
            raise TypeError(f"state must be a fastrwa.models.LMState (as returned by the "
                            f"model), got {type(state).__name__}")
        if len(state.layers) != len(self.scan):
            raise ValueError(f"state must hold {len(self.scan)} layer states (one per block), "
                             f"got {len(state.layers)}")
        for i, (layer, bufs, last) in enumerate(zip(state.layers, self.scan, self.last)):
            where = f"state.layers[{i}]"
            if not isinstance(layer, LayerState) or not isinstance(layer.scan, (tuple, list)) \
                    or len(layer.scan) != 3:
                raise TypeError(f"{where} must be a fastrwa.nn.LayerState with a ScanState, "
                                f"got {type(layer).__name__}")
            named = [(f"{where}.scan.{f}", t, buf)
                     for f, t, buf in zip(ScanState._fields, layer.scan, bufs)]
            if last is not None:
                named.append((f"{where}.last_input", layer.last_input, last))
            for name, value, buf in named:
                shape = tuple(buf.shape)
                if not isinstance(value, Tensor) or tuple(value.shape) != shape:
                    got = tuple(value.shape) if isinstance(value, Tensor) else value
                    raise ValueError(f"{name} must have shape {shape} (the cache's batch "
                                     f"and d_model), got {got!r}")
                if not value.is_floating_point():
                    raise TypeError(f"{name} must have a floating dtype, got {value.dtype}")
        for bufs, last, layer in zip(self.scan, self.last, state.layers):
            for buf, value in zip(bufs, layer.scan):
                buf.copy_(value)
            if last is not None:
                last.copy_(layer.last_input)

    @torch.no_grad()
    def reorder_(self, index: Tensor, check: bool = True) -> None:
        """``buffer <- buffer[index]`` along the batch, in place: ``index`` ``(B,)`` int32 or
        int64, the cache's row each row is taken from (beam search). ``check=False`` skips the
        range check of the values (a read back to the host); the others always run, before
        anything is written."""
        B = self.batch
        if not isinstance(index, Tensor):
            raise TypeError(f"index must be a torch.Tensor of shape (B,) = ({B},), "
                            f"got {type(index).__name__}")
        if index.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"index must hold integer batch positions (int32 or int64), "
                            f"got {index.dtype}")
        if tuple(index.shape) != (B,):
            raise ValueError(f"index must have shape (B,) = ({B},), one source row per row "
                             f"of the cache, got {tuple(index.shape)}")
        if index.device != self.device:
            raise ValueError(f"index must be on the cache's device {self.device}, "
                             f"got {index.device}")
        if check and B and not torch.compiler.is_compiling():
            low, high = (int(v) for v in torch.aminmax(index))
            if low < 0 or high >= B:
                raise ValueError(f"index must be in [0, {B}) (rows of the cache), "
                                 f"got values in [{low}, {high}]")
        for buf in self.stacked:
            buf.copy_(buf.index_select(1, index))

    @property
    def nbytes(self) -> int:
        """Bytes of the streaming state (scan states and previous inputs), work buffers aside."""
        return sum(t.numel() * t.element_size() for t in self.stacked)


class ByteLM(nn.Module):
    """Byte-level language model: embedding -> ``n_layers`` :class:`Block` -> norm -> head.

    ``logits, state = model(tokens, state=None)`` with ``tokens`` ``(B, T)`` integer ids in
    ``[0, vocab_size)``; ``logits`` ``(B, T, vocab_size)``. ``model.generate(prompt, ...)``
    prefills in parallel, then steps with O(1) state per layer.

    Example:
        >>> import torch
        >>> from fastrwa.models import ByteLM, LMConfig
        >>> model = ByteLM(LMConfig(d_model=32, n_layers=2))
        >>> logits, state = model(torch.randint(0, 256, (2, 16)))
        >>> logits.shape
        torch.Size([2, 16, 257])
        >>> out = model.generate(torch.tensor([104, 105]), max_new_tokens=5, top_k=10)
        >>> out.shape
        torch.Size([1, 7])
    """

    def __init__(self, config: LMConfig):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        if config.layer == "rda" and config.discount_init == "spread":
            for depth, block in enumerate(self.blocks):
                block.mix.set_discount_timescales(2.0, longest_timescale(depth, config.n_layers))
        self.norm = nn.RMSNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=config.d_model ** -0.5)
        if config.tie_embeddings:
            self.head.weight = self.embed.weight

    @classmethod
    def from_config(cls, config: LMConfig | dict) -> "ByteLM":
        """Build a model from an :class:`LMConfig` or its ``to_dict()``."""
        return cls(config if isinstance(config, LMConfig) else LMConfig.from_dict(config))

    # -- input checks -------------------------------------------------------------------
    def _check_tokens(self, tokens, rank: int, name: str = "tokens") -> Tensor:
        return check_tokens(tokens, self.config.vocab_size, rank, name)

    def _check_state(self, state) -> tuple:
        if state is None:
            return (None,) * len(self.blocks)
        if not isinstance(state, LMState) or len(state.layers) != len(self.blocks):
            raise TypeError(f"state must be a fastrwa.models.LMState with {len(self.blocks)} "
                            f"layer states (as returned by the model) or None, "
                            f"got {type(state).__name__}")
        return state.layers

    # -- parallel and streaming ---------------------------------------------------------
    def forward(self, tokens: Tensor, state: Optional[LMState] = None,
                mask: Optional[Tensor] = None,
                context_group: "torch.distributed.ProcessGroup | None" = None,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, LMState]:
        """Logits ``(B, T, vocab_size)`` for every position and the state after the last.

        ``mask`` ``(B, T)`` bool, ``False`` at tokens to skip (padding, anywhere in a row):
        they leave every layer's state as it was (:meth:`fastrwa.nn.RDA.forward`), so a
        padded row's logits at its kept tokens, and its final state, are those of the row
        without them. At a skipped token the logits are the last kept token's before it
        (the prediction from the state so far: right padding reads the next token's
        distribution at its last position); before a row's first kept token they are
        undefined.

        With ``context_group`` (context parallelism, docs/distributed.md) ``tokens`` is this
        rank's contiguous slice of the sequence along time (rank order is time order),
        ``state`` the state before the whole sequence on rank 0 (``None`` on the others),
        and the returned state the one after this rank's slice: the whole sequence's on the
        last rank. Every rank of the group makes the same calls (and, when training, the
        backward through its logits).

        With ``cu_seqlens`` (``(N + 1,)`` offsets, the op's convention) ``tokens`` ``(1,
        total)`` holds ``N`` documents back to back, each run as if alone (from its row of
        ``state``, an :class:`LMState` of ``N`` rows, or the initial state); the state
        returned has a row per document. Not with ``mask``. With ``context_group`` as well,
        ``tokens`` ``(1, slice)`` is this rank's slice of the packed sequence, ``cu_seqlens``
        the whole sequence's offsets on every rank (a document may span ranks), ``state``
        given on every rank or none, and the state returned the one after this slice of the
        document it ends in (one row per layer)."""
        try:
            tokens, states = self._check_tokens(tokens, 2), self._check_state(state)
            if context_group is not None and tokens.device != self.embed.weight.device:
                raise ValueError(f"tokens must be on the model's device "
                                 f"({self.embed.weight.device}), got {tokens.device}")
        except (TypeError, ValueError) as exc:
            if context_group is None:
                raise
            check_context_group(context_group)
            refuse_together(exc, context_group)     # (the other ranks raise too)
        if context_group is not None:               # (every rank's model is the same one)
            model = fingerprint(json.dumps(dataclasses.asdict(self.config), sort_keys=True,
                                           default=str))
            every = agree({"call": CALL_MODEL, "model configuration": model}, context_group,
                          tokens.device)
            same_everywhere(every, ("call", "model configuration"))
        x = self.embed(tokens)
        new = []
        for block, layer_state in zip(self.blocks, states):
            x, layer_state = block(x, layer_state, mask, context_group, cu_seqlens)
            new.append(layer_state)
        if mask is not None:                  # (a skipped token: the last kept one's output)
            x = x.gather(1, last_kept(mask).clamp(min=0)[..., None].expand_as(x))
        return self.head(self.norm(x)), LMState(tuple(new))

    def step(self, token: Tensor, state: LMState) -> tuple[Tensor, LMState]:
        """One token ``(B,)`` -> logits ``(B, vocab_size)`` and the new state (functional)."""
        token = self._check_tokens(token, 1, "token")
        x = self.embed(token)
        new = []
        for block, layer_state in zip(self.blocks, self._check_state(state)):
            x, layer_state = block.step(x, layer_state)
            new.append(layer_state)
        return self.head(self.norm(x)), LMState(tuple(new))

    def allocate_cache(self, batch: int) -> InferenceCache:
        """An :class:`InferenceCache` for ``batch`` sequences (an int >= 0)."""
        return InferenceCache(self, batch)

    # what an InferenceCache's buffers depend on, named for the messages
    _CACHE_FIELDS = ("n_layers", "d_model", "vocab_size", "layer", "token_shift", "mlp_ratio",
                     "discount_groups", "dtype", "device")

    def _cache_layout(self) -> tuple:
        c, weight = self.config, self.embed.weight
        groups = c.discount_groups if c.layer == "rda" else None      # (the step's buffers)
        return (len(self.blocks), c.d_model, c.vocab_size, c.layer, c.token_shift, c.mlp_ratio,
                groups, weight.dtype, weight.device)

    def _check_cache(self, cache: object) -> InferenceCache:
        """``cache`` was allocated by a model of this one's shape, dtype and device (an
        attribute comparison: cheap enough for every step)."""
        if not isinstance(cache, InferenceCache):
            raise TypeError(f"cache must be a fastrwa.models.InferenceCache (from "
                            f"model.allocate_cache(B)), got {type(cache).__name__}")
        mine = self._cache_layout()
        if cache.layout != mine:
            raise ValueError(f"cache was allocated by a model of another shape, dtype or "
                             f"device ({self.describe_layout(cache.layout)}); this model has "
                             f"{self.describe_layout(mine)}: allocate one with "
                             f"model.allocate_cache(B)")
        return cache

    @classmethod
    def describe_layout(cls, layout: tuple) -> str:
        """A cache layout (``InferenceCache.layout``) as ``field=value, ...`` for messages."""
        return ", ".join(f"{k}={v}" for k, v in zip(cls._CACHE_FIELDS, layout))

    def prefill(self, tokens: Tensor, cache: InferenceCache) -> Tensor:
        """Run ``tokens`` ``(B, T)`` (``B`` the cache's batch, ``T >= 1``) in parallel from
        the initial state, leave the final state in ``cache``, and return the last
        position's logits ``(B, vocab_size)``. The arguments are checked before anything
        runs (a refused call leaves the cache as it was)."""
        self._check_cache(cache)
        if isinstance(tokens, Tensor) and tokens.dim() == 2:      # (the forward checks the rest)
            if tokens.shape[0] != cache.batch:
                raise ValueError(f"tokens must have shape (B, T) = ({cache.batch}, T), the "
                                 f"cache's batch, got {tuple(tokens.shape)}")
            if tokens.shape[1] == 0:
                raise ValueError(f"tokens must hold at least one position (T >= 1): prefill "
                                 f"returns the last position's logits; got shape "
                                 f"{tuple(tokens.shape)}")
        logits, state = self(tokens)
        cache.load_(state)
        return logits[:, -1]

    @torch.no_grad()
    def step_(self, token: Tensor, cache: InferenceCache, check: bool = True) -> Tensor:
        """One token ``(B,)`` with the state in ``cache``, updated in place; returns logits.

        Allocates nothing on CPU: every intermediate lives in ``cache.work``, and the
        returned ``(B, vocab_size)`` logits are ``cache.work["logits"]``, overwritten by the
        next step (clone them to keep them). Matches :meth:`step` (tests/test_lm.py).
        ``check=False`` skips the range check of the ids, which reads them back to the host:
        then the step can be captured in a CUDA graph (an id out of range is then an indexing
        error of the device, not a ValueError). A cache allocated by a model of another shape,
        dtype or device is refused (``ValueError``) before anything is written.

        Example:
            >>> import torch
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
            >>> cache = model.allocate_cache(2)
            >>> model.step_(torch.tensor([65, 66]), cache).shape
            torch.Size([2, 257])
        """
        self._check_cache(cache)
        if not isinstance(token, Tensor) or token.dim() != 1 or token.shape[0] != cache.batch:
            got = f"{tuple(token.shape)} {token.dtype}" if isinstance(token, Tensor) \
                else type(token).__name__
            raise ValueError(f"token must be integer ids of shape (B,) = ({cache.batch},), "
                             f"got {got}")
        if token.dtype != torch.int64:
            raise TypeError(f"token must have dtype torch.int64 (the in-place step converts "
                            f"nothing), got {token.dtype}")
        work = cache.work
        if check and token.shape[0]:
            _check_ids(token, self.config.vocab_size, work["token_range"])
        x = torch.index_select(self.embed.weight, 0, token, out=work["x"])
        # (the cache's buffers match this model: its blocks' checks are not needed)
        for block, state, block_work in zip(self.blocks, cache.state.layers, work["blocks"]):
            block._step_into(x, state, block_work)
        rms_norm_into(x, self.norm, work["normed"], work["rstd"], work["wide"])
        return torch.mm(work["normed"], self.head.weight.t(), out=work["logits"])

    # -- generation -----------------------------------------------------------------------
    def decoder(self, weights: object = "auto"):
        """What runs the steps of ``generate``/``stream`` for their ``weights`` argument (see
        :meth:`generate`): this model (the eager :meth:`step_`), its step replayed from a
        CUDA graph (:class:`fastrwa.models.graphed.CUDAGraphDecoder`) or a
        :class:`fastrwa.models.PackedLM` of it. Each has ``prefill(tokens, cache)`` and
        ``step_(token, cache)`` on an :class:`InferenceCache` of this model (the Hugging
        Face class decodes through it).

        Example:
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> type(ByteLM(LMConfig(d_model=16, n_layers=1)).decoder("eager")).__name__
            'ByteLM'
        """
        from .packed import WEIGHT_FORMATS, PackedLM, unsupported_reason
        if isinstance(weights, PackedLM):
            if weights.model is not self:
                raise ValueError("weights is a PackedLM of another model: pack this one "
                                 "(PackedLM(model, ...)) or pass a format name")
            return weights
        if isinstance(weights, str) and weights in ("graph", "auto") \
                and self.embed.weight.is_cuda:
            from .graphed import CUDAGraphDecoder
            return CUDAGraphDecoder(self)
        if weights == "graph":
            raise ValueError(f"weights='graph' replays the step from a CUDA graph: the model "
                             f"must be on a CUDA device, it is on {self.embed.weight.device}")
        if weights == "eager":
            return self
        if weights == "auto":
            return self if unsupported_reason(self) else PackedLM(self, "float32")
        if weights not in WEIGHT_FORMATS:
            raise ValueError(f"weights must be 'auto', 'eager', 'graph', one of "
                             f"{WEIGHT_FORMATS} or a PackedLM of this model, got {weights!r}")
        return PackedLM(self, weights)

    @torch.no_grad()
    def generate(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, top_p: Optional[float] = None,
                 beam_size: int = 1, generator: Optional[torch.Generator] = None,
                 weights: object = "auto") -> Tensor:
        """Continue ``prompt`` by ``max_new_tokens`` tokens.

        Args:
            prompt: ``(B, P)`` or ``(P,)`` integer ids; an empty prompt starts from the BOS token.
            max_new_tokens: tokens to add.
            temperature: softmax temperature (> 0 and at most float32's largest, 3.4e38: the
                sampler computes in float32) for sampling; ignored by beam search (but
                checked).
            top_k: sample among the ``k`` most likely tokens only.
            top_p: sample from the smallest set of tokens whose probability reaches ``p``
                (in ``(0, 1]``, at least float32's smallest, 1.4e-45).
            beam_size: 1 samples; ``> 1`` runs beam search (deterministic, highest total
                log-probability) and returns the best beam per prompt.
            generator: a ``torch.Generator`` for reproducible sampling.
            weights: what runs the steps. ``"auto"``: on CUDA, :meth:`step_` replayed from a
                CUDA graph (``"graph"``: one launch a token); on CPU the fused decode step
                with float32 weights (:class:`fastrwa.models.PackedLM`) for a float32 model,
                else the eager step; ``"eager"``: :meth:`step_` (PyTorch ops, the reference);
                ``"float32"``, ``"bfloat16"``, ``"int8"``: the fused step with the weights
                stored so (packed for this call; a CPU float32 model only); or a
                ``PackedLM`` of this model (packed once for many calls). The fused step
                runs the prompt too, with the same weights.

        Returns:
            ``(B, P + max_new_tokens)`` ids (the prompt, then the new tokens). Memory does not
            grow with ``max_new_tokens`` beyond this output: the state is fixed-size per layer.
        """
        prompt, context = prepare_prompt(prompt, self.config.vocab_size, self.config.bos_token,
                                         max_new_tokens, temperature, top_k, top_p, beam_size)
        decoder = self.decoder(weights)
        if beam_size > 1:
            return self._beam_search(decoder, prompt, context, max_new_tokens, beam_size)
        return collect(prompt, self._stream(decoder, context, max_new_tokens, temperature,
                                            top_k, top_p, generator), max_new_tokens)

    @torch.no_grad()
    def stream(self, prompt: Tensor, max_new_tokens: int, temperature: float = 1.0,
               top_k: Optional[int] = None, top_p: Optional[float] = None,
               generator: Optional[torch.Generator] = None,
               weights: object = "auto") -> Iterator[Tensor]:
        """Sample as :meth:`generate` (the same arguments), yielding each new token ``(B,)``
        as soon as it is drawn (for printing text as it is produced). State: one fixed-size
        cache.

        Example:
            >>> import torch
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> model = ByteLM(LMConfig(d_model=16, n_layers=1))
            >>> [int(t) < 256 for t in model.stream(torch.tensor([104]), 3)]
            [True, True, True]
        """
        _, context = prepare_prompt(prompt, self.config.vocab_size, self.config.bos_token,
                                    max_new_tokens, temperature, top_k, top_p, 1)
        decoder = self.decoder(weights)
        yield from self._stream(decoder, context, max_new_tokens, temperature, top_k, top_p,
                                generator)

    def _stream(self, decoder, context, max_new_tokens, temperature, top_k, top_p, generator):
        if max_new_tokens == 0:
            return
        cache = self.allocate_cache(context.shape[0])
        logits = decoder.prefill(context, cache)
        if hasattr(decoder, "sample_steps"):        # a PackedLM: draws and steps in one loop
            yield from decoder.sample_steps(logits, cache, max_new_tokens, temperature, top_k,
                                            top_p, generator, self.config.bos_token)
            return
        yield from sample_loop(logits, lambda token: decoder.step_(token, cache),
                               max_new_tokens, temperature, top_k, top_p, generator,
                               self.config.bos_token, None if decoder is self else sample_fused)

    def _beam_search(self, decoder, prompt: Tensor, context: Tensor, max_new: int,
                     K: int) -> Tensor:
        B, P = prompt.shape
        V = self.config.vocab_size
        out = prompt.new_empty((B * K, P + max_new))
        out[:, :P] = prompt.repeat_interleave(K, dim=0)
        cache = self.allocate_cache(B * K)
        logits = decoder.prefill(context.repeat_interleave(K, dim=0), cache)
        scores = torch.full((B, K), float("-inf"), device=prompt.device)
        scores[:, 0] = 0.0                            # the K copies start as one beam
        base = torch.arange(B, device=prompt.device)[:, None] * K
        for i in range(max_new):
            logits = logits.float()
            logits[:, self.config.bos_token:] = float("-inf")  # BOS starts text; ids past it
                                                                # are not bytes either
            check_logits(logits, logits.amax(dim=-1, keepdim=True))
            logp = torch.log_softmax(logits, dim=-1).view(B, K, V)
            total = (scores[..., None] + logp).view(B, K * V)
            scores, flat = total.topk(K, dim=-1)                          # (B, K)
            origin = (base + flat // V).view(-1)
            token = (flat % V).view(-1)
            out.copy_(out.index_select(0, origin))
            out[:, P + i] = token
            cache.reorder_(origin, check=False)            # (in range by construction)
            if i + 1 < max_new:
                logits = decoder.step_(token, cache)
        best = scores.argmax(dim=-1)
        return out.view(B, K, P + max_new)[torch.arange(B, device=prompt.device), best]

    # -- persistence ----------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> None:
        """Write ``config.json`` and ``model.pt`` (tensors only) into ``directory``
        (:func:`fastrwa.models.save_pretrained`)."""
        save_pretrained(self, directory)

    @classmethod
    def load(cls, directory: str | os.PathLike, map_location=None) -> "ByteLM":
        """Load a model written by :meth:`save_pretrained` (:func:`fastrwa.models.load_pretrained`,
        which reads tensors only: ``torch.load(weights_only=True)``)."""
        model = load_pretrained(directory, map_location)
        if not isinstance(model, cls):
            raise ValueError(f"{directory} holds a {type(model).__name__}, not a {cls.__name__}")
        return model
