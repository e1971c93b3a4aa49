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


def main(argv: list[str] | None = None) -> int:
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
                   help="bytes of FILE to evaluate, read as 8 rows (default: 16000)")
    args = p.parse_args(argv)
    try:
        from ..models import load_pretrained, run_model_dir
        from .onnx import export_onnx

        source = run_model_dir(args.source, args.best)
        model = load_pretrained(source)
        out = export_onnx(model if type(model).__name__ == "ByteLM" else source,
                          args.out_dir, weights=args.weights, exporter=args.exporter,
                          overwrite=args.overwrite)
        data = None
        if args.eval is not None:
            if args.eval_bytes < 16:
                raise ValueError(f"--eval-bytes must be at least 16, got {args.eval_bytes}")
            with open(args.eval, "rb") as f:
                data = f.read(args.eval_bytes)
    except (FileNotFoundError, ValueError, TypeError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"exported {out}: prompt.onnx, step.onnx ({args.weights} weights); "
          f"docs/onnx.md has the loop that runs them", file=sys.stderr)
    if data is not None:
        from .runtime import OnnxLM, bits_per_byte

        onnx_bpc = bits_per_byte(OnnxLM(out), data)
        torch_bpc = _torch_bits_per_byte(model, data, 8)
        print(f"bits per byte on {len(data)} bytes of {args.eval}: onnxruntime "
              f"({args.weights}) {onnx_bpc:.4f}, PyTorch {torch_bpc:.4f}, change "
              f"{onnx_bpc - torch_bpc:+.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
