"""The vocabulary every layer shares: attention and discount names and their integer codes,
the state-dtype rule, and numeric constants.

Dependency-free (no ``torch``, ``triton`` or ``numba`` import at module level), so that host
code and device code of every backend import the same names. A kernel branches on the codes;
host code turns a name into its code with :data:`ATTENTION_CODE` / :data:`DISCOUNT_CODE`.
"""

from __future__ import annotations

# f_a, the attention function: l = log f_a(a). docs/math.md §1.
ATTENTIONS = ("exp", "sigmoid", "softplus", "relu")
EXP, SIGMOID, SOFTPLUS, RELU = range(len(ATTENTIONS))
ATTENTION_CODE = {name: code for code, name in enumerate(ATTENTIONS)}

# The discount: lam = log gamma. None: no discount (RWA); "log": the input is lam itself
# (weighted_scan's log_decay); "sigmoid": the input is a logit, gamma = sigmoid(g) (RDA).
DISCOUNTS = (None, "log", "sigmoid")
NO_DISCOUNT, LOG_DISCOUNT, SIGMOID_DISCOUNT = range(len(DISCOUNTS))
DISCOUNT_CODE = {name: code for code, name in enumerate(DISCOUNTS)}

# Below this logit log softplus(a) is computed from its series in u = exp(a) < 1.3e-4:
# log softplus(a) = a - u/2 + 5u^2/24 + O(u^3), and d/da = 1 / ((1 + u)(1 - u/2 + u^2/3)).
SOFTPLUS_SERIES_BELOW = -9.0

def state_dtype(dtype):
    """The dtype of a ``ScanState`` and of every backend's arithmetic for inputs of the
    ``torch.dtype`` ``dtype``: ``torch.float64`` for float64 inputs, else ``torch.float32``.
    (torch is imported on call, so that kernels can import this module without it.)"""
    import torch

    return torch.float64 if dtype == torch.float64 else torch.float32
