"""A block of the byte-level language model: pre-norm -> scan layer -> residual -> pre-norm
-> MLP -> residual (:class:`Block`), with the step that decodes one token in place."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from ..checks import check_no_overlap
from ..nn import RDA, RWA, LayerState
from ..nn.checks import check_buffer, check_input_dtype
from ..nn.functional import rms_norm_into
from ..ops.contract import state_dtype
from .config import LMConfig


def longest_timescale(depth: int, n_layers: int) -> float:
    """``discount_init="spread"``: block ``depth``'s longest memory, 16 tokens in the first
    block to 1024 in the last (log-spaced)."""
    return 2.0 ** (4 + 6 * depth / max(1, n_layers - 1))


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
        return self.unchecked_step_(x, state, work)

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

    def unchecked_step_(self, x: Tensor, state: LayerState, work: dict) -> Tensor:
        """:meth:`step_` without its checks, for a caller that has made them
        (:meth:`fastrwa.models.ByteLM.step_` checks its cache once and steps each block
        through this). Arguments :meth:`step_` would refuse give undefined results here."""
        normed, h = work["normed"], work["h"]
        rms_norm_into(x, self.norm1, normed, work["rstd"], work["wide"])
        self.mix.unchecked_step_(normed, state, h, work["mix"])
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
