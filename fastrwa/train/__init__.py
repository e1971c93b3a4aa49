"""Training: ``python -m fastrwa.train`` (see :mod:`fastrwa.train.cli`)."""

__all__ = ["RunConfig", "train"]
_MODULES = {"budget", "checkpoints", "cli", "config", "data", "device", "loop", "metrics",
            "models", "optim", "packing", "parallel", "plot", "problems", "rundir", "stop",
            "tasks", "threads"}


def __getattr__(name: str):
    """``RunConfig`` and ``train``, imported when first asked for: ``python -m
    fastrwa.train`` installs its signal handlers before the imports they need."""
    if name == "RunConfig":
        from .config import RunConfig
        return RunConfig
    if name == "train":
        from .loop import train
        return train
    if name in _MODULES:             # (fastrwa.train.config, ...: imported on first use too)
        import importlib
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
