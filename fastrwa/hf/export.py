"""``python -m fastrwa.hf.export RUN_DIR OUT_DIR``: a training run's model as a Hugging Face
directory (``config.json``, ``model.safetensors``, ``generation_config.json``, the
tokenizer's files, the ``auto_map`` modules and the run's model card ``README.md``: the
format of :mod:`fastrwa.models.directory`) that ``AutoModelForCausalLM`` /
``AutoTokenizer.from_pretrained`` load after ``import fastrwa.hf`` or with
``trust_remote_code=True``.

``RUN_DIR`` is a run directory (its final ``model/`` export, or ``best/`` with ``--best``)
or any directory ``fastrwa.models.save_pretrained`` wrote. The directory is written beside
``OUT_DIR`` and renamed into place when complete: an interrupted export leaves no half
directory. An existing ``OUT_DIR`` is replaced with ``--overwrite`` only, and only if it
holds a fastrwa export; a symbolic link is never followed or replaced. A full disk is one
``error:`` line, with nothing half-written left behind.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors import SafetensorError

from ..models import ByteLM, load_pretrained, run_model_dir
from ..models.directory import REMOTE_CODE, is_model_card
from . import FastRWAByteTokenizer, FastRWAConfig, FastRWAForCausalLM
from .progress import no_progress_bars


# What an export holds (save_pretrained's files for the model and the tokenizer, the
# modules auto_map names, the model card).
EXPORT_FILES = {"config.json", "model.safetensors", "generation_config.json",
                "tokenizer_config.json", "added_tokens.json", "special_tokens_map.json",
                "README.md", *REMOTE_CODE}


def _is_export(directory: Path) -> bool:
    """A fastrwa export and nothing else (``--overwrite`` replaces only that)."""
    try:
        config = json.loads((directory / "config.json").read_text())
        names = {p.name for p in directory.iterdir()}
    except (OSError, ValueError):
        return False
    card = directory / "README.md"
    if card.exists() and not (card.is_file() and is_model_card(card.read_text(errors="replace"))):
        return False                    # (a README of one's own is never deleted)
    return (isinstance(config, dict) and config.get("model_type") == FastRWAConfig.model_type
            and names <= EXPORT_FILES)


def export(run_dir: str | Path, out_dir: str | Path, best: bool = False,
           overwrite: bool = False) -> Path:
    """Write the Hugging Face directory of ``run_dir``'s model to ``out_dir`` (module doc);
    returns ``out_dir``. Raises ``FileNotFoundError`` (no model there), ``ValueError`` (a
    baseline, an ``out_dir`` that is a symbolic link or would be overwritten without
    ``overwrite``), ``OSError`` or ``SafetensorError`` (a full disk: nothing is left
    behind)."""
    out_dir = Path(out_dir)
    if out_dir.is_symlink():          # (never followed, never replaced: as a run directory)
        raise ValueError(f"{out_dir} is a symbolic link (to {os.readlink(out_dir)}); export to "
                         f"a real path (the link's target, or a new directory)")
    source = run_model_dir(run_dir, best)
    model = load_pretrained(source)
    if not isinstance(model, ByteLM):
        raise ValueError(f"{run_dir}: the {model.config.layer!r} baseline "
                         f"({type(model).__name__}) has no Hugging Face class (only the rda/rwa "
                         f"scan models export)")
    if out_dir.exists() and not (out_dir.is_dir() and not any(out_dir.iterdir())):
        if not overwrite:
            raise ValueError(f"{out_dir} exists; pass --overwrite to replace an earlier export")
        if not _is_export(out_dir):
            raise ValueError(f"{out_dir} exists and is not a fastrwa Hugging Face export "
                             f"(or holds other files too); --overwrite replaces only those")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)          # (mkdtemp's 0700 would outlive the rename)
    try:
        if (source / "README.md").is_file():      # (the run's model card: how it was trained)
            shutil.copyfile(source / "README.md", staging / "README.md")
        with no_progress_bars():
            FastRWAForCausalLM.from_bytelm(model).save_pretrained(staging)
            FastRWAByteTokenizer().save_pretrained(staging)
        old = None
        if out_dir.exists() and any(out_dir.iterdir()):   # (moved aside, removed once the
            old = staging.with_name(staging.name + ".old")  # new one is in place)
            out_dir.rename(old)
        try:
            staging.rename(out_dir)
        except OSError:
            if old is not None:
                old.rename(out_dir)                      # (the earlier export, back)
            raise
        if old is not None:
            shutil.rmtree(old)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastrwa.hf.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    p.add_argument("--best", action="store_true", help="the run's best-validation model")
    p.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it holds an earlier export")
    args = p.parse_args(argv)
    try:
        out = export(args.run_dir, args.out_dir, args.best, args.overwrite)
    except (FileNotFoundError, ValueError, OSError, SafetensorError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {out}: AutoModelForCausalLM.from_pretrained({str(out)!r}) after "
          f"import fastrwa.hf, or with trust_remote_code=True", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
