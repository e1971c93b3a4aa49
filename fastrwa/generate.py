"""``python -m fastrwa.generate RUN_DIR``: continue a prompt with a trained byte LM.

``RUN_DIR`` is a training run's directory (its final ``model/`` export, or ``best/`` with
``--best``) or any directory written by ``fastrwa.models.save_pretrained``. The text is
printed as it is generated (streaming, O(1) state per layer); ``--beam N`` runs beam search
and prints the best beam at the end. On CPU the steps run the fused decode step
(``fastrwa.models.PackedLM``) with ``--weights`` float32 (the default), bfloat16 or int8
matrices. Needs no training code.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from .models import WEIGHT_FORMATS, ByteLM, PackedLM, load_pretrained, run_model_dir
from .models.sampling import check_temperature, check_top_p


def _speed(count: int, began: float, first: float | None, end: float) -> str:
    """``N bytes in S s``, and when streaming: the first byte's delay (prefill, set-up) and
    the rate of the bytes after it."""
    text = f"{count} bytes in {end - began:.2f} s"
    if first is None or count < 2:
        return text + f" ({count / max(end - began, 1e-9):,.0f} bytes/s)"
    return (text + f": the first after {1e3 * (first - began):.0f} ms, then "
            f"{(count - 1) / max(end - first, 1e-9):,.0f} bytes/s")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m fastrwa.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    p.add_argument("--prompt", default="", help="text to continue (UTF-8; default: none)")
    p.add_argument("--max-new", type=int, default=500, help="bytes to generate (default 500)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="default 1.0 (as ByteLM.generate and Hugging Face generate())")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--beam", type=int, default=1, help="beam search width (default 1: sample)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--best", action="store_true", help="the best-validation model of the run")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--weights", choices=("auto", "eager", *WEIGHT_FORMATS), default="auto",
                   help="how the steps run: the fused CPU decode step with the weight "
                        "matrices stored as float32, bfloat16 or int8 (auto: float32 on CPU; "
                        "the eager PyTorch step on CUDA), or eager (the reference)")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads (default: PyTorch's). At batch 1 every op is small: on an "
                        "idle machine 2 threads beat 1 by a few percent, but when other work "
                        "shares the cores, 1 thread avoids the thread pool's waits (bench/"
                        "generation.py measured 0.4 against 16 ms a step for a small model)")
    return p


MAX_GENERATOR_SEED = 2 ** 64 - 1   # torch.Generator.manual_seed's largest seed


def check_args(args: argparse.Namespace) -> None:
    """Refuse (``ValueError``, naming the option) values no generation can use."""
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {args.threads}")
    if args.beam < 1:
        raise ValueError(f"--beam must be at least 1 (1: sample, more: beam search), "
                         f"got {args.beam}")
    if args.max_new < 0:
        raise ValueError(f"--max-new must be 0 or more bytes, got {args.max_new}")
    check_temperature(args.temperature, "--temperature")
    if args.top_k is not None and args.top_k < 1:
        raise ValueError(f"--top-k must be at least 1, got {args.top_k}")
    if args.top_p is not None:
        check_top_p(args.top_p, "--top-p")
    if not 0 <= args.seed <= MAX_GENERATOR_SEED:
        raise ValueError(f"--seed must be an integer from 0 to {MAX_GENERATOR_SEED} "
                         f"(2**64 - 1), got {args.seed}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available here (PyTorch "
                         f"{torch.__version__}, built {'with' if torch.version.cuda else 'without'}"
                         f" CUDA); use --device cpu")
    if args.weights in WEIGHT_FORMATS and args.device == "cuda":
        raise ValueError(f"--weights {args.weights}: the fused decode step runs on CPU; use "
                         f"--device cpu, or --weights eager on CUDA")


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


def _load(directory: Path, best: bool):
    """The model of a run directory, a ``save_pretrained`` directory or a Hugging Face
    export (:func:`fastrwa.models.load_pretrained` reads both weight files, checked)."""
    return load_pretrained(run_model_dir(directory, best))


def _generate(args) -> int:
    device = torch.device("cuda" if args.device == "cuda" or (
        args.device == "auto" and torch.cuda.is_available()) else "cpu")
    try:
        model = _load(args.run_dir, args.best).to(device)
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
