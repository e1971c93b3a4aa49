"""Faithful cells: RWA and RDA as published, with gates that see ``[x_t, h_{t-1}]``, and the
RRA baseline. Inherently sequential (the slow path); :class:`Recurrent` runs a cell over time.

Each step's average is the max-stabilised update of docs/math.md §2 (the library's own step op),
so large logits are as safe here as in the scan layers.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor, nn

from .. import scan as _scan
from ..checks import check_flag, check_state
from ..ops.contract import state_dtype
from ..state import ScanState
from .checks import check_size, check_state_tensor, check_step_input
from .functional import NamedActivations, rda_functions


class CellState(NamedTuple):
    """State of :class:`RWACell` / :class:`RDACell`: the previous output ``h`` ``(B, H)`` and
    the running average's :class:`fastrwa.ScanState`."""

    h: Tensor
    scan: ScanState


class RRAState(NamedTuple):
    """State of :class:`RRACell`: ``h``, ``c`` ``(B, H)`` and ``history`` ``(B, K, H)`` holding
    ``h_{t-2}, ..., h_{t-K-1}`` (zeros before the sequence starts)."""

    h: Tensor
    c: Tensor
    history: Tensor


def _xavier(linear: nn.Linear, bias: float = 0.0) -> None:
    nn.init.xavier_uniform_(linear.weight)
    if linear.bias is not None:
        nn.init.constant_(linear.bias, bias)


class _AttentionCell(nn.Module):
    def __init__(self, input_size: int, hidden_size: int, n_recurrent_gates: int,
                 device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.input_size = check_size(input_size, "input_size")
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.u = nn.Linear(input_size, hidden_size, **factory)
        # g, a (and the discount) see [x_t, h_{t-1}]: one linear map per gate.
        self.gates = nn.ModuleList(nn.Linear(input_size + hidden_size, hidden_size, **factory)
                                   for _ in range(n_recurrent_gates))
        self.s0 = nn.Parameter(torch.empty(hidden_size, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights, zero biases, ``s_0 ~ N(0, 1)`` (the RWA paper's choices)."""
        _xavier(self.u)
        for gate in self.gates:
            _xavier(gate)
        nn.init.normal_(self.s0)

    def _f0(self, s0: Tensor) -> Tensor:
        return torch.tanh(s0)

    def initial_state(self, batch: int) -> CellState:
        """``h_0 = f(s_0)``, nothing seen yet (``n = d = 0``)."""
        sdt = state_dtype(self.s0.dtype)
        h0 = self._f0(self.s0).expand(batch, self.hidden_size)
        return CellState(h0, ScanState.empty(batch, self.hidden_size, dtype=sdt,
                                             device=self.s0.device))

    def _check(self, x_t: Tensor, state: Optional[CellState]) -> CellState:
        check_step_input(x_t, self.input_size, self.s0)
        B, H = x_t.shape[0], self.hidden_size
        if state is None:
            return self.initial_state(B)
        if not isinstance(state, CellState):
            raise TypeError(f"state must be a fastrwa.nn.CellState or None, "
                            f"got {type(state).__name__}")
        # (h is the input's dtype after a step; the parameters' in initial_state)
        check_state_tensor(state.h, "state.h", (B, H), x_t, (x_t.dtype, self.s0.dtype))
        if state.scan is None:
            raise TypeError("state.scan must be a fastrwa.ScanState, got None")
        return CellState(state.h, check_state(state.scan, "state.scan", self.s0, B, H))


class RWACell(_AttentionCell):
    """The Recurrent Weighted Average cell of Ostmeyer & Cowell (2017), as published.

    ``u = W_u x_t + b_u``; ``g = W_g [x_t, h_{t-1}] + b_g``; ``a = W_a [x_t, h_{t-1}] + b_a``;
    ``z = u * tanh(g)``; ``n_t = n_{t-1} + z exp(a)``, ``d_t = d_{t-1} + exp(a)``;
    ``h_t = tanh(n_t / d_t)``; ``h_0 = tanh(s_0)``, ``n_0 = d_0 = 0``.

    ``h_t, state = cell(x_t, state)`` with ``x_t`` ``(B, input_size)``.

    Example:
        >>> import torch, fastrwa
        >>> cell = fastrwa.nn.RWACell(4, 8)
        >>> h, state = cell(torch.randn(2, 4))
        >>> h.shape
        torch.Size([2, 8])
    """

    def __init__(self, input_size: int, hidden_size: int, device=None, dtype=None):
        super().__init__(input_size, hidden_size, 2, device=device, dtype=dtype)

    def forward(self, x_t: Tensor, state: Optional[CellState] = None) -> tuple[Tensor, CellState]:
        state = self._check(x_t, state)
        xh = torch.cat([x_t, state.h.to(x_t.dtype)], dim=-1)
        g, a = (gate(xh) for gate in self.gates)
        z = self.u(x_t) * torch.tanh(g)
        y, scan = _scan.rwa_step(z, a, state.scan)
        h = torch.tanh(y)
        return h, CellState(h, scan)


class RDACell(NamedActivations, _AttentionCell):
    """The Recurrent Discounted Attention cell, as published (gates see ``[x_t, h_{t-1}]``).

    As :class:`RWACell` plus ``gamma_t = sigmoid(W_gamma [x_t, h_{t-1}] + b_gamma)``:
    ``n_t = gamma_t n_{t-1} + f_a(a) z``, ``d_t = gamma_t d_{t-1} + f_a(a)``,
    ``h_t = f_h(n_t / d_t)``, output ``o_t = f_o(h_t)``. The discount bias starts at 1.

    Args:
        attention: ``f_a`` in "exp", "sigmoid", "softplus", "relu".
        f_h, f_o: "tanh", "identity", "sigmoid", "relu".
        preset: "exp-tanh" or "sigmoid-id" (the published best variants).

    ``o_t, state = cell(x_t, state)``; ``state.h`` is ``h_t`` (what the gates see next).

    Example:
        >>> import torch, fastrwa
        >>> cell = fastrwa.nn.RDACell(4, 8, preset="exp-tanh")
        >>> o, state = cell(torch.randn(2, 4))
    """

    def __init__(self, input_size: int, hidden_size: int, attention: str = "exp",
                 f_h: str = "tanh", f_o: str = "identity", preset: Optional[str] = None,
                 device=None, dtype=None):
        attention, f_h, f_o, _, _ = rda_functions(attention, f_h, f_o, preset)
        super().__init__(input_size, hidden_size, 3, device=device, dtype=dtype)
        # (names, not functions: a module that holds only data pickles and saves whole)
        self.attention, self.f_h_name, self.f_o_name = attention, f_h, f_o
        with torch.no_grad():
            self.gates[2].bias.fill_(1.0)

    def _f0(self, s0: Tensor) -> Tensor:
        return self._f_h(s0)

    def forward(self, x_t: Tensor, state: Optional[CellState] = None) -> tuple[Tensor, CellState]:
        state = self._check(x_t, state)
        xh = torch.cat([x_t, state.h.to(x_t.dtype)], dim=-1)
        g, a, c = (gate(xh) for gate in self.gates)
        z = self.u(x_t) * torch.tanh(g)
        y, scan = _scan.rda_step(z, a, c, state.scan, self.attention)
        h = self._f_h(y)
        return self._f_o(h), CellState(h, scan)


class RRACell(nn.Module):
    """Recurrent residual attention baseline: an LSTM whose cell adds an attention-weighted,
    normalised sum of the hidden states ``h_{t-2}, ..., h_{t-K-1}``.

    ``i, f, g, o`` from ``[x_t, h_{t-1}]`` as in an LSTM;
    ``r_t = sum_k softmax(w)_k h_{t-1-k}`` (``k = 1..K``, ``w`` learned);
    ``c_t = f * c_{t-1} + i * g + r_t``; ``h_t = o * tanh(c_t)``. Memory ``O(K * H)`` per sequence.
    This follows the seed description of RRA; where it is silent (where ``r_t`` enters, how
    the window is weighted) the choices above are ours.

    Example:
        >>> import torch, fastrwa
        >>> cell = fastrwa.nn.RRACell(4, 8, window=3)
        >>> h, state = cell(torch.randn(2, 4))
    """

    def __init__(self, input_size: int, hidden_size: int, window: int = 5, device=None,
                 dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.input_size = check_size(input_size, "input_size")
        self.hidden_size = check_size(hidden_size, "hidden_size")
        self.window = check_size(window, "window")
        self.lstm = nn.Linear(input_size + hidden_size, 4 * hidden_size, **factory)
        self.window_logits = nn.Parameter(torch.zeros(window, **factory))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        _xavier(self.lstm)
        with torch.no_grad():
            self.lstm.bias[self.hidden_size:2 * self.hidden_size].fill_(1.0)  # forget gate
            self.window_logits.zero_()

    def initial_state(self, batch: int) -> RRAState:
        zeros = self.lstm.weight.new_zeros(batch, self.hidden_size)
        return RRAState(zeros, zeros.clone(), self.lstm.weight.new_zeros(batch, self.window,
                                                                           self.hidden_size))

    def forward(self, x_t: Tensor, state: Optional[RRAState] = None) -> tuple[Tensor, RRAState]:
        check_step_input(x_t, self.input_size, self.lstm.weight)
        B, H = x_t.shape[0], self.hidden_size
        if state is None:
            state = self.initial_state(B)
        elif not isinstance(state, RRAState):
            raise TypeError(f"state must be a fastrwa.nn.RRAState or None, "
                            f"got {type(state).__name__}")
        check_state_tensor(state.h, "state.h", (B, H), x_t, (x_t.dtype,))
        check_state_tensor(state.c, "state.c", (B, H), x_t, (x_t.dtype,))
        check_state_tensor(state.history, "state.history", (B, self.window, H), x_t,
                           (x_t.dtype,))
        i, f, g, o = self.lstm(torch.cat([x_t, state.h], dim=-1)).chunk(4, dim=-1)
        alpha = torch.softmax(self.window_logits, dim=0)                    # [K]
        r = torch.einsum("k,bkh->bh", alpha, state.history)
        c = torch.sigmoid(f) * state.c + torch.sigmoid(i) * torch.tanh(g) + r
        h = torch.sigmoid(o) * torch.tanh(c)
        history = torch.cat([state.h[:, None], state.history[:, :-1]], dim=1)
        return h, RRAState(h, c, history)


class Recurrent(nn.Module):
    """Run a cell over a sequence: ``output, state = Recurrent(cell)(x, state=None)``.

    Args:
        cell: :class:`RWACell`, :class:`RDACell`, :class:`RRACell` (or any module with
            ``cell(x_t, state) -> (out_t, state)`` and ``initial_state(batch)``).
        batch_first: ``x`` is ``(B, T, input_size)`` (default) or ``(T, B, input_size)``.

    Example:
        >>> import torch, fastrwa
        >>> rnn = fastrwa.nn.Recurrent(fastrwa.nn.RWACell(4, 8))
        >>> out, state = rnn(torch.randn(2, 5, 4))
        >>> out.shape
        torch.Size([2, 5, 8])
    """

    def __init__(self, cell: nn.Module, batch_first: bool = True):
        super().__init__()
        if not isinstance(cell, nn.Module) or not callable(getattr(cell, "initial_state", None)):
            raise TypeError(f"cell must be a torch.nn.Module with an initial_state(batch) "
                            f"method (e.g. fastrwa.nn.RWACell), got {type(cell).__name__}")
        self.cell, self.batch_first = cell, check_flag(batch_first, "batch_first")

    def forward(self, x: Tensor, state=None):
        if not isinstance(x, Tensor) or x.dim() != 3:
            got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            raise ValueError(f"x must have shape (B, T, input_size), got {got}")
        if not self.batch_first:
            x = x.transpose(0, 1)
        outs = []
        for t in range(x.shape[1]):
            out, state = self.cell(x[:, t], state)
            outs.append(out)
        if state is None:
            state = self.cell.initial_state(x.shape[0])
        out = torch.stack(outs, dim=1) if outs else x.new_zeros(x.shape[0], 0,
                                                                self.cell.hidden_size)
        return (out if self.batch_first else out.transpose(0, 1)), state
