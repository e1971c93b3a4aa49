"""Language models built from fastrwa layers (:class:`ByteLM`) and their baselines
(:class:`RecurrentLM`: LSTM, GRU; :class:`TransformerLM`; :class:`MinGRULM`), with
:func:`build`, :func:`save_pretrained`, :func:`load_pretrained` (and :func:`load_model`,
:func:`load_bytelm`: a run's directory or a model directory); :class:`PackedLM`, a
``ByteLM`` packed for the fused CPU decode step."""

from .baseline import RecurrentLM
from .config import LMConfig
from .block import Block
from .cache import InferenceCache, LMState
from .lm import ByteLM
from .mingru import MinGRULM
from .packed import WEIGHT_FORMATS, PackedLM
from .pretrained import build, load_bytelm, load_model, load_pretrained
from .scoring import score
from .storage import run_model_dir, save_pretrained
from .transformer import TransformerLM

__all__ = ["LMConfig", "ByteLM", "Block", "InferenceCache", "LMState", "RecurrentLM",
           "TransformerLM", "MinGRULM", "build",
           "save_pretrained", "load_pretrained", "load_model", "load_bytelm", "run_model_dir",
           "PackedLM", "WEIGHT_FORMATS", "score"]
