"""``python -m fastrwa.hf.export RUN_OR_MODEL_DIR OUT_DIR``: a training run's model as a
Hugging Face directory (``config.json``, ``model.safetensors``, ``generation_config.json``, the
tokenizer's files, the ``auto_map`` modules and the run's model card ``README.md``: the
format of :mod:`fastrwa.models.directory`) that ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained`` load after ``import fastrwa.hf`` or with
``trust_remote_code=True``.

``RUN_OR_MODEL_DIR`` is a run directory (its final ``model/``, or ``best/`` with ``--best``)
or any directory ``fastrwa.models.save_pretrained`` wrote. The directory is written beside
``OUT_DIR`` and renamed into place when complete: an interrupted export leaves no half
directory (what a killed export left beside it is tidied by the next one). An existing
non-empty ``OUT_DIR`` is replaced with ``--overwrite`` only, and only if it holds a fastrwa
export; a symbolic link is never followed or replaced. A full disk is one ``error:`` line
naming ``OUT_DIR``, with nothing half-written left behind. (The ONNX export,
``python -m fastrwa.export onnx``, writes its directory the same way.)
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import Optional

from safetensors import SafetensorError

from ..models import load_bytelm, run_model_dir
from ..models.directory import REMOTE_CODE, is_model_card
from ..models.files import (ExportDirectory, check_output_directory, sigterm_raises,
                            staged_directory, stop_line)
from ..options import add_model_directory, add_overwrite
from . import FastRWAByteTokenizer, FastRWAConfig, FastRWAForCausalLM
from .progress import no_progress_bars


# What --overwrite may replace: an earlier export (save_pretrained's files for the model and
# the tokenizer, the modules auto_map names, the model card), its config.json of the model
# type, and a README.md only if it is the card an export wrote (a README of one's own is
# never deleted).
WHAT = "fastrwa Hugging Face export"
USE = "the Hugging Face export"      # (what refuses a baseline: load_bytelm)


def _card_only(directory: Path) -> Optional[str]:
    card = directory / "README.md"
    if card.exists() and not is_model_card(card.read_text(errors="replace")):
        return "its README.md is not a model card"
    return None


OUTPUT = ExportDirectory(
    WHAT, frozenset({"config.json", "model.safetensors", "generation_config.json",
                     "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json",
                     "README.md", *REMOTE_CODE}),
    "config.json", ("model_type", FastRWAConfig.model_type), own=_card_only)


def export(run_dir: str | Path, out_dir: str | Path, best: bool = False,
           overwrite: bool = False) -> Path:
    """Write the Hugging Face directory of ``run_dir``'s model to ``out_dir`` (module doc);
    returns ``out_dir``. Raises ``FileNotFoundError`` (no model there), ``ValueError`` (a
    baseline, an ``out_dir`` that is a symbolic link or would be overwritten without
    ``overwrite``, or is not an earlier export), :class:`~fastrwa.models.files.WriteError`
    (a full disk: one line naming ``out_dir``; nothing is left behind). The directory is
    staged beside ``out_dir`` and renamed into place
    (:func:`fastrwa.models.files.staged_directory`), under the policy of every exporter
    (:data:`OUTPUT`)."""
    out_dir = Path(out_dir)
    check_output_directory(out_dir, overwrite, OUTPUT)   # (before the work)
    source = run_model_dir(run_dir, best)
    model = load_bytelm(source, use=USE)
    with staged_directory(out_dir, overwrite, OUTPUT, failures=(SafetensorError,)) as staging:
        if (source / "README.md").is_file():      # (the run's model card: how it was trained)
            shutil.copyfile(source / "README.md", staging / "README.md")
        with no_progress_bars():
            FastRWAForCausalLM.from_bytelm(model).save_pretrained(staging)
            FastRWAByteTokenizer().save_pretrained(staging)
    return out_dir


def parser() -> argparse.ArgumentParser:
    """The command line's parser (the options the CLIs share: :mod:`fastrwa.options`)."""
    p = argparse.ArgumentParser(prog="python -m fastrwa.hf.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_directory(p)
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    add_overwrite(p, "OUT_DIR", WHAT)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.out_dir = args.out_dir.absolute()
    existed = args.out_dir.exists()
    try:
        with sigterm_raises():
            out = export(args.run_dir, args.out_dir, args.best, args.overwrite)
    except (FileNotFoundError, ValueError, OSError, SafetensorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:   # (the staged directory is removed: nothing written)
        line, status = stop_line(stop, args.out_dir, existed)
        print(line, file=sys.stderr)
        return status
    print(f"exported {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}) after "
          f"import fastrwa.hf, or with trust_remote_code=True", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
