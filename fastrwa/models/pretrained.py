"""Build a language model from its :class:`LMConfig`, and save / load one as a directory of
``config.json`` and ``model.pt`` (what a training run exports): no training code needed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from .config import FIELDS_BEFORE_THEY_EXISTED, LMConfig

WEIGHTS, CONFIG = "model.pt", "config.json"


def build(config: LMConfig | dict) -> nn.Module:
    """The model ``config`` describes: :class:`ByteLM` for "rda"/"rwa" layers,
    :class:`RecurrentLM` for the "lstm"/"gru" baselines.

    Example:
        >>> from fastrwa.models import LMConfig, build
        >>> type(build(LMConfig(d_model=16, n_layers=1))).__name__
        'ByteLM'
    """
    from .baseline import RecurrentLM
    from .lm import ByteLM

    config = config if isinstance(config, LMConfig) else LMConfig.from_dict(config)
    return RecurrentLM(config) if config.layer in ("lstm", "gru") else ByteLM(config)


def save_pretrained(model: nn.Module, directory: str | os.PathLike) -> None:
    """Write ``model.config`` to ``directory/config.json`` and the weights (tensors only) to
    ``directory/model.pt``, each through a temporary file and ``os.replace``."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    tmp = path / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(model.config.to_dict(), indent=2))
    os.replace(tmp, path / CONFIG)
    tmp = path / (WEIGHTS + ".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path / WEIGHTS)


def load_pretrained(directory: str | os.PathLike, map_location=None) -> nn.Module:
    """The model saved in ``directory`` by :func:`save_pretrained` (a training run's directory
    holds one under ``model/`` and the best by validation under ``best/``), in eval mode.

    Safe: the weights are read with ``torch.load(weights_only=True)``, which unpickles
    tensors and plain containers only.

    Example:
        >>> import tempfile
        >>> from fastrwa.models import LMConfig, build, load_pretrained, save_pretrained
        >>> d = tempfile.mkdtemp()
        >>> save_pretrained(build(LMConfig(d_model=16, n_layers=1)), d)
        >>> type(load_pretrained(d)).__name__
        'ByteLM'
    """
    path = Path(directory)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise FileNotFoundError(f"{path} must hold {CONFIG} and {WEIGHTS} (written by "
                                f"save_pretrained, or a run's model/ or best/ directory)")
    try:
        config = LMConfig.from_dict({**FIELDS_BEFORE_THEY_EXISTED,
                                     **json.loads((path / CONFIG).read_text())})
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path / CONFIG} is not a language-model configuration ({exc})") from exc
    model = build(config)
    weights = torch.load(path / WEIGHTS, map_location=map_location, weights_only=True)
    model.load_state_dict(weights)
    return model.eval()
