"""The command-line options the CLIs share (``python -m fastrwa.generate``, ``.serve``,
``.export onnx``, ``.hf.export``, ``.train``): each is added by one function here, with its
help written once (:data:`HELP`), and checked by one (:func:`check_options`), so that every
command says the same, true, thing about it.

A layer of its own, between the commands and :mod:`fastrwa.models` (pyproject.toml's
import-linter layers): the commands are independent of each other and share this.

Example:
    >>> import argparse
    >>> from fastrwa.options import add_device, add_sampling
    >>> p = argparse.ArgumentParser()
    >>> add_device(p)
    >>> add_sampling(p)
    >>> args = p.parse_args(["--top-k", "5"])
    >>> args.device, args.top_k, args.temperature, args.seed
    ('auto', 5, 1.0, 0)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import torch

from .models import WEIGHT_FORMATS
from .models.sampling import check_temperature, check_top_p

DEVICES = ("auto", "cpu", "cuda")
DECODE_WEIGHTS = ("auto", "eager", *WEIGHT_FORMATS)
MAX_GENERATOR_SEED = 2 ** 64 - 1   # torch.Generator.manual_seed's largest seed
MODEL_DIR = "RUN_OR_MODEL_DIR"

# Each shared flag's help (the one definition; "{target}" and "{what}" in --overwrite's
# are the directory and what it holds, filled in by the command).
HELP = {
    MODEL_DIR: "a training run's directory (its final model/, or best/ with --best) or a "
               "model directory (written by save_pretrained, a training run or the Hugging "
               "Face export)",
    "--best": "the run's best-validation model (its best/) instead of its final model/",
    "--device": "auto: CUDA when present, else the CPU (default auto)",
    "--weights": "how the decode steps run: the fused CPU decode step (fastrwa.models."
                 "PackedLM) with the weight matrices stored as float32, bfloat16 or int8; "
                 "eager: the PyTorch step (the reference); auto (the default): on CPU the "
                 "fused step with float32 matrices (the eager step for a model it cannot "
                 "pack), on CUDA the step replayed from a CUDA graph. The baselines have the "
                 "eager step only",
    "--threads": "CPU threads (default: PyTorch's). A decode step is many small ops: on an "
                 "idle machine 2 threads beat 1 by a few percent, but when other work shares "
                 "the cores, 1 thread avoids the thread pool's waits (bench/generation.py "
                 "measured 0.4 against 16 ms a step for a small model at batch 1)",
    "--temperature": "softmax temperature, > 0 (default 1.0, as ByteLM.generate and Hugging "
                     "Face generate())",
    "--top-k": "sample among the K most likely bytes only (default: all)",
    "--top-p": "sample from the smallest set of bytes whose probability reaches P, in (0, 1] "
               "(default: all)",
    "--seed": "the sampling generator's seed, 0 to 2**64 - 1 (default 0)",
    "--overwrite": "replace {target} if it holds an earlier {what}; anything else is refused",
}


def add_model_directory(p: argparse.ArgumentParser, dest: str = "run_dir") -> None:
    """The model to load: the positional ``RUN_OR_MODEL_DIR`` (as ``dest``, a ``Path``) and
    ``--best`` (what :func:`fastrwa.models.load_model` takes)."""
    p.add_argument(dest, type=Path, metavar=MODEL_DIR, help=HELP[MODEL_DIR])
    p.add_argument("--best", action="store_true", help=HELP["--best"])


def add_device(p: argparse.ArgumentParser, default: Optional[str] = "auto") -> None:
    """``--device`` (auto, cpu, cuda); ``default`` ``None`` where a command tells a flag
    given from one left out (the trainer's resume)."""
    p.add_argument("--device", choices=DEVICES, default=default, help=HELP["--device"])


def add_weights(p: argparse.ArgumentParser) -> None:
    """``--weights``: what runs a ``ByteLM``'s decode steps (``ByteLM.decoder``'s
    ``weights``)."""
    p.add_argument("--weights", choices=DECODE_WEIGHTS, default="auto", help=HELP["--weights"])


def add_threads(p: argparse.ArgumentParser) -> None:
    """``--threads N`` for a decoding command (``None``: PyTorch's count)."""
    p.add_argument("--threads", type=int, default=None, help=HELP["--threads"])


def add_sampling(p: argparse.ArgumentParser) -> None:
    """``--temperature``, ``--top-k``, ``--top-p`` and ``--seed``: how each byte is drawn,
    as ``ByteLM.generate`` takes them."""
    p.add_argument("--temperature", type=float, default=1.0, help=HELP["--temperature"])
    p.add_argument("--top-k", type=int, default=None, metavar="K", help=HELP["--top-k"])
    p.add_argument("--top-p", type=float, default=None, metavar="P", help=HELP["--top-p"])
    p.add_argument("--seed", type=int, default=0, help=HELP["--seed"])


def add_overwrite(p: argparse.ArgumentParser, target: str, what: str) -> None:
    """``--overwrite``: replace ``target`` (``OUT_DIR``, ``--run-dir``) if it holds an
    earlier ``what`` (the exporters: :class:`fastrwa.models.files.ExportDirectory`)."""
    p.add_argument("--overwrite", action="store_true",
                   help=HELP["--overwrite"].format(target=target, what=what))


def device_of(choice: str) -> torch.device:
    """``--device``'s device: auto is CUDA when present, else the CPU."""
    return torch.device("cuda" if choice == "cuda" or (
        choice == "auto" and torch.cuda.is_available()) else "cpu")


def check_options(args: argparse.Namespace) -> None:
    """Refuse (``ValueError``, naming the option) a value of a shared option in ``args``
    (those a command took: the others are skipped) that nothing can use: ``--threads``
    below 1, ``--device cuda`` without CUDA, a fused ``--weights`` format on CUDA, a
    temperature, top-k, top-p or seed out of range."""
    given = vars(args)
    if given.get("threads") is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if "temperature" in given:
        check_temperature(args.temperature, "--temperature")
    if given.get("top_k") is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be at least 1, got {args.top_k}")
    if given.get("top_p") is not None:
        check_top_p(args.top_p, "--top-p")
    if "seed" in given and not 0 <= args.seed <= MAX_GENERATOR_SEED:
        raise ValueError(f"--seed must be an integer from 0 to {MAX_GENERATOR_SEED} "
                         f"(2**64 - 1), got {args.seed}")
    if given.get("device") == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available here (PyTorch "
                         f"{torch.__version__}, built {'with' if torch.version.cuda else 'without'}"
                         f" CUDA); use --device cpu")
    if given.get("weights") in WEIGHT_FORMATS and given.get("device") == "cuda":
        raise ValueError(f"--weights {args.weights}: the fused decode step runs on CPU; use "
                         f"--device cpu, or --weights eager on CUDA")
