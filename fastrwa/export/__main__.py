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
import math
import sys
from pathlib import Path


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


def main(argv: list[str] | None = None) -> int:
    """The command line ``python -m fastrwa.export onnx RUN_OR_MODEL_DIR OUT_DIR [...]``
    (``argv``: its arguments, ``sys.argv[1:]`` when ``None``). Returns the exit status: 0
    once written (and evaluated); 2, with a one-line ``error: ...`` on stderr, for what is
    refused (a bad ``--eval`` / ``--eval-bytes``, checked before anything is written; no
    model in the source; an ``OUT_DIR`` that is not an earlier export). argparse's own
    usage errors exit 2 as well (``SystemExit``)."""
    p = argparse.ArgumentParser(prog="python -m fastrwa.export", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="format", required=True, metavar="FORMAT")
    o = sub.add_parser("onnx", help="prompt.onnx and step.onnx for onnxruntime",
                       description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    o.add_argument("source", type=Path, metavar="RUN_OR_MODEL_DIR")
    o.add_argument("out_dir", type=Path, metavar="OUT_DIR")
    o.add_argument("--best", action="store_true", help="the run's best-validation model")
    o.add_argument("--weights", choices=("float32", "int8", "float16"), default="float32",
                   help="how the weight matrices are stored (default: float32)")
    o.add_argument("--exporter", choices=("torchscript", "dynamo"), default="torchscript",
                   help="torch.onnx's exporter (dynamo needs onnxscript; default: torchscript)")
    o.add_argument("--overwrite", action="store_true",
                   help="replace OUT_DIR if it holds an earlier ONNX export")
    o.add_argument("--eval", type=Path, metavar="FILE",
                   help="print the bits per byte of the export and of the PyTorch model on "
                        "the first --eval-bytes bytes of FILE")
    o.add_argument("--eval-bytes", type=int, default=16000, metavar="N",
                   help="bytes of FILE to evaluate, read as 8 rows (at least 16; default: 16000)")
    args = p.parse_args(argv)
    try:
        # (the evaluation's input first: a bad one refused before OUT_DIR is written)
        data = _read_eval(args.eval, args.eval_bytes)

        from ..models import load_pretrained, run_model_dir
        from .onnx import export_onnx

        source = run_model_dir(args.source, args.best)
        model = load_pretrained(source)
        out = export_onnx(model if type(model).__name__ == "ByteLM" else source,
                          args.out_dir, weights=args.weights, exporter=args.exporter,
                          overwrite=args.overwrite)
    except (FileNotFoundError, ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {out}: prompt.onnx, step.onnx ({args.weights} weights); "
          f"docs/onnx.md has the loop that runs them", file=sys.stderr)
    if data is not None:
        from .runtime import OnnxLM, bits_per_byte

        onnx_bpc = bits_per_byte(OnnxLM(out), data, EVAL_ROWS)
        torch_bpc = _torch_bits_per_byte(model, data, EVAL_ROWS)
        print(f"bits per byte on {len(data)} bytes of {args.eval}: onnxruntime "
              f"({args.weights}) {onnx_bpc:.4f}, PyTorch {torch_bpc:.4f}, change "
              f"{onnx_bpc - torch_bpc:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
