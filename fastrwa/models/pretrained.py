"""Build any of the language models from its :class:`LMConfig`, or from a directory saved
by :func:`save_pretrained` or the Hugging Face export (:mod:`fastrwa.models.storage` writes
and reads the files): no training code needed. :func:`load_model` and :func:`load_bytelm`
are what every command line loads with (a run's directory or a model directory; the
baselines refused where only a ``ByteLM`` will do)."""

from __future__ import annotations

import os

from torch import nn

from .baseline import RecurrentLM
from .config import LMConfig
from .lm import ByteLM
from .mingru import MinGRULM
# (what callers import from here: the directory's files are defined in storage)
from .storage import (CONFIG, SAFETENSORS, WEIGHTS, WriteError, check_archive,  # noqa: F401
                      load_weights, read_config, read_pretrained, run_model_dir,
                      save_pretrained, save_with_crcs, weights_file, write_atomically)
from .transformer import TransformerLM


def build(config: LMConfig | dict) -> nn.Module:
    """The model ``config`` describes: :class:`ByteLM` for "rda"/"rwa" layers,
    :class:`RecurrentLM` for the "lstm"/"gru" baselines, :class:`TransformerLM` and
    :class:`MinGRULM` for "transformer" and "mingru".

    Example:
        >>> from fastrwa.models import LMConfig, build
        >>> type(build(LMConfig(d_model=16, n_layers=1))).__name__
        'ByteLM'
    """
    config = config if isinstance(config, LMConfig) else LMConfig.from_dict(config)
    model = {"lstm": RecurrentLM, "gru": RecurrentLM, "transformer": TransformerLM,
             "mingru": MinGRULM}.get(config.layer, ByteLM)
    return model(config)


def load_pretrained(directory: str | os.PathLike, map_location=None) -> nn.Module:
    """The model saved in ``directory`` by :func:`save_pretrained` or by the Hugging Face
    export (``python -m fastrwa.hf.export``), in eval mode; a training run's directory
    gives its final ``model/`` (its best by validation is under ``best/``).

    Safe: ``model.pt`` is read with ``torch.load(weights_only=True)``, which unpickles
    tensors and plain containers only, after every record is checked against its CRC-32
    (:func:`check_archive`): an empty, cut-short or damaged file, or a pickle, is refused
    with a ``ValueError`` naming it, never loaded as different numbers. An export's
    ``model.safetensors`` is checked against the SHA-256 stored in it (a cut-short file or
    a damaged header is the same error). A ``config.json`` that no longer matches the
    configuration recorded with the weights (edited by hand: other logits) is a
    ``ValueError`` naming the field and both values
    (:func:`fastrwa.models.directory.check_architecture`); weights written before fastrwa
    recorded it load with their ``config.json`` as it is.

    Example:
        >>> import tempfile
        >>> from fastrwa.models import LMConfig, build, load_pretrained, save_pretrained
        >>> d = tempfile.mkdtemp()
        >>> save_pretrained(build(LMConfig(d_model=16, n_layers=1)), d)
        >>> type(load_pretrained(d)).__name__
        'ByteLM'
    """
    saved = read_pretrained(directory, map_location)
    return load_weights(build(saved.config), saved)


def load_model(directory: str | os.PathLike, best: bool = False,
               map_location=None) -> nn.Module:
    """The model of a training run's directory (its final ``model/``, or ``best/`` with
    ``best``) or of a model directory (:func:`save_pretrained`'s, a Hugging Face export),
    in eval mode: any of the language models, as :func:`load_pretrained` reads it (the
    damaged-file errors are its ``ValueError``); a ``FileNotFoundError`` naming
    ``directory`` where it holds no model (:func:`run_model_dir`).

    Example:
        >>> import tempfile
        >>> from fastrwa.models import LMConfig, build, save_pretrained
        >>> from fastrwa.models.pretrained import load_model
        >>> run = tempfile.mkdtemp()
        >>> save_pretrained(build(LMConfig(layer="gru", d_model=8, n_layers=1)), run + "/model")
        >>> type(load_model(run)).__name__
        'RecurrentLM'
    """
    return load_pretrained(run_model_dir(directory, best), map_location)


def load_bytelm(directory: str | os.PathLike, best: bool = False, use: str = "this",
                map_location=None) -> ByteLM:
    """:func:`load_model`, for what takes a :class:`ByteLM` only (the server, the ONNX and
    Hugging Face exports): a baseline (:class:`RecurrentLM`, :class:`TransformerLM`,
    :class:`MinGRULM`) is refused with a ``ValueError`` naming the directory, ``use`` (what
    refuses it, e.g. "the ONNX export") and the baseline.

    Example:
        >>> import tempfile
        >>> from fastrwa.models import LMConfig, build, save_pretrained
        >>> from fastrwa.models.pretrained import load_bytelm
        >>> d = tempfile.mkdtemp()
        >>> save_pretrained(build(LMConfig(layer="lstm", d_model=8, n_layers=1)), d)
        >>> load_bytelm(d, use="the server")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: ...: the server takes a fastrwa.models.ByteLM (the rda/rwa scan models); this one is the 'lstm' baseline (RecurrentLM)
    """
    source = run_model_dir(directory, best)
    model = load_pretrained(source, map_location)
    if not isinstance(model, ByteLM):
        raise ValueError(f"{source}: {use} takes a fastrwa.models.ByteLM (the rda/rwa scan "
                         f"models); this one is the {model.config.layer!r} baseline "
                         f"({type(model).__name__})")
    return model
