"""The streaming step of the scan layers and of :class:`fastrwa.models.ByteLM` in plain
PyTorch operations (no fastrwa custom op, no numba), for ONNX export: the layer's public
transforms (:meth:`~fastrwa.nn.RDA.value`, :meth:`~fastrwa.nn.RDA.discount_to_channels`,
:meth:`~fastrwa.nn.RDA.output`) around :func:`fastrwa.reference.weighted_step_reference`,
the max-stabilised recurrence with its limits (``-inf`` log-weights, an empty state, equal
infinities), one token at a time.

:class:`LayerStep` wraps an :class:`fastrwa.nn.RWA` / :class:`fastrwa.nn.RDA` (its own
parameters, not copies); :class:`ByteLMStep` a whole ``ByteLM``. Their ``forward`` takes
and returns the state as flat tensors, in the order of :func:`state_names`, so that an
exported graph has one named input and output per tensor. :func:`exportable_steps` makes
the ``step`` of every scan layer inside a user's module run :func:`layer_step`, so that
the user's own step exports with ``torch.onnx.export``.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn import RDA, RWA, LayerState, RDACell, RRACell, RWACell, Recurrent
# (the attention's log-weight and the discount's log-decay in plain operations: the torch
# backend's, which export as they are)
from ..ops.transforms import log_decay, log_weight
from ..reference import weighted_step_reference
from ..state import ScanState

if TYPE_CHECKING:                      # (annotations only: steps.py imports no models)
    import numpy as np

    from ..models import LMState

# The state of one scan layer, as named tensors: the scan's m, n, d and, with token_shift,
# the previous token's input.
SCAN_FIELDS = ("m", "n", "d")


def check_exportable(layer: object, where: str = "layer") -> None:
    """Raise ``ValueError`` (``TypeError`` for what is no scan layer) naming what the ONNX
    step cannot express: a bidirectional layer (its reverse direction needs the whole
    sequence). Every other option of ``RWA`` and ``RDA`` exports: the four attention
    functions, ``f_h``/``f_o``, ``discount_groups``, ``token_shift``, ``learn_initial_state``
    (``batch_first`` does not concern a step)."""
    if isinstance(layer, (RWACell, RDACell, RRACell, Recurrent)):
        raise TypeError(f"{where} is a fastrwa.nn.{type(layer).__name__}: the faithful cells "
                        f"are not exported to ONNX (only the scan layers fastrwa.nn.RWA and "
                        f"fastrwa.nn.RDA are)")
    if not isinstance(layer, (RWA, RDA)):
        raise TypeError(f"{where} must be a fastrwa.nn.RWA or fastrwa.nn.RDA, "
                        f"got {type(layer).__name__}")
    if layer.bidirectional:
        raise ValueError(f"{where} has bidirectional=True: its reverse direction reads the "
                         f"whole sequence, so it has no streaming step to export (ONNX "
                         f"export supports RWA/RDA with bidirectional=False)")


def layer_state_names(layer: nn.Module, prefix: str = "state") -> list[str]:
    """Names of a layer's state tensors: ``{prefix}.m``, ``.n``, ``.d`` and, with
    ``token_shift``, ``{prefix}.last``."""
    names = [f"{prefix}.{f}" for f in SCAN_FIELDS]
    return names + [f"{prefix}.last"] if layer.token_shift else names


def _linear(x: Tensor, linear: nn.Linear) -> Tensor:
    """``linear(x)`` in float32 as a ``MatMul`` (and an ``Add``) of the exported graph, not a
    ``Gemm``: onnxruntime's dynamic int8 quantisation quantises ``MatMul`` weights."""
    out = torch.matmul(x, linear.weight.float().t())
    return out if linear.bias is None else out + linear.bias.float()


def layer_step(layer: nn.Module, x: Tensor, m: Tensor, n: Tensor, d: Tensor,
               last: Optional[Tensor] = None) -> tuple[Tensor, ...]:
    """``layer.step`` (an ``RWA``/``RDA``) in plain operations: ``x`` ``(B, input_size)``
    and the state's tensors -> ``(y, m, n, d[, last])``, ``y`` ``(B, hidden_size)``."""
    inp = torch.cat([x, last], dim=-1) if layer.token_shift else x
    u, g, a, *c = torch.split(_linear(inp, layer.proj), list(layer.gate_widths), dim=-1)
    if isinstance(layer, RDA):          # (RDA's gamma = sigmoid(c), as fastrwa.rda_step's)
        log_w = log_weight(a, layer.attention)
        lam = layer.discount_to_channels(log_decay(c[0], "sigmoid"))
    else:
        log_w, lam = a, None
    y, (m, n, d) = weighted_step_reference(layer.value(u, g), log_w, lam, ScanState(m, n, d))
    y = layer.output(y)
    return (y, m, n, d, x) if layer.token_shift else (y, m, n, d)


class LayerStep(nn.Module):
    """The step of a scan layer as a module: ``forward(x, m, n, d[, last]) -> (y, m, n, d[,
    last])`` (:func:`layer_step`), on the layer's own parameters, for
    ``torch.onnx.export`` or to compose into a larger exported step."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        check_exportable(layer)
        self.layer = layer

    def forward(self, x: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        """``x`` ``(B, input_size)`` and the state ``m, n, d`` ``(B, hidden_size)`` (and
        ``last`` ``(B, input_size)`` with ``token_shift``) -> ``(y, m, n, d[, last])``, ``y``
        ``(B, hidden_size)``; every tensor computed in float32 (inputs of another dtype
        are converted)."""
        return layer_step(self.layer, x.float(), *(t.float() for t in state))


def _rms_norm(x: Tensor, norm: nn.RMSNorm) -> Tensor:
    """``torch.nn.RMSNorm`` written out (``eps`` float32's when unset), in float32."""
    eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
    out = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + eps)
    return out if norm.weight is None else out * norm.weight.float()


def block_step(block: nn.Module, x: Tensor, state: tuple[Tensor, ...]
               ) -> tuple[Tensor, tuple[Tensor, ...]]:
    """:meth:`fastrwa.models.Block.step` in plain operations (the residual stream ``x``
    ``(B, d_model)``, the layer's state tensors)."""
    normed = _rms_norm(x, block.norm1)
    h, *state = layer_step(block.mix, normed, *state)
    if block.gate is not None:
        h = h * torch.sigmoid(_linear(normed, block.gate))
    x = x + h
    up, down = block.mlp[0], block.mlp[2]
    return x + _linear(F.gelu(_linear(_rms_norm(x, block.norm2), up)), down), tuple(state)


class ByteLMStep(nn.Module):
    """One token of a ``ByteLM``: ``forward(ids, *state) -> (logits, *state)`` with ``ids``
    ``(B,)`` int64, the state flat in the order of :func:`state_names` (per block ``m, n,
    d`` and with ``token_shift`` ``last``, each ``(B, d_model)`` float32), ``logits`` ``(B,
    vocab_size)`` float32. The model's own parameters, computed in float32."""

    def __init__(self, model: nn.Module):
        super().__init__()
        for i, block in enumerate(model.blocks):
            check_exportable(block.mix, f"block {i}'s scan layer")
        self.model = model

    def forward(self, ids: Tensor, *state: Tensor) -> tuple[Tensor, ...]:
        """``ids`` ``(B,)`` int64 in ``[0, vocab_size)`` and the state tensors of
        :func:`state_names` (``(B, d_model)`` each) -> ``(logits, *next_state)``, ``logits``
        ``(B, vocab_size)`` float32. A negative id is mapped to ``vocab_size`` before the
        embedding's lookup, so that it is out of range for the exported ``Gather`` (an error
        there, as in PyTorch) instead of counting from the end as ONNX indices do."""
        model = self.model
        ids = torch.where(ids < 0, model.config.vocab_size, ids)
        x = F.embedding(ids, model.embed.weight.float())
        width = 4 if model.config.token_shift else 3
        new = []
        for i, block in enumerate(model.blocks):
            x, layer_state = block_step(block, x, state[i * width:(i + 1) * width])
            new.extend(layer_state)
        return (_linear(_rms_norm(x, model.norm), model.head), *new)


def state_names(model: nn.Module, prefix: str = "state") -> list[str]:
    """The names of a ``ByteLM``'s state tensors: ``{prefix}.{i}.m``, ``.n``, ``.d`` (and
    ``.last`` with ``token_shift``) for each block ``i``."""
    return [name for i, block in enumerate(model.blocks)
            for name in layer_state_names(block.mix, f"{prefix}.{i}")]


def flat_state(state: "LMState | LayerState") -> list[Tensor]:
    """An :class:`fastrwa.models.LMState` (or a :class:`fastrwa.nn.LayerState`) as the flat
    list of tensors of :func:`state_names` (of :func:`layer_state_names` for a layer's):
    per layer ``m, n, d`` and, with ``token_shift``, ``last``; detached, in float32."""
    layers = (state,) if isinstance(state, LayerState) else state.layers
    out = []
    for layer in layers:
        out.extend(t.detach().float() for t in layer.scan)
        if layer.last_input is not None:
            out.append(layer.last_input.detach().float())
    return out


def nested_state(flat: Sequence[Union[Tensor, "np.ndarray"]], token_shift: bool
                 ) -> "LMState":
    """The inverse of :func:`flat_state` for a ``ByteLM``: an ``LMState`` from the flat
    tensors in the order of :func:`state_names` (torch tensors or numpy arrays, converted
    by ``torch.as_tensor``); ``token_shift``: the model's (4 tensors a layer, else 3)."""
    from ..models import LMState       # (only for this conversion)

    width = 4 if token_shift else 3
    flat = [torch.as_tensor(t) for t in flat]
    layers = []
    for i in range(0, len(flat), width):
        part = flat[i:i + width]
        layers.append(LayerState(ScanState(*part[:3]), part[3] if token_shift else None))
    return LMState(tuple(layers))


def _exportable_step(layer: nn.Module):
    """``layer.step`` as :func:`layer_step` computes it: in float32 whatever the dtype of
    ``x_t`` and of the layer, as :class:`LayerStep` (the output, and ``last`` with
    ``token_shift``, back in ``x_t``'s dtype, as ``layer.step`` returns them; the scan's
    state float32, as ``layer.step``'s for every input dtype but float64)."""
    def step(x_t: Tensor, state: Optional[LayerState] = None
             ) -> tuple[Tensor, LayerState]:
        state = layer.initial_state(x_t.shape[0]) if state is None else state
        last = (state.last_input.float(),) if layer.token_shift else ()
        y, m, n, d, *rest = layer_step(layer, x_t.float(), *(t.float() for t in state.scan),
                                       *last)
        return y.to(x_t.dtype), LayerState(ScanState(m, n, d),
                                           rest[0].to(x_t.dtype) if rest else None)
    return step


@contextlib.contextmanager
def exportable_steps(module: nn.Module) -> Iterator[nn.Module]:
    """Within the ``with`` block, ``layer.step(x_t, state)`` of every ``RWA``/``RDA`` inside
    ``module`` (itself included) runs :func:`layer_step` (plain operations, the same
    numbers), so that a user's own module that steps its scan layers exports with
    ``torch.onnx.export``. A layer that cannot be exported is refused (``ValueError`` naming
    it) before anything changes. The layers' sequence ``forward`` is not changed: it is not
    exportable (export the step, and run a prompt through it)."""
    layers = [(name or type(module).__name__, sub) for name, sub in module.named_modules()
              if isinstance(sub, (RWA, RDA))]
    for name, layer in layers:
        check_exportable(layer, f"the layer {name!r}")
    for _, layer in layers:
        layer.step = _exportable_step(layer)           # (an instance attribute, removed below)
    try:
        yield module
    finally:
        for _, layer in layers:
            layer.__dict__.pop("step", None)
