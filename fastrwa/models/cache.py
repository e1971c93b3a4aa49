"""The byte-level language model's streaming state: :class:`LMState` (one layer state per
block, as a forward returns it) and :class:`InferenceCache` (the same state in buffers
allocated once and updated in place by every decoder: the eager step, the CUDA graph and
the fused CPU step of :class:`fastrwa.models.PackedLM`)."""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch
from torch import Tensor, nn

from ..nn import LayerState
from ..nn.checks import check_count
from ..ops.contract import state_dtype
from ..state import ScanState
from .config import LMConfig


class CacheLayout(NamedTuple):
    """What an :class:`InferenceCache`'s buffers depend on: a cache is refused by a model
    (or a pack of one) of another layout. ``discount_groups`` is ``None`` unless the layer
    is ``"rda"`` (the step's buffers depend on it there only)."""

    n_layers: int
    d_model: int
    vocab_size: int
    layer: str
    token_shift: bool
    mlp_ratio: int
    discount_groups: Optional[int]
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        """``field=value, ...`` for messages."""
        return ", ".join(f"{k}={v}" for k, v in zip(self._fields, self))


class CachedModel(Protocol):
    """What an :class:`InferenceCache` is allocated for (a :class:`fastrwa.models.ByteLM`):
    its configuration, its embedding (the dtype and device of the buffers), its blocks (their
    step workspaces and initial states) and its layout."""

    config: LMConfig
    embed: nn.Embedding
    blocks: nn.ModuleList

    def cache_layout(self) -> CacheLayout: ...


class LMState(NamedTuple):
    """The model's streaming state: one :class:`fastrwa.nn.LayerState` per block."""

    layers: tuple


class InferenceCache:
    """Streaming state allocated once and updated in place (in the style of mamba's cache).

    Holds, per block, the scan state ``m, n, d`` ``(B, d_model)`` and the previous token's
    input ``(B, d_model)``: ``layers * (3 + 1) * B * d_model`` floats, whatever the length.
    ``load_`` copies a state in (after a prefill), ``reorder_`` permutes the batch (beam
    search); :meth:`ByteLM.step_` updates it in place. The next prefill can reuse it.
    """

    def __init__(self, model: CachedModel, batch: int):
        check_count(batch, "batch")
        d, dev = model.config.d_model, model.embed.weight.device
        dtype = model.embed.weight.dtype
        sdt = state_dtype(dtype)
        self.batch, self.device = batch, dev
        # what the buffers were sized for: ByteLM.step_ and prefill refuse another model's
        self.layout = model.cache_layout()
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

    def read_row(self, row: int) -> tuple[Tensor, ...]:
        """A copy of row ``row``'s state (an int in ``[0, batch)``): one ``(layers,
        d_model)`` tensor per buffer of ``stacked`` (scan ``m, n, d``, previous input), for
        :meth:`write_row_` of this cache or another of its layout (the server's prefix cache
        keeps a prompt's state so).

        Example:
            >>> from fastrwa.models import ByteLM, LMConfig
            >>> model = ByteLM(LMConfig(d_model=16, n_layers=1))
            >>> a, b = model.allocate_cache(2), model.allocate_cache(1)
            >>> b.write_row_(0, a.read_row(1))
        """
        self._check_row(row)
        return tuple(buf[:, row].clone() for buf in self.stacked)

    @torch.no_grad()
    def write_row_(self, row: int, saved: tuple) -> None:
        """Copy ``saved`` (what :meth:`read_row` returned, from a cache of this layout) into
        row ``row``; the other rows are left as they were. Checked before anything is
        written (``ValueError``)."""
        self._check_row(row)
        if not isinstance(saved, tuple) or len(saved) != len(self.stacked) or any(
                not isinstance(t, Tensor) or t.shape != buf[:, row].shape
                for t, buf in zip(saved, self.stacked)):
            raise ValueError("saved must be what read_row returned for a cache of this "
                             "layout (one (layers, d_model) tensor per buffer)")
        for buf, t in zip(self.stacked, saved):
            buf[:, row].copy_(t)

    def _check_row(self, row: object) -> None:
        if isinstance(row, bool) or not isinstance(row, int) or not 0 <= row < self.batch:
            raise ValueError(f"row must be an int in [0, {self.batch}) (the cache's rows), "
                             f"got {row!r}")

    @property
    def nbytes(self) -> int:
        """Bytes of the streaming state (scan states and previous inputs), work buffers aside."""
        return sum(t.numel() * t.element_size() for t in self.stacked)
