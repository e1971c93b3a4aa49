"""The codes every kernel and launcher shares: attention and discount names and their integer
codes, and numeric constants.

Dependency-free (it imports nothing), so that the host code in ``fastrwa/`` and the device
code of every target (``kernels/triton/``, ``kernels/cpu/``) read the same names. A kernel
branches on the codes; host code turns a name into its code with :data:`ATTENTION_CODE` /
:data:`DISCOUNT_CODE`.
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

# f_h and f_o, the output functions of an RDA layer (fastrwa.nn.functional.ACTIVATIONS holds
# the torch functions under the same names); the fused decode step branches on these codes.
OUTPUT_FUNCTIONS = ("tanh", "identity", "sigmoid", "relu")
OUT_TANH, OUT_IDENTITY, OUT_SIGMOID, OUT_RELU = range(len(OUTPUT_FUNCTIONS))
OUTPUT_FUNCTION_CODE = {name: code for code, name in enumerate(OUTPUT_FUNCTIONS)}

# What a program of the Triton scan kernels (kernels/triton/scan_fwd.py, scan_bwd.py) does with
# its segment: the whole sequence in one pass, its summary (phase 1 of three), or its output
# from the incoming state the carry kernel found (phase 3).
ONE_PASS, SUMMARY, OUTPUT = range(3)
