"""Training: ``python -m fastrwa.train`` (see :mod:`fastrwa.train.cli`)."""

from .config import RunConfig
from .loop import train

__all__ = ["RunConfig", "train"]
