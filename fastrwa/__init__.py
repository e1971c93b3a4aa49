"""fastrwa: Recurrent Weighted Average and Recurrent Discounted Attention as parallel scans.

Public API::

    y, state = fastrwa.rwa_scan(z, a, initial_state=None, output_final_state=False)
    y, state = fastrwa.rda_scan(z, a, g, attention="exp", initial_state=None, output_final_state=False)
    y, state = fastrwa.weighted_scan(z, log_w, log_decay=None, initial_state=None, output_final_state=False)
    y_t, state = fastrwa.rwa_step(z_t, a_t, state=None)
    y_t, state = fastrwa.rda_step(z_t, a_t, g_t, state=None, attention="exp")
    fastrwa.rwa_step_(z_t, a_t, state, out); fastrwa.rda_step_(z_t, a_t, g_t, state, out)
    with fastrwa.use_backend("torch"): ...

The sequential reference that defines every answer is :mod:`fastrwa.reference`.
"""

import importlib
import sys

# The public names and the module each lives in, imported on first use (PEP 562): `import
# fastrwa` itself imports no PyTorch, so a program such as `python -m fastrwa.train` can set
# up its signal handlers before the heavy imports (a Ctrl-C there ends in one line).
_LAZY = {
    "get_backend": ".ops.dispatch", "use_backend": ".ops.dispatch",
    **{name: ".scan" for name in ("rda_scan", "rda_step", "rda_step_", "rwa_scan", "rwa_step",
                                  "rwa_step_", "weighted_scan")},
    "ScanState": ".state",
}
# The subpackages and modules reached as attributes (``fastrwa.nn.RDA``), imported then too.
_SUBMODULES = {"checks", "hf", "kernels", "models", "nn", "ops", "reference", "scan", "state",
               "testing", "train"}


def __getattr__(name: str):
    """A public function or class, or a subpackage (``fastrwa.nn``, ``fastrwa.models``, ...),
    imported when first asked for."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


# The Hugging Face classes register with the Auto classes on import of fastrwa.hf. A program
# that has imported transformers gets them from `import fastrwa` too; the others do not pay
# for it (importing transformers' model classes takes ~2 s): docs/hf.md.
if "transformers" in sys.modules:
    try:
        from . import hf  # noqa: F401
    except Exception as exc:     # (another transformers: fastrwa works, the classes not)
        __import__("warnings").warn(f"fastrwa: the Hugging Face classes are not registered "
                                    f"({type(exc).__name__}: {exc}); import fastrwa.hf says "
                                    f"why", stacklevel=2)

__all__ = [
    "ScanState",
    "get_backend",
    "nn",
    "rda_scan",
    "rda_step",
    "rda_step_",
    "rwa_scan",
    "rwa_step",
    "rwa_step_",
    "use_backend",
    "weighted_scan",
]
__version__ = "0.2.0"
