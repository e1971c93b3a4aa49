"""What storing a trained model's weight matrices as bfloat16 or int8 costs in validation bpc:
``python -m bench.experiments.weights_bpc MODEL_DIR --data CORPUS``.

``MODEL_DIR`` is a ``save_pretrained`` directory (a run's ``model/`` or ``best/``). For each
format of ``fastrwa.models.PackedLM`` the model whose matrices are the ones the fused step
multiplies by (``PackedLM.dequantized()``) scores the first ``--bytes`` of the corpus's
validation split (the trainer's 90/5/5 split) in parallel, the state carried from segment to
segment, as the trainer's evaluation does. ``--check-steps`` more bytes are then stepped with
the packed model itself and its logits compared with that model's (the two are the same
function). Prints a table and writes ``OUT/weights_bpc.json`` (``--out``: by default
``bench-results/generation``, which git ignores; the committed record,
bench/results/generation, only with ``--record``, and only at full size).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F

from bench.cli import (add_out, check_out, existing_dir, existing_file,
                       int_at_least, positive_int)
from bench.cli import save_json
from fastrwa.models import WEIGHT_FORMATS, ByteLM, PackedLM, load_pretrained
from fastrwa.train.data import bits_per_byte, read_corpus, split_corpus, whole_split


@torch.no_grad()
def bpc(model, data: torch.Tensor, streams: int, segment: int) -> float:
    """Bits per byte of ``model`` over every next-byte prediction of ``data``."""
    total, count, state = 0.0, 0, None
    for inputs, targets in whole_split(data, streams, segment):
        logits, state = model(inputs, state)
        total += float(F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                       ignore_index=-100, reduction="sum"))
        count += int((targets != -100).sum())
    return bits_per_byte(total / count)


@torch.no_grad()
def packed_gap(packed: PackedLM, reference, tokens: torch.Tensor) -> float:
    """Largest relative logit difference of the packed step and ``reference``'s eager step."""
    cache, ref = packed.allocate_cache(1), reference.allocate_cache(1)
    worst = 0.0
    packed.prefill(tokens[None, :1], cache)
    reference.prefill(tokens[None, :1], ref)
    for t in range(1, len(tokens)):
        a, b = packed.step_(tokens[t:t + 1], cache), reference.step_(tokens[t:t + 1], ref)
        worst = max(worst, float((a - b).abs().max() / b.abs().max()))
    return worst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2) before any scoring:
    ``args.model`` loaded, ``args.valid`` (the validation bytes scored) read, ``--out``
    settled."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=existing_dir, help="a save_pretrained directory")
    p.add_argument("--data", type=existing_file, required=True,
                   help="the corpus the model was trained on")
    p.add_argument("--bytes", type=int_at_least(2), default=100_000,
                   help="validation bytes scored")
    p.add_argument("--streams", type=positive_int, default=16)
    p.add_argument("--segment", type=positive_int, default=512)
    p.add_argument("--check-steps", type=int_at_least(2), default=300,
                   help="bytes stepped with the packed model")
    add_out(p, "generation", "weights_bpc.json")
    args = p.parse_args(argv)
    if args.check_steps > args.bytes:
        p.error(f"--check-steps ({args.check_steps}) must not exceed --bytes ({args.bytes}): "
                f"the steps read the bytes scored")
    try:
        args.model = load_pretrained(args.model_dir).eval()
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        p.error(f"model_dir {args.model_dir}: {exc}")
    if not isinstance(args.model, ByteLM):
        p.error(f"model_dir {args.model_dir}: a {type(args.model).__name__}; the packed formats "
                f"are ByteLM's")
    try:
        valid = split_corpus(read_corpus(args.data))["valid"]
    except (OSError, ValueError) as exc:
        p.error(f"--data {args.data}: {exc}")
    if args.bytes > len(valid):
        p.error(f"--bytes {args.bytes}: the validation split of {args.data} has "
                f"{len(valid):,} bytes")
    args.valid = valid[:args.bytes]
    check_out(p, args, "generation", sizes=["bytes", "check_steps"])
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model, valid = args.model, args.valid
    rows = {}
    for weights in WEIGHT_FORMATS:
        packed = PackedLM(model, weights)
        twin = packed.dequantized().eval()
        rows[weights] = dict(bpc=bpc(twin, valid, args.streams, args.segment),
                             matrix_mb=packed.matrix_bytes / 1e6,
                             step_vs_parallel=packed_gap(packed, twin,
                                                         valid[:args.check_steps].long()))
    base = rows["float32"]["bpc"]
    result = dict(model_dir=str(args.model_dir), data=str(args.data), bytes=len(valid),
                  formats=rows)
    save_json(args.out / "weights_bpc.json", result)
    print(f"{args.model_dir}: validation bpc on the first {len(valid):,} bytes")
    for weights, r in rows.items():
        print(f"{weights:>9}: {r['matrix_mb']:5.1f} MB of matrices, bpc {r['bpc']:.4f} "
              f"({r['bpc'] - base:+.4f}); packed step against its parallel model over "
              f"{args.check_steps} steps: {r['step_vs_parallel']:.1e} relative")
    print(args.out / "weights_bpc.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
