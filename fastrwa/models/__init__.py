"""Models built from fastrwa layers: the byte-level language model."""

from .config import LMConfig
from .lm import Block, ByteLM, InferenceCache, LMState

__all__ = ["LMConfig", "ByteLM", "Block", "InferenceCache", "LMState"]
