"""Scan layers: RWA and RDA whose gates see the input only, so they run on the parallel scan.

``output, state = layer(x, state=None)`` like ``torch.nn.GRU``; ``layer.step(x_t, state)``
advances one token with O(1) state. docs/api.md ("Layers: fastrwa.nn") lists the options.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from einops import rearrange, repeat
from torch import Tensor, nn

from .. import scan as _scan
from ..ops.contract import state_dtype
from ..state import ScanState
from ..checks import check_context_group, check_cu_seqlens, check_no_overlap
from ..ops.context import (CALL_LAYER, DTYPES, after, agree, fingerprint, previous_input,
                           refuse_together, same_everywhere)
from .checks import (check_buffer, check_count, check_groups, check_input_dtype, check_mask,
                     check_size, check_state_tensor)
from .functional import ACTIVATIONS_OUT, NamedActivations, rda_functions
from .masks import last_kept, last_kept_before

# Layouts of in-place step arguments whose memory passed the overlap checks of
# _ScanLayer.step_ (the written tensors' addresses and strides, the batch and dtype): a
# decode loop steps the same buffers every token and pays those checks once. Bounded:
# emptied when full (as fastrwa.scan's memo of the op's in-place steps).
_NO_OVERLAP: set = set()
_NO_OVERLAP_MAX = 4096
_SCAN_NAMES = tuple(f"state.scan.{field}" for field in ScanState._fields)


class LayerState(NamedTuple):
    """The streaming state of a scan layer.

    Attributes:
        scan: :class:`fastrwa.ScanState` with tensors ``(B, directions * hidden_size)``
            (a bidirectional layer keeps the forward direction's channels first).
        last_input: ``(B, input_size)``, the previous token's input when the layer mixes in
            the previous token (``token_shift=True``), else ``None``.
    """

    scan: ScanState
    last_input: Optional[Tensor] = None


class _ScanLayer(nn.Module):
    """Shared machinery of :class:`RWA` and :class:`RDA`."""

    _discounted: bool = False
    # (a class default: a layer pickled before the option existed loads as per-channel)
    discount_groups: Optional[int] = None
    # the buffers of step_workspace's dict
    _WORK_KEYS = frozenset(("inp", "inp_x", "inp_last", "proj", "u", "tanh_g", "z", "y",
                            "a_logits", "a"))

    def __init__(self, input_size: int, hidden_size: int, *, batch_first: bool,
                 bidirectional: bool, token_shift: bool, learn_initial_state: bool,
                 discount_groups: Optional[int] = None, device=None, dtype=None):
        super().__init__()
        check_size(input_size, "input_size"), check_size(hidden_size, "hidden_size")
        check_groups(discount_groups, "discount_groups", hidden_size, "hidden_size")
        self.input_size, self.hidden_size = input_size, hidden_size
        self.batch_first, self.bidirectional = batch_first, bidirectional
        self.token_shift, self.learn_initial_state = token_shift, learn_initial_state
        self.discount_groups = discount_groups
        self.num_directions = 2 if bidirectional else 1
        self.num_gates = 4 if self._discounted else 3            # u, g, a (, gamma)
        features = input_size * (2 if token_shift else 1)
        out = self.num_directions * sum(self.gate_widths)
        factory = dict(device=device, dtype=dtype)
        self.proj = nn.Linear(features, out, **factory)          # one fused projection
        width = self.num_directions * hidden_size
        # The learned initial state (the RWA paper's s_0): a pseudo-step with value s_0 and
        # log-weight a_0 before the first token, discounted like any other step.
        self.initial_value = nn.Parameter(torch.empty(width, **factory),
                                          requires_grad=learn_initial_state)
        self.initial_logit = nn.Parameter(torch.empty(width, **factory),
                                          requires_grad=learn_initial_state)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform weights per gate (a grouped discount's rows: the bound of
        ``hidden_size`` rows, as per-channel), zero biases, discount bias 1, s_0 ~ N(0, 1),
        a_0 = 0."""
        with torch.no_grad():
            # views (in-place initialisation): one (width, input) block per direction and gate
            for d in range(self.num_directions):
                for block in self._gate_rows(self.proj.weight, d):
                    if block.shape[0] == self.hidden_size:
                        nn.init.xavier_uniform_(block)
                    else:   # (grouped discount: the per-channel rows' bound, as if H rows)
                        bound = math.sqrt(6 / (block.shape[1] + self.hidden_size))
                        nn.init.uniform_(block, -bound, bound)
            self.proj.bias.zero_()
            if self._discounted:
                for d in range(self.num_directions):
                    self._gate_rows(self.proj.bias, d)[3].fill_(1.0)
            nn.init.normal_(self.initial_value)
            self.initial_value.mul_(1.0 if self.learn_initial_state else 0.0)
            if self.learn_initial_state:
                self.initial_logit.zero_()
            else:
                self.initial_logit.fill_(float("-inf"))

    @property
    def gate_widths(self) -> tuple[int, ...]:
        """Each direction's rows of the fused projection, per gate (``u, g, a[, c]``):
        ``hidden_size`` each, but one discount logit per group with ``discount_groups``."""
        H = self.hidden_size
        return (H, H, H) + ((self.discount_groups or H,) if self._discounted else ())

    def _gate_rows(self, t: Tensor, direction: int) -> tuple[Tensor, ...]:
        """Views of direction ``direction``'s rows of the projection's weight or bias ``t``,
        one per gate (``u, g, a[, c]``)."""
        per_direction = sum(self.gate_widths)
        return t[direction * per_direction:(direction + 1) * per_direction].split(
            self.gate_widths)

    # -- state -------------------------------------------------------------------------
    def initial_state(self, batch: int) -> LayerState:
        """The state before the first token: the learned prior (or empty), shapes ``(B, ...)``.

        Its tensors are its own (never views of the parameters), so :meth:`step_` may update
        them in place."""
        width = self.num_directions * self.hidden_size
        sdt = state_dtype(self.proj.weight.dtype)
        m = self.initial_logit.to(sdt).expand(batch, width).clone()
        n = self.initial_value.to(sdt).expand(batch, width)
        seen = (m > float("-inf")).to(sdt)
        last = None
        if self.token_shift:
            last = self.proj.weight.new_zeros(batch, self.input_size)
        return LayerState(ScanState(m, n * seen, seen), last)

    def _check_state(self, state, x: Tensor, batch: Optional[int] = None) -> LayerState:
        """``state`` for input ``x`` (``(B, ...)``; ``batch`` rows when packed): shapes, and
        ``last_input`` present with ``x``'s dtype (or the layer's) and device exactly when
        the layer shifts tokens (the scan tensors' dtypes and devices are the op's to
        check)."""
        batch = x.shape[0] if batch is None else batch
        if state is None:
            return self.initial_state(batch)
        if not isinstance(state, LayerState):
            raise TypeError(f"state must be a fastrwa.nn.LayerState (as returned by this layer) "
                            f"or None, got {type(state).__name__}")
        width = self.num_directions * self.hidden_size
        if tuple(state.scan.m.shape) != (batch, width):
            raise ValueError(f"state.scan tensors must have shape (B, directions * hidden_size)"
                             f" = {(batch, width)}, got {tuple(state.scan.m.shape)}")
        if self.token_shift and (state.last_input is None
                                 or tuple(state.last_input.shape) != (batch, self.input_size)):
            got = None if state.last_input is None else tuple(state.last_input.shape)
            raise ValueError(f"state.last_input must have shape (B, input_size) = "
                             f"{(batch, self.input_size)} for a token_shift layer, got {got}")
        last = state.last_input
        if not self.token_shift and last is not None:
            raise ValueError("state.last_input must be None: this layer has no token shift "
                             "(a state of a token_shift layer given to one without?)")
        if last is not None:              # (the input's dtype, or the layer's under autocast)
            check_state_tensor(last, "state.last_input", (batch, self.input_size), x,
                               (x.dtype, self.proj.weight.dtype))
        return state

    def _check_input(self, x, rank: int, name: str = "x", autocast: bool = True) -> None:
        """``x`` of ``rank`` 3 (a sequence) or 2 (a token), floating, on the layer's device
        and in its dtype (any floating dtype under ``torch.autocast`` if ``autocast``)."""
        layout = ("(B, T, input_size)" if self.batch_first else "(T, B, input_size)") \
            if rank == 3 else "(B, input_size)"
        if not isinstance(x, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape {layout}, "
                            f"got {type(x).__name__}")
        if x.dim() != rank or x.shape[-1] != self.input_size:
            raise ValueError(f"{name} must have shape {layout} with input_size = "
                             f"{self.input_size}, got {tuple(x.shape)}")
        check_input_dtype(x, name, self.proj.weight, "layer", autocast)

    # -- the computation -----------------------------------------------------------------
    def _gates(self, x: Tensor, previous: Optional[Tensor],
               mask: Optional[Tensor] = None) -> list[tuple[Tensor, ...]]:
        """Per direction, the gate pre-activations ``(u, g, a[, c])``, each ``(B, T, H)``,
        from ``x`` ``(B, T, input)``: views of one projection, split along its features (the
        split's backward is one concatenation into the projection's gradient; indexing a
        ``(dir, gate, ...)`` view instead cost a zero-fill and three copies of it). With a
        ``mask``, the token shift's previous input is that of the last unmasked token."""
        if self.token_shift:
            inputs = torch.cat([previous[:, None].to(x.dtype), x], dim=1)    # (B, 1 + T, I)
            if mask is None:
                shifted = inputs[:, :x.shape[1]]
            else:
                shifted = inputs.gather(1, last_kept_before(mask)[..., None].expand_as(x))
            x = torch.cat([x, shifted], dim=-1)
        return self._shaped_gates(self.proj(x).split(self.gate_widths * self.num_directions,
                                                     dim=-1))

    def _shaped_gates(self, parts) -> list[tuple[Tensor, ...]]:
        """The projection's parts as each direction's gates (a group's discount given to each
        of its channels)."""
        G = self.num_gates
        gates = [parts[d * G:(d + 1) * G] for d in range(self.num_directions)]
        if self.discount_groups is not None:
            gates = [(*mine[:3], self.discount_to_channels(mine[3])) for mine in gates]
        return gates

    def discount_to_channels(self, c: Tensor) -> Tensor:
        """Each group's discount (its logit, or any elementwise function of it) given to each
        of its channels: ``(..., discount_groups)`` -> ``(..., hidden_size)``, group ``k`` to
        channels ``k * r .. (k + 1) * r - 1`` (``r = hidden_size / discount_groups``); ``c``
        itself for a per-channel discount (and for RWA, which has none).

        Example:
            >>> import torch, fastrwa
            >>> layer = fastrwa.nn.RDA(8, 4, discount_groups=2)
            >>> layer.discount_to_channels(torch.tensor([1.0, 2.0]))
            tensor([1., 1., 2., 2.])
        """
        if self.discount_groups is None:
            return c
        return repeat(c, "... c -> ... (c r)", r=self.hidden_size // self.discount_groups)

    def _scan(self, gates: tuple[Tensor, ...], state: Optional[ScanState], reverse: bool,
              step: bool, context_group=None, cu_seqlens=None):
        raise NotImplementedError

    @staticmethod
    def value(u: Tensor, g: Tensor) -> Tensor:
        """The value ``z = u * tanh(g)`` the scan averages, from the gate pre-activations
        ``u`` and ``g`` (the first two of the fused projection's, any shape, elementwise)."""
        return u * torch.tanh(g)

    def output(self, y: Tensor) -> Tensor:
        """The layer's output from the scan's average ``y = n / d`` (any shape,
        elementwise): ``tanh(y)`` for RWA, ``f_o(f_h(y))`` for RDA."""
        raise NotImplementedError

    def forward(self, x: Tensor, state: Optional[LayerState] = None,
                mask: Optional[Tensor] = None,
                context_group: "dist.ProcessGroup | None" = None,
                cu_seqlens: Optional[Tensor] = None) -> tuple[Tensor, LayerState]:
        """Run the layer over a whole sequence (or over packed sequences: ``cu_seqlens``).

        Args:
            x: ``(B, T, input_size)`` (``(T, B, input_size)`` if ``batch_first=False``).
            state: a :class:`LayerState` to continue from, or ``None`` for the initial state.
            mask: ``(B, T)`` bool (``(T, B)`` if ``batch_first=False``), ``False`` at tokens
                to skip (padding, anywhere in a row): they leave the state as it was (no
                weight, no discount, not the token shift's previous input), as if the row
                had not held them; their outputs are those of the state so far.
            context_group: a ``torch.distributed`` process group over whose ranks the sequence
                is split along time (context parallelism, docs/distributed.md): ``x`` is this
                rank's contiguous slice (rank order is time order; lengths may differ, 0
                included). ``state`` is then the state before the whole sequence, given on
                rank 0 only (``None`` elsewhere; a bidirectional layer takes none), and every
                rank of the group must make the same calls.
            cu_seqlens: packed sequences, the op's convention: ``x`` is ``(1, total,
                input_size)`` (``(total, 1, input_size)`` time-first) holding ``N``
                sequences back to back, ``cu_seqlens`` ``(N + 1,)`` int32/int64 their
                offsets (``0, len_0, len_0 + len_1, ..., total``). Each sequence runs as if
                alone: from its row of ``state`` (a :class:`LayerState` of ``N`` rows, or the
                initial state), its token shift starting from that row's ``last_input``; the
                returned state has a row per sequence. Not with ``mask``. With
                ``context_group`` too, ``x`` is this rank's slice of the packed sequence and
                ``cu_seqlens`` the whole sequence's offsets (the same on every rank; a
                sequence may span ranks), ``state`` given on every rank or none, and the
                returned state is one row: the state after this slice of the sequence it
                ends in.

        Returns:
            ``(output, state)``: output ``(B, T, directions * hidden_size)`` (time first if
            ``batch_first=False``) and the :class:`LayerState` after the last token (with
            ``context_group``: after this rank's slice in each direction's order, so the
            whole sequence's on the last rank, for a bidirectional layer its forward
            channels there and its reverse channels on rank 0).
        """
        if cu_seqlens is not None:
            return self._packed(x, state, mask, context_group, cu_seqlens)
        if context_group is None:
            self._check_input(x, 3)
            if mask is not None:
                check_mask(mask, x, self.batch_first)
                mask = mask if self.batch_first else mask.t()
            if not self.batch_first:
                x = rearrange(x, "t b i -> b t i")
            state = self._check_state(state, x)
            previous = state.last_input
        else:
            x, state, previous, _ = self._split_inputs(x, state, mask, context_group)
        gates = self._gates(x, previous, mask)
        H = self.hidden_size
        ys, finals = [], []
        for d in range(self.num_directions):
            part = ScanState(*(s[:, d * H:(d + 1) * H] for s in state.scan))
            mine = gates[d]
            if mask is not None:        # no weight (a = -inf) and no discount (c = +inf)
                skip = ~mask[..., None]
                mine = (*mine[:2], mine[2].masked_fill(skip, float("-inf")),
                        *(c.masked_fill(skip, float("inf")) for c in mine[3:]))
            if context_group is not None:
                world = dist.get_world_size(context_group)
                if dist.get_rank(context_group) != (world - 1 if d == 1 else 0):
                    part = None         # (the state before the sequence is the first rank's)
                if d == 1 and ys[0].requires_grad:
                    # the two directions' gathers: their backward all-reduces in one order
                    mine = (after(mine[0], ys[0]), *mine[1:])
            y, final = self._scan(mine, part, reverse=d == 1, step=False,
                                  context_group=context_group)
            ys.append(y)
            finals.append(final)
        out, final = self._joined(ys, finals)
        if context_group is not None and self.token_shift and not x.shape[1]:
            # an empty slice: its output in the graph of the input before it (an exact 0), so
            # that a backward from it runs the gather's all-reduce as the other ranks do
            out = out + previous.sum().to(out.dtype) * 0
        # a copy, not a view of x: step_ updates a state's last_input in place
        last = x[:, -1].clone() if self.token_shift and x.shape[1] else previous
        if self.token_shift and mask is not None and x.shape[1]:   # the last kept token's
            last = torch.where(mask.any(dim=1, keepdim=True),
                               x.gather(1, last_kept(mask)[:, -1, None, None].clamp(min=0)
                                        .expand(-1, 1, x.shape[2]))[:, 0], previous)
        if not self.batch_first:
            out = rearrange(out, "b t h -> t b h")
        return out, LayerState(final, last)

    def _joined(self, ys: list, finals: list) -> tuple[Tensor, ScanState]:
        """The output and the final state of the directions' scans, channels side by side."""
        out = torch.cat([self.output(y) for y in ys], dim=-1) if len(ys) > 1 \
            else self.output(ys[0])
        final = finals[0] if len(finals) == 1 else ScanState(
            *(torch.cat(parts, dim=-1) for parts in zip(*finals)))
        return out, final

    def _packed(self, x, state, mask, context_group, cu_seqlens) -> tuple[Tensor, LayerState]:
        """:meth:`forward` over packed sequences (``cu_seqlens``), on one process or, with
        ``context_group``, over the ranks (:meth:`_split_inputs`)."""
        if context_group is not None:
            x, state, previous, lengths = self._split_inputs(x, state, mask, context_group,
                                                             cu_seqlens)
            lo = sum(lengths[:dist.get_rank(context_group)])
        else:
            if mask is not None:
                raise ValueError("cu_seqlens cannot be combined with mask (packed sequences "
                                 "need no padding)")
            self._check_input(x, 3)
            if not self.batch_first:
                x = rearrange(x, "t b i -> b t i")
            n_seq = check_cu_seqlens(cu_seqlens, x)
            state = self._check_state(state, x, batch=n_seq)
            lo, previous = 0, None
        cu = cu_seqlens.to(torch.int64)
        T = x.shape[1]
        starts, lengths = cu[:-1], cu[1:] - cu[:-1]
        seen = lengths > 0
        if self.token_shift:            # each sequence's first token shifts in its last_input
            earlier = torch.cat([x.new_zeros(1, 1, x.shape[2]), x], dim=1)[:, :T]
            here = seen & (starts >= lo) & (starts < lo + T)      # (begun in this slice)
            at = starts[here] - lo
            earlier = earlier.index_put((torch.zeros_like(at), at),
                                        state.last_input[here].to(x.dtype))
            if previous is not None and T and not bool((starts[seen] == lo).any()):
                # (a sequence begun on an earlier rank: its token before this slice)
                earlier = torch.cat([previous[:, None].to(x.dtype), earlier[:, 1:]], dim=1)
            elif previous is not None and previous.requires_grad:
                # (not read, but in the graph, with a zero gradient: the backward runs the
                # gather's all-reduce on every rank, in the same order)
                earlier = after(earlier, previous)
            x_in = torch.cat([x, earlier], dim=-1)
        else:
            x_in = x
        parts = self.proj(x_in).split(self.gate_widths * self.num_directions, dim=-1)
        gates = self._shaped_gates(parts)
        H = self.hidden_size
        ys, finals = [], []
        for d in range(self.num_directions):
            part = ScanState(*(s[:, d * H:(d + 1) * H] for s in state.scan))
            mine = gates[d]
            if context_group is not None and d == 1 and ys[0].requires_grad:
                # the two directions' gathers: their backward all-reduces in one order
                mine = (after(mine[0], ys[0]), *mine[1:])
            y, final = self._scan(mine, part, reverse=d == 1, step=False,
                                  context_group=context_group, cu_seqlens=cu_seqlens)
            ys.append(y)
            finals.append(final)
        out, final = self._joined(ys, finals)
        last = None
        if context_group is not None:  # (after this slice: its last input, of one row)
            if self.token_shift:
                last = x[:, -1].clone() if T else previous
                if not T:              # (an empty slice: its output in the gather's graph)
                    out = out + previous.sum().to(out.dtype) * 0
        elif self.token_shift:          # each sequence's last token (an empty one: its own)
            last = state.last_input.to(x.dtype)
            if T:
                last = torch.where(seen[:, None], x[0, (cu[1:] - 1).clamp(min=0)], last)
        if not self.batch_first:
            out = rearrange(out, "b t h -> t b h")
        return out, LayerState(final, last)

    def _split_inputs(self, x, state, mask, group, cu_seqlens=None) -> tuple:
        """:meth:`forward`'s checks under context parallelism, one agreement of every rank
        (the same layer, batch, width, dtype and grad mode), then the token shift's input
        before this rank's slice: ``(x (B, T, input), state, previous input, every rank's
        slice length)``. With ``cu_seqlens`` (packed sequences over the ranks) they are the
        whole row's offsets, the same on every rank and ending at the sum of the slices'
        lengths, and ``state`` (a row per sequence) is given on every rank or on none. A
        rank whose arguments are refused tells the others, which raise too (none waits)."""
        check_context_group(group)
        given = state is not None
        try:
            if mask is not None:
                raise ValueError("mask and context_group cannot be combined (padding is not "
                                 "split across ranks)")
            self._check_input(x, 3)
            if cu_seqlens is None and given and (self.bidirectional
                                                 or dist.get_rank(group) != 0):
                raise ValueError("with context_group, state is the state before the whole "
                                 "sequence: pass it on rank 0 only (None on the others; a "
                                 "bidirectional layer takes none)")
            if x.dtype not in DTYPES:
                raise TypeError(f"x must be float16, bfloat16, float32 or float64 with "
                                f"context_group, got {x.dtype}")
            if not self.batch_first:
                x = rearrange(x, "t b i -> b t i")
            n_seq = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, x, whole=False)
            state = self._check_state(state, x, batch=n_seq)
        except (TypeError, ValueError) as exc:
            refuse_together(exc, group)
        B, T, _ = x.shape
        grad = torch.is_grad_enabled() and (
            x.requires_grad or any(p.requires_grad for p in self.parameters())
            or any(t is not None and t.requires_grad for t in (*state.scan, state.last_input)))
        layer = fingerprint(f"{type(self).__name__}({self.extra_repr()})")
        offsets = None if cu_seqlens is None else cu_seqlens.tolist()
        every = agree({"call": CALL_LAYER, "layer (class, sizes and options)": layer,
                       "batch B": B, "input_size": x.shape[2], "dtype": DTYPES.index(x.dtype),
                       "grad mode": int(torch.is_grad_enabled()), "needs grad": int(grad),
                       "length": T,
                       "cu_seqlens": 0 if offsets is None else fingerprint(repr(offsets)) + 1,
                       "state given": 0 if offsets is None else int(given)}, group, x.device)
        same_everywhere(every, ("call", "layer (class, sizes and options)", "batch B",
                                "input_size", "dtype", "grad mode", "cu_seqlens",
                                "state given"))
        lengths = every["length"]
        if offsets is not None and offsets[-1] != sum(lengths):
            raise ValueError(f"context parallel: cu_seqlens are the whole packed sequence's "
                             f"offsets and must end at its length {sum(lengths)} (the "
                             f"slices' {lengths}), got {offsets[-1]}")
        if not self.token_shift:        # (the scans' own agreement checks the rest)
            return x, state, state.last_input, lengths
        # (packed: the input before a slice is only read by a sequence that began earlier)
        initial = state.last_input if offsets is None else state.last_input[:1]
        previous = previous_input(x, initial, lengths, group, any(every["needs grad"]),
                                  x.dtype)
        return x, state, previous, lengths

    def step(self, x_t: Tensor, state: Optional[LayerState] = None) -> tuple[Tensor, LayerState]:
        """Advance one token: ``x_t`` ``(B, input_size)`` -> ``(output_t (B, H), new state)``.

        Equals ``forward`` on the whole sequence, token by token. Not available for
        bidirectional layers (the reverse direction needs the future).
        """
        if self.bidirectional:
            raise RuntimeError("step() is not defined for a bidirectional layer: its reverse "
                               "direction needs the whole sequence; call the layer on it")
        self._check_input(x_t, 2, "x_t")
        state = self._check_state(state, x_t)
        gates = self._gates(x_t[:, None], state.last_input)[0]
        y, final = self._scan(gates, state.scan, reverse=False, step=True)
        last = x_t.clone() if self.token_shift else None
        return self.output(y)[:, 0], LayerState(final, last)

    # -- allocation-free streaming ----------------------------------------------------------
    def step_workspace(self, batch: int, dtype: Optional[torch.dtype] = None) -> dict:
        """Buffers :meth:`step_` writes into, for ``batch`` rows and inputs of ``dtype`` (the
        layer's by default): allocate once per decode."""
        check_count(batch, "batch")
        H, I, dev = self.hidden_size, self.input_size, self.proj.weight.device
        dtype = dtype or self.proj.weight.dtype
        new = lambda width: torch.empty(batch, width, dtype=dtype, device=dev)  # noqa: E731
        inp, proj = new(self.proj.in_features), new(self.proj.out_features)
        work = dict(inp=inp, inp_x=inp[:, :I], inp_last=inp[:, I:], proj=proj,
                    u=proj[:, :H], tanh_g=proj[:, H:2 * H], z=new(H), y=new(H))
        # the gate logits the scan kernel reads (which wants each contiguous): the
        # projection's own columns where they are (one row), else buffers copied into
        gates = (("a", 2), ("g", 3)) if self._discounted else (("a", 2),)
        for name, k in gates:
            view = proj[:, k * H:k * H + self.gate_widths[k]]
            work[name + "_logits"] = view
            work[name] = view if view.is_contiguous() and view.shape[1] == H else new(H)
            if view.shape[1] != H:          # grouped: (B, groups, 1) -> (B, groups, channels)
                groups = view.shape[1]
                work[name + "_groups"] = (view[:, :, None],
                                          work[name].view(batch, groups, H // groups))
        return work

    @torch.no_grad()
    def step_(self, x_t: Tensor, state: LayerState, out: Tensor,
              work: Optional[dict] = None) -> Tensor:
        """:meth:`step` in place, for decode loops: ``state`` (its scan tensors and
        ``last_input``) is updated where it lies and the output written into ``out``
        ``(B, hidden_size)``; returns ``out``. With ``work`` from :meth:`step_workspace` and
        CPU tensors nothing is allocated. Inference only: it runs without autograd (a state
        whose tensors require grad is stepped as a detached one would be).

        Every argument is checked before anything is written (a refused call leaves
        ``state`` and ``out`` as they were): ``x_t`` ``(B, input_size)`` in the layer's dtype,
        ``state``'s tensors ``(B, ...)`` of the layer's state dtype, ``out`` ``(B,
        hidden_size)`` in ``x_t``'s dtype, ``work`` for ``B`` rows of that dtype; ``out`` and
        the state's tensors each own their memory (no ``expand``-ed tensor, no two sharing
        memory). The memory checks run once per layout of these tensors.

        Example:
            >>> import torch, fastrwa
            >>> layer = fastrwa.nn.RDA(8, 16)
            >>> _, state = layer(torch.randn(2, 5, 8))
            >>> out, work = torch.empty(2, 16), layer.step_workspace(2)
            >>> _ = layer.step_(torch.randn(2, 8), state, out, work)   # state updated in place
        """
        self._check_step_(x_t, state, out, work)
        if work is None:
            work = self.step_workspace(x_t.shape[0], x_t.dtype)
        return self.unchecked_step_(x_t, state, out, work)

    def _check_step_(self, x_t: object, state: object, out: object, work: Optional[dict],
                     work_name: str = "work") -> None:
        """The checks of :meth:`step_` (see there): per call, comparisons of attributes
        (written inline: a decode loop pays them every token), and the memory checks once
        per layout of the written tensors (:data:`_NO_OVERLAP`). On a failure the precise
        message comes from the slow helpers."""
        if self.bidirectional:
            raise RuntimeError("step_() is not defined for a bidirectional layer: its reverse "
                               "direction needs the whole sequence; call the layer on it")
        proj = self.proj
        weight = proj.weight
        if not (isinstance(x_t, Tensor) and x_t.dim() == 2 and x_t.shape[1] == self.input_size
                and x_t.dtype == weight.dtype and x_t.device == weight.device):
            self._check_input(x_t, 2, "x_t", autocast=False)
        if not isinstance(state, LayerState) or not isinstance(state.scan, ScanState):
            got = type(state).__name__ if not isinstance(state, LayerState) \
                else f"a LayerState whose scan is a {type(state.scan).__name__}"
            raise TypeError(f"state must be a fastrwa.nn.LayerState (with a fastrwa.ScanState) "
                            f"to update in place, got {got}")
        B, dtype, dev = x_t.shape[0], x_t.dtype, x_t.device
        rows, sdt = (B, self.hidden_size), state_dtype(dtype)
        for t in state.scan:
            if not (isinstance(t, Tensor) and t.shape == rows and t.dtype == sdt
                    and t.device == dev):
                for name, each in zip(_SCAN_NAMES, state.scan):
                    check_buffer(each, name, rows, sdt, dev, "(B, hidden_size) = ")
        if not (isinstance(out, Tensor) and out.shape == rows and out.dtype == dtype
                and out.device == dev):
            check_buffer(out, "out", rows, dtype, dev, "(B, hidden_size) = ")
        last = state.last_input
        if self.token_shift and not (isinstance(last, Tensor) and last.shape == x_t.shape
                                     and last.dtype == dtype and last.device == dev):
            check_buffer(last, "state.last_input", (B, self.input_size), dtype, dev,
                         "(B, input_size) = ")
        if work is not None:
            # (the other buffers of a workspace are views of these or sized alike)
            needed = dict(proj=proj.out_features)
            if self.token_shift:
                needed["inp"] = proj.in_features
            if not isinstance(work, dict) or not self._WORK_KEYS <= work.keys():
                got = sorted(work) if isinstance(work, dict) else type(work).__name__
                raise TypeError(f"{work_name} must be the dict of step_workspace(B) for this "
                                f"layer (with {sorted(self._WORK_KEYS)}), got {got}")
            for key, width in needed.items():
                t = work[key]
                if not (isinstance(t, Tensor) and t.shape == (B, width) and t.dtype == dtype
                        and t.device == dev):
                    check_buffer(t, f"{work_name}[{key!r}]", (B, width), dtype, dev)
        if torch.compiler.is_compiling():        # (a compiled graph has no memory to compare)
            return
        written = (out, *state.scan, *((state.last_input,) if self.token_shift else ()))
        key = (B, dtype, *[(t.data_ptr(), t.shape, t.stride()) for t in written])
        if key not in _NO_OVERLAP:
            check_no_overlap(list(zip(("out", *_SCAN_NAMES, "state.last_input"), written)), [])
            if len(_NO_OVERLAP) >= _NO_OVERLAP_MAX:
                _NO_OVERLAP.clear()
            _NO_OVERLAP.add(key)

    def unchecked_step_(self, x_t: Tensor, state: LayerState, out: Tensor,
                        work: dict) -> Tensor:
        """:meth:`step_` without its checks, for a caller that has made them (a block's or a
        model's decode step checks its arguments once and steps each layer through this).
        Arguments :meth:`step_` would refuse give undefined results here."""
        inp = x_t
        if self.token_shift and torch.compiler.is_compiling():
            # (inductor fuses the concatenation; the copies below into one buffer, then
            # overwriting last_input, make its CPU code generator fail in PyTorch 2.13)
            inp = torch.cat([x_t, state.last_input], 1)
        elif self.token_shift:
            work["inp_x"].copy_(x_t)
            work["inp_last"].copy_(state.last_input)
            inp = work["inp"]
        proj = self.proj
        torch.addmm(proj.bias, inp, proj.weight.t(), out=work["proj"])
        torch.tanh(work["tanh_g"], out=work["z"])
        work["z"].mul_(work["u"])                                 # z = u * tanh(g)
        for name in ("a", "g") if self._discounted else ("a",):
            if name + "_groups" in work:                          # (grouped: to each channel)
                logits, channels = work[name + "_groups"]
                channels.copy_(logits)
            elif work[name] is not work[name + "_logits"]:        # (B > 1: copy the columns)
                work[name].copy_(work[name + "_logits"])
        y = work["y"]
        if self._writes_output and out.is_contiguous():
            y = out
        self._step_scan_(work, state.scan, y)
        if y is not out:
            self._output_(y, out)
        if self.token_shift:    # (from the copy in inp: out may be x_t itself, written above)
            state.last_input.copy_(inp[:, :x_t.shape[1]])
        return out

    def _step_scan_(self, work: dict, scan: ScanState, y: Tensor) -> None:
        """The scan's in-place step (``fastrwa.rwa_step_`` / ``rda_step_``) on the gates in
        ``work``, its average into ``y``."""
        raise NotImplementedError

    @property
    def _writes_output(self) -> bool:
        """Whether the output function is the identity, so that the step writes the layer's
        output directly."""
        return False

    def _output_(self, y: Tensor, out: Tensor) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return (f"{self.input_size}, {self.hidden_size}, batch_first={self.batch_first}, "
                f"bidirectional={self.bidirectional}, token_shift={self.token_shift}")


class RWA(_ScanLayer):
    """Recurrent Weighted Average as a scan layer.

    ``u, g, a = W [x_t] + b`` (one fused projection of the input, optionally of
    ``[x_t, x_{t-1}]``), ``z = u * tanh(g)``, ``h_t = tanh(sum_i exp(a_i) z_i / sum_i exp(a_i))``
    over the learned prior and all tokens so far.

    Args:
        input_size: features of ``x``.
        hidden_size: channels ``H`` of the state and output.
        batch_first: ``x`` is ``(B, T, input_size)`` (default) or ``(T, B, input_size)``.
        bidirectional: also scan from the end; the output has ``2 * H`` features.
        token_shift: gates see ``[x_t, x_{t-1}]`` (twice the projection's input features and
            FLOPs; local context that the input-only gates otherwise lack).
        learn_initial_state: the prior pseudo-step ``(s_0, a_0)`` is learned; if ``False``,
            the state starts empty.

    Example:
        >>> import torch, fastrwa
        >>> layer = fastrwa.nn.RWA(8, 16)
        >>> out, state = layer(torch.randn(2, 10, 8))
        >>> out.shape
        torch.Size([2, 10, 16])
        >>> out_t, state = layer.step(torch.randn(2, 8), state)
    """

    _discounted = False

    def __init__(self, input_size: int, hidden_size: int, batch_first: bool = True,
                 bidirectional: bool = False, token_shift: bool = False,
                 learn_initial_state: bool = True, device=None, dtype=None):
        super().__init__(input_size, hidden_size, batch_first=batch_first,
                         bidirectional=bidirectional, token_shift=token_shift,
                         learn_initial_state=learn_initial_state, device=device, dtype=dtype)

    def _scan(self, gates, state, reverse, step, context_group=None, cu_seqlens=None):
        u, g, a = gates
        z = self.value(u, g)
        if step:
            y, final = _scan.rwa_step(z[:, 0], a[:, 0], state)
            return y[:, None], final
        return _scan.rwa_scan(z, a, state, output_final_state=True, reverse=reverse,
                              cu_seqlens=cu_seqlens, context_group=context_group)

    def output(self, y):
        return torch.tanh(y)

    def _step_scan_(self, work, scan, y):
        _scan.rwa_step_(work["z"], work["a"], scan, y)

    def _output_(self, y, out):
        torch.tanh(y, out=out)


class RDA(NamedActivations, _ScanLayer):
    """Recurrent Discounted Attention as a scan layer.

    ``u, g, a, c = W [x_t] + b``, ``z = u * tanh(g)``, ``gamma = sigmoid(c)``,
    ``n_t = gamma_t n_{t-1} + f_a(a_t) z_t``, ``d_t`` alike, output ``f_o(f_h(n_t / d_t))``.

    Args:
        input_size, hidden_size, batch_first, bidirectional, token_shift, learn_initial_state:
            as for :class:`RWA`.
        attention: ``f_a``: "exp", "sigmoid", "softplus" or "relu".
        f_h, f_o: "tanh", "identity", "sigmoid" or "relu".
        preset: a published variant by name, "exp-tanh" (f_a = exp, f_o = tanh) or
            "sigmoid-id" (f_a = sigmoid, f_h = f_o = identity); overrides the three above.
        discount_groups: ``None`` (default): one discount ``gamma`` per channel, the paper's.
            An int ``G`` dividing ``hidden_size``: one per group of ``hidden_size / G``
            consecutive channels (as the heads of RetNet and GLA share a decay): the
            projection computes ``G`` discount logits instead of ``hidden_size``, each
            group's ``gamma`` discounts all its channels.

    The discount gate's bias starts at 1 (gamma ~ 0.73), as the RDA paper initialises it.

    Example:
        >>> import torch, fastrwa
        >>> layer = fastrwa.nn.RDA(8, 16, preset="sigmoid-id")
        >>> out, state = layer(torch.randn(2, 10, 8))
        >>> out.shape
        torch.Size([2, 10, 16])
    """

    _discounted = True
    _WORK_KEYS = _ScanLayer._WORK_KEYS | {"g_logits", "g"}

    def __init__(self, input_size: int, hidden_size: int, attention: str = "exp",
                 f_h: str = "tanh", f_o: str = "identity", preset: Optional[str] = None,
                 batch_first: bool = True, bidirectional: bool = False,
                 token_shift: bool = False, learn_initial_state: bool = True,
                 discount_groups: Optional[int] = None, device=None, dtype=None):
        attention, f_h, f_o, _, _ = rda_functions(attention, f_h, f_o, preset)
        super().__init__(input_size, hidden_size, batch_first=batch_first,
                         bidirectional=bidirectional, token_shift=token_shift,
                         learn_initial_state=learn_initial_state,
                         discount_groups=discount_groups, device=device, dtype=dtype)
        # (names, not functions: a module that holds only data pickles and saves whole)
        self.attention, self.f_h_name, self.f_o_name = attention, f_h, f_o

    def set_discount_timescales(self, shortest: float, longest: float) -> None:
        """Initialise the discount gate's bias so that the channels' memory lengths
        ``1 / (1 - gamma)`` (in tokens, at a zero pre-activation) are spread log-uniformly
        from ``shortest`` to ``longest`` (finite numbers > 1, ``longest >= shortest``), as
        gated linear RNNs initialise their forget gates: ``bias_j = log(tau_j - 1)``. The
        paper's bias of 1 is ``tau = 3.7``. With ``discount_groups``, the groups' memory
        lengths are spread so. A refused call changes nothing.

        Example:
            >>> import fastrwa
            >>> layer = fastrwa.nn.RDA(8, 16)
            >>> layer.set_discount_timescales(2.0, 1000.0)
        """
        for name, value in (("shortest", shortest), ("longest", longest)):
            number = math.nan
            if not isinstance(value, bool) and isinstance(value, (int, float)):
                try:
                    number = float(value)
                except OverflowError:                  # (an int past float's range)
                    number = math.inf
            if not 1 < number < math.inf:
                raise ValueError(f"{name} must be a finite number > 1 (a memory length in "
                                 f"tokens), got {value!r}")
        if longest < shortest:
            raise ValueError(f"longest ({longest}) must be >= shortest ({shortest})")
        tau = torch.logspace(math.log10(shortest), math.log10(longest), self.gate_widths[3],
                             dtype=torch.float64)
        with torch.no_grad():
            for d in range(self.num_directions):
                self._gate_rows(self.proj.bias, d)[3].copy_(torch.log(tau - 1))

    def per_channel_rows(self) -> Tensor:
        """Indices of the fused projection's rows (``proj.weight[rows]``, ``proj.bias[rows]``)
        that make the projection of a per-channel layer computing the same gates: each
        group's discount row repeated for its channels (``discount_groups``; without it,
        every row once, in order). ``(directions * 4 * hidden_size,)`` int64."""
        H, per_direction = self.hidden_size, sum(self.gate_widths)
        r = H // self.gate_widths[3]
        own = torch.cat([torch.arange(3 * H), 3 * H + torch.arange(H) // r])
        return torch.cat([d * per_direction + own for d in range(self.num_directions)])

    def _scan(self, gates, state, reverse, step, context_group=None, cu_seqlens=None):
        u, g, a, c = gates
        z = self.value(u, g)
        if step:
            y, final = _scan.rda_step(z[:, 0], a[:, 0], c[:, 0], state, self.attention)
            return y[:, None], final
        return _scan.rda_scan(z, a, c, self.attention, state, output_final_state=True,
                              reverse=reverse, cu_seqlens=cu_seqlens,
                              context_group=context_group)

    def output(self, y):
        return self._f_o(self._f_h(y))

    def _step_scan_(self, work, scan, y):
        _scan.rda_step_(work["z"], work["a"], work["g"], scan, y, self.attention)

    @property
    def _writes_output(self):
        return self.f_h_name == self.f_o_name == "identity"

    def _output_(self, y, out):
        ACTIVATIONS_OUT[self.f_h_name](y, out)
        ACTIVATIONS_OUT[self.f_o_name](out, out)

    def extra_repr(self) -> str:
        groups = "" if self.discount_groups is None else \
            f", discount_groups={self.discount_groups}"
        return (super().extra_repr() + f", attention={self.attention!r}, "
                f"f_h={self.f_h_name!r}, f_o={self.f_o_name!r}" + groups)
