"""``python -m fastrwa.generate RUN_OR_MODEL_DIR``: continue a prompt with a trained byte LM.

``RUN_OR_MODEL_DIR`` is a training run's directory (its final ``model/`` export, or
``best/`` with ``--best``) or any directory written by ``fastrwa.models.save_pretrained``.
The text is printed as it is generated (streaming, O(1) state per layer); ``--beam N`` runs
beam search and prints the best beam at the end. On CPU the steps run the fused decode step
(``fastrwa.models.PackedLM``) with float32 (``--weights auto``, the default), bfloat16 or
int8 matrices; on CUDA the step replayed from a CUDA graph. Needs no training code.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .models import WEIGHT_FORMATS, ByteLM, PackedLM, load_model
from .options import (add_device, add_model_directory, add_sampling, add_threads, add_weights,
                      check_options, device_of)


def _speed(count: int, began: float, first: float | None, end: float) -> str:
    """``N bytes in S s``, and when streaming: the first byte's delay (prefill, set-up) and
    the rate of the bytes after it."""
    text = f"{count} bytes in {end - began:.2f} s"
    if first is None or count < 2:
        return text + f" ({count / max(end - began, 1e-9):,.0f} bytes/s)"
    return (text + f": the first after {1e3 * (first - began):.0f} ms, then "
            f"{(count - 1) / max(end - first, 1e-9):,.0f} bytes/s")


def parser() -> argparse.ArgumentParser:
    """The command line's parser (the options the CLIs share: :mod:`fastrwa.options`)."""
    p = argparse.ArgumentParser(prog="python -m fastrwa.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_directory(p)
    p.add_argument("--prompt", default="", help="text to continue (UTF-8; default: none)")
    p.add_argument("--max-new", type=int, default=500, help="bytes to generate (default 500)")
    add_sampling(p)
    p.add_argument("--beam", type=int, default=1, help="beam search width (default 1: sample)")
    add_device(p)
    add_weights(p)
    add_threads(p)
    return p


def check_args(args: argparse.Namespace) -> None:
    """Refuse (``ValueError``, naming the option) values no generation can use (the shared
    options: :func:`fastrwa.options.check_options`)."""
    check_options(args)
    if args.beam < 1:
        raise ValueError(f"--beam must be at least 1 (1: sample, more: beam search), "
                         f"got {args.beam}")
    if args.max_new < 0:
        raise ValueError(f"--max-new must be 0 or more bytes, got {args.max_new}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        check_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or threads)
    try:
        return _generate(args)
    finally:
        torch.set_num_threads(threads)      # (main may be called from a program)


def _generate(args) -> int:
    device = device_of(args.device)
    try:
        model = load_model(args.run_dir, args.best).to(device)
        options = {}
        if isinstance(model, ByteLM):
            options["weights"] = args.weights
            if args.weights in WEIGHT_FORMATS:     # (refuses a model it cannot pack)
                options["weights"] = PackedLM(model, args.weights)
        elif args.weights not in ("auto", "eager"):
            raise ValueError(f"--weights {args.weights}: {type(model).__name__} (the "
                             f"{model.config.layer!r} baseline) has the eager step only")
        # (surrogateescape: a prompt given as bytes that are not UTF-8 is continued as given)
        text = args.prompt.encode("utf-8", "surrogateescape")
        prompt = torch.tensor(list(text), dtype=torch.long, device=device)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        out = sys.stdout.buffer
        out.write(text)
        began, first, count = time.perf_counter(), None, 0
        if args.beam > 1:
            tokens = model.generate(prompt, args.max_new, beam_size=args.beam,
                                    **options)[0, len(prompt):]
            out.write(bytes(tokens.tolist()))
            count = len(tokens)
        else:
            for token in model.stream(prompt, args.max_new, args.temperature, args.top_k,
                                      args.top_p, generator=gen, **options):
                out.write(bytes([int(token[0])]))
                out.flush()
                count += 1
                first = first or time.perf_counter()
        out.write(b"\n")
        out.flush()
        print(_speed(count, began, first, time.perf_counter()), file=sys.stderr)
        return 0
    except BrokenPipeError:
        # The reader stopped (``| head``): end quietly. Standard output is pointed at
        # /dev/null so that the interpreter's last flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (FileNotFoundError, ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
