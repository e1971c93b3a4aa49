"""``python -m fastrwa.export onnx RUN_OR_MODEL_DIR OUT_DIR``: a ``ByteLM`` as ONNX
(``prompt.onnx``, ``step.onnx``, ``onnx_config.json``; docs/onnx.md).

``RUN_OR_MODEL_DIR`` is a training run's directory (its final ``model/``, or ``best/`` with
``--best``) or any directory ``fastrwa.models.save_pretrained`` wrote. ``--weights int8``
or ``float16`` store the weight matrices so (onnxruntime's dynamic int8 quantisation, or
float16 widened to float32 at run time). ``--eval FILE`` then reads the first
``--eval-bytes`` bytes of FILE with onnxruntime and with the PyTorch model and prints both
bits per byte (what the weights format costs).
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from pathlib import Path
from typing import Optional

from ..extras import install_hint
from ..models.files import sigterm_raises, stop_line
from ..options import add_model_directory, add_overwrite
from .names import WHAT


def _torch_bits_per_byte(model, data: bytes, rows: int) -> float:
    import torch
    import torch.nn.functional as F

    from .runtime import text_rows

    ids = torch.from_numpy(text_rows(data, rows))
    with torch.no_grad():
        logits, _ = model(ids)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    return loss.item() / math.log(2)


EVAL_ROWS = 8               # (--eval reads its bytes as 8 rows, each of 2 bytes or more)


def _read_eval(path: Path | None, n: int) -> bytes | None:
    """The first ``n`` bytes of the ``--eval`` file (``None`` without one), read before
    anything is exported; ``ValueError`` (the CLI's one-line error, exit 2) naming
    ``--eval-bytes`` or ``--eval`` for what the evaluation could not use (``--eval-bytes``
    is checked with or without ``--eval``)."""
    least = 2 * EVAL_ROWS
    if n < least:
        raise ValueError(f"argument --eval-bytes: must be at least {least} ({EVAL_ROWS} rows "
                         f"of 2 bytes), got {n}")
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(n)
    except OSError as exc:
        raise ValueError(f"argument --eval: cannot read {path}: "
                         f"{exc.strerror or exc}") from exc
    if len(data) < least:
        raise ValueError(f"argument --eval: {path} has {len(data)} bytes, too few to "
                         f"evaluate on (at least {least}: {EVAL_ROWS} rows of 2 bytes)")
    return data


def _missing_extra(exporter: str) -> Optional[str]:
    """The one-line error for a module of the ``onnx`` extra that is not installed (onnx,
    onnxruntime; onnxscript for ``--exporter dynamo``), or ``None``."""
    for name in ("onnx", "onnxruntime", *(("onnxscript",) if exporter == "dynamo" else ())):
        try:
            importlib.import_module(name)
        except ImportError:
            needs = "--exporter dynamo needs" if name == "onnxscript" else "the ONNX export needs"
            return f"{needs} {name}, which is not installed: {install_hint('onnx')}"
    return None


def parser() -> argparse.ArgumentParser:
    """The command line's parser: ``onnx``'s options (those the CLIs share:
    :mod:`fastrwa.options`)."""
    p = argparse.ArgumentParser(prog="python -m fastrwa.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    o = sub.add_parser("onnx", help="prompt.onnx and step.onnx for onnxruntime",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_directory(o, "source")
    o.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    o.add_argument("--weights", choices=("float32", "int8", "float16"), default="float32",
                   help="how the weight matrices are stored (default: float32)")
    o.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript",
                   help="torch.onnx's exporter (dynamo needs onnxscript; default: torchscript)")
    add_overwrite(o, "OUT_DIR", WHAT)
    o.add_argument("--eval", type=Path, metavar="FILE",
                   help="print the bits per byte of the export and of the PyTorch model on "
                        "the first --eval-bytes bytes of FILE")
    o.add_argument("--eval-bytes", type=int, default=16000, metavar="N",
                   help="bytes of FILE to evaluate, read as 8 rows (at least 16; default: 16000)")
    return p


def main(argv: list[str] | None = None) -> int:
    """The command line ``python -m fastrwa.export onnx RUN_OR_MODEL_DIR OUT_DIR [...]``
    (``argv``: its arguments, ``sys.argv[1:]`` when ``None``). Returns the exit status: 0
    once written (and evaluated); 2, with a one-line ``error: ...`` on stderr, for what is
    refused (a bad ``--eval`` / ``--eval-bytes``, checked before anything is written; the
    ``onnx`` extra not installed; no model in the source; an ``OUT_DIR`` that is not an
    earlier export) or cannot be written (a full disk: ``OUT_DIR`` is left as it was);
    130 for Ctrl-C and 143 for SIGTERM, with one ``stopped`` line (``OUT_DIR`` as it was,
    or written whole if the stop came during ``--eval``). argparse's own usage errors exit
    2 as well (``SystemExit``)."""
    args = parser().parse_args(argv)
    # (absolute: an OUT_DIR of "." or one holding the working directory is replaced by a
    # rename; --eval then reads the new directory, not the one the process stood in)
    args.out_dir = args.out_dir.absolute()
    existed = args.out_dir.exists()
    written = False
    try:
        with sigterm_raises():
            status = _export(args)
            written = True
            if status == 0:
                _evaluate(args)
            return status
    except KeyboardInterrupt as stop:
        line, status = stop_line(stop, args.out_dir, existed, written)
        print(line + (", not evaluated" if args.eval is not None and line.endswith("whole")
                      else ""), file=sys.stderr)
        return status


def _export(args: argparse.Namespace) -> int:
    """The export of :func:`main`'s ``args``: 0 once written, 2 with one ``error:`` line."""
    try:
        # (the evaluation's input first: a bad one refused before OUT_DIR is written)
        args.data = _read_eval(args.eval, args.eval_bytes)
        missing = _missing_extra(args.exporter)
        if missing:
            raise ValueError(missing)

        from ..models import load_bytelm
        from .onnx import USE, export_onnx

        args.model = load_bytelm(args.source, args.best, USE)
        out = export_onnx(args.model, args.out_dir, weights=args.weights,
                          exporter=args.exporter, overwrite=args.overwrite)
    except (FileNotFoundError, ValueError, TypeError, OSError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {out}: prompt.onnx, step.onnx ({args.weights} weights); "
          f"docs/onnx.md has the loop that runs them", file=sys.stderr)
    return 0


def _evaluate(args: argparse.Namespace) -> None:
    """``--eval``'s line (nothing without ``--eval``)."""
    if args.data is None:
        return
    from .runtime import OnnxLM, bits_per_byte

    data = args.data
    onnx_bpc = bits_per_byte(OnnxLM(args.out_dir), data, EVAL_ROWS)
    torch_bpc = _torch_bits_per_byte(args.model, data, EVAL_ROWS)
    print(f"bits per byte on {len(data)} bytes of {args.eval}: onnxruntime "
          f"({args.weights}) {onnx_bpc:.4f}, PyTorch {torch_bpc:.4f}, change "
          f"{onnx_bpc - torch_bpc:+.4f}")


if __name__ == "__main__":
    sys.exit(main())
