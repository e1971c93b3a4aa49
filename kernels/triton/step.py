"""One streaming step for ``(B, D)``: a single fused launch reads the state and the step's
inputs, writes ``y_t`` and the new state (which may alias the old one: each lane reads its
state before it writes it)."""

import triton
import triton.language as tl

from .common import (NEG_INF, NO_DISCOUNT, average, combine, initial_state, log_decay,
                     log_weight, store_state)
from .sequence import channels


@triton.jit
def step_kernel(
    z_ptr, a_ptr, g_ptr, y_ptr, h0_ptr, ht_ptr,
    NS, D: tl.constexpr,
    ATTN: tl.constexpr, DISCOUNT: tl.constexpr, HAS_INIT: tl.constexpr, BD: tl.constexpr,
):
    NEWTON: tl.constexpr = z_ptr.dtype.element_ty == tl.float32     # (common.reciprocal)
    i = tl.program_id(0)
    o_d, mask_d = channels(D, BD)
    o = i.to(tl.int64) * D + o_d                                               # [BD]
    b_hm, b_hn, b_hd = initial_state(h0_ptr, o, mask_d, NS * D, HAS_INIT, BD)
    b_z = tl.load(z_ptr + o, mask=mask_d, other=0.0).to(tl.float32)              # [BD]
    b_a = tl.load(a_ptr + o, mask=mask_d, other=0.0).to(tl.float32)              # [BD]
    b_l = tl.where(mask_d, log_weight(b_a, ATTN, NEWTON), NEG_INF)                # [BD]
    if DISCOUNT == NO_DISCOUNT:
        b_lam = tl.zeros([BD], tl.float32)                                     # [BD]
    else:
        b_g = tl.load(g_ptr + o, mask=mask_d, other=0.0).to(tl.float32)          # [BD]
        b_lam = tl.where(mask_d, log_decay(b_g, DISCOUNT, NEWTON), 0.0)           # [BD]
    b_m, b_n, b_d, _ = combine(b_hm, b_hn, b_hd, 0.0, b_l, b_z, 1.0, b_lam)    # [BD] x3
    tl.store(y_ptr + o, average(b_n, b_d, NEWTON).to(y_ptr.dtype.element_ty), mask=mask_d)
    store_state(ht_ptr, o, mask_d, NS * D, b_m, b_n, b_d)
