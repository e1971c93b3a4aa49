"""Training: ``python -m fastrwa.train`` (see :mod:`fastrwa.train.cli`)."""

__all__ = ["RunConfig", "train"]


def __getattr__(name: str):
    """``RunConfig`` and ``train``, imported when first asked for: ``python -m
    fastrwa.train`` installs its signal handlers before the imports they need."""
    if name == "RunConfig":
        from .config import RunConfig
        return RunConfig
    if name == "train":
        from .loop import train
        return train
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
