"""Streaming generation of the byte LM against the machine's limit: ``python -m bench.generation``
(``--model large``: a ByteLM of 107M parameters, 429 MB of float32 weights, whose every step
reads DRAM, not the cache).

For the default ``ByteLM`` (d_model 256, 4 blocks) and each weight format of the fused CPU
decode step (``fastrwa.models.PackedLM``: float32, bfloat16, int8), measured in one run:

* **batch 1**, as ``python -m fastrwa.generate`` streams (``ByteLM.stream``: one fused step
  and one ``sample`` per byte), in bytes/s after the first byte, with 1 and 2 threads;
* **the limit**: the weight bytes one step reads (every matrix once) over the read
  bandwidth of a buffer of that size, measured here on as many threads (``sum`` of a
  float32 buffer of those bytes, best of many), and the ratio of the stream's rate to it;
* **batch 8 and 64**: aggregate bytes/s of the stream (every row sampled every step), and
  the bound of the machine's arithmetic for them: the multiply-adds of a step at PyTorch's
  best large float32 matrix product rate (``torch.mm`` 1024 x 1024 x 1024, measured here);
* **first byte**: from a loaded model to the first byte out of ``stream`` (packing, the
  prompt, one sample), kernels already loaded in this process;
* **resident memory** before and after 10,000 bytes at batch 1 (flat: the state is fixed);
* the eager PyTorch step (``weights="eager"``, the reference) at batch 1 for comparison;
* **Hugging Face** ``generate()`` (``fastrwa.hf.FastRWAForCausalLM``, greedy, batch 1, a
  20-byte prompt) beside ``ByteLM.generate`` on the same step, interleaved, and the
  time per token of transformers' own loop (its ``generate()`` on a forward that returns
  fixed logits): what HF adds to every step, whatever the model (skipped without the
  ``hf`` extra).
* **draws**: a step's draws at batch 64, each row with its own settings and generator (the
  server's streams), a row a call against one call over the rows (``PackedLM.draw`` with a
  list of ``Sampling``), in milliseconds;
* **ONNX**: greedy bytes/s at batch 1, 8 and 64 of the model's ONNX export run by
  onnxruntime (docs/onnx.md's loop) against the fused float32 decode, interleaved
  (skipped without the ``onnx`` extra).

Then **cold start**: in fresh processes, the first ``ByteLM`` forward+backward, and the first
streamed byte, after ``import fastrwa``, against the same call warm (numba's cache loaded
from disk, nothing compiled: a first run ever compiles once, see docs/lm.md); and, for the
floor under both, the first call of the smallest cached kernel
(``kernels/cpu/scan_fwd.py``'s ``time_index``): numba's own start in a process.

Speed does not depend on the weights' values: the model is freshly initialised. Prints a
table and writes ``OUT/generation.json`` (``--out``: by default ``bench-results/generation``
or, ``--model large``, ``bench-results/generation-large``, which git ignores; the committed
records, bench/results/generation and bench/results/generation-large, only with
``--record``, and never from ``--quick``, a smaller model or stream, or fewer thread counts,
batches, weight formats or cold runs than the full run's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from bench.cli import (ROOT, add_out, check_out, choices_list, int_at_least, int_list,
                       nonnegative_int, positive_int, smaller)
from bench.cli import save_json
from fastrwa.models import WEIGHT_FORMATS, ByteLM, LMConfig, PackedLM
from fastrwa.train.config import parse_lm_field


# --model: the sizes, and for the large one a run that fits minutes (a step reads 429 MB)
PRESETS = {
    "default": dict(d_model=256, layers=4),
    "large": dict(d_model=1024, layers=6, bytes=60, rss_bytes=0, batches=[8],
                  weights=list(WEIGHT_FORMATS), cold_runs=0),
}
WEIGHTS = ("eager", *WEIGHT_FORMATS)       # --weights: the eager step and the packed formats


def rss_mb() -> float:
    """Resident memory of this process in MB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def best_s(fn, repeats: int) -> float:
    """The fastest of ``repeats`` calls, in seconds."""
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return best


def read_s(nbytes: int, repeats: int) -> float:
    """Seconds to read ``nbytes`` once: the sum of a float32 buffer that size, at its best."""
    buffer = torch.ones(max(1, nbytes // 4))
    return best_s(buffer.sum, repeats)


def gemm_flops(repeats: int) -> float:
    """PyTorch's float32 matrix product rate on large operands, FLOP/s (best of ``repeats``)."""
    a, b, out = torch.randn(1024, 1024), torch.randn(1024, 1024), torch.empty(1024, 1024)
    return 2 * 1024 ** 3 / best_s(lambda: torch.mm(a, b, out=out), repeats)


def stream_rate(model: ByteLM, weights, batch: int, n_bytes: int) -> tuple[float, float]:
    """``(bytes/s after the first byte, all rows, seconds to the first byte)`` of
    ``model.stream`` on a 4-byte prompt per row."""
    prompt = torch.tensor([list(b"The ")] * batch)
    gen = torch.Generator().manual_seed(0)
    began = time.perf_counter()
    first, count = None, 0
    for _ in model.stream(prompt, n_bytes, weights=weights, generator=gen):
        count += 1
        first = first or time.perf_counter()
    return batch * (count - 1) / (time.perf_counter() - first), first - began


def multiply_adds(model: ByteLM) -> int:
    """Multiply-adds of one step per row: every weight matrix once."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    return sum(m.weight.numel() for m in dict.fromkeys(linears))


def measure(model: ByteLM, weights: str, threads: list[int], n_bytes: int, batches: list[int],
            rss_bytes: int, repeats: int, flops: float) -> dict:
    """Every number of one weight format (module doc)."""
    if weights == "eager":
        nbytes, packed = sum(m.weight.numel() * 4 for m in dict.fromkeys(
            x for x in model.modules() if isinstance(x, torch.nn.Linear))), "eager"
    else:
        packed = PackedLM(model, weights)
        nbytes = packed.matrix_bytes
    stream_rate(model, packed, 1, 20)                                 # warm-up
    out = dict(weight_bytes=nbytes, batch1={})
    for n in threads:
        torch.set_num_threads(n)
        limit = 1.0 / read_s(nbytes, repeats)          # (the read on as many threads)
        rate, _ = stream_rate(model, packed, 1, n_bytes)
        out["batch1"][n] = dict(bytes_per_s=rate, limit_bytes_per_s=limit,
                                of_limit=rate / limit, weights_gb_per_s=rate * nbytes / 1e9,
                                read_gb_per_s=limit * nbytes / 1e9)
    torch.set_num_threads(max(threads))
    out["batches"] = {}
    for B in batches:
        rate, _ = stream_rate(model, packed, B, max(20, n_bytes * 8 // B // 10))
        out["batches"][B] = dict(bytes_per_s=rate,
                                 arithmetic_bound=flops / (2 * multiply_adds(model)))
    out["first_byte_ms"] = 1e3 * min(
        stream_rate(model, weights, 1, 2)[1]
        for _ in range(5))
    if rss_bytes:
        before = rss_mb()
        stream_rate(model, packed, 1, rss_bytes)
        out["rss_mb"] = [before, rss_mb()]
    return out


def hf_against_bytelm(model: ByteLM, n_bytes: int, repeats: int) -> dict | None:
    """Bytes/s of greedy decoding through Hugging Face's ``generate()`` and through
    ``ByteLM.generate`` (batch 1, a 20-byte prompt, ``n_bytes`` new bytes, best of
    ``repeats``, interleaved) for the default step and the eager one, and the seconds per
    token of transformers' loop around a forward that costs nothing. ``None`` without
    transformers."""
    try:
        from fastrwa.hf import FastRWACache, FastRWACausalLMOutput, FastRWAForCausalLM
    except ImportError:
        return None
    hf = FastRWAForCausalLM.from_bytelm(model).eval()
    prompt = torch.tensor([list(b"The quick brown fox ")])
    runs = {f"{who} {weights}": (
        (lambda w=weights: hf.generate(prompt, max_new_tokens=n_bytes, do_sample=False,
                                       weights=w)) if who == "hf" else
        (lambda w=weights: model.generate(prompt, n_bytes, top_k=1, weights=w)))
        for weights in ("auto", "eager") for who in ("ByteLM", "hf")}
    best = {name: float("inf") for name in runs}
    for _ in range(repeats):                                 # (interleaved: same conditions)
        for name, run in runs.items():
            began = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - began)
    out = {name: dict(bytes_per_s=n_bytes / s) for name, s in best.items()}
    for weights in ("auto", "eager"):
        out[f"hf {weights}"]["time_over_ByteLM"] = best[f"hf {weights}"] / best[f"ByteLM {weights}"]
    fixed = torch.zeros(1, 1, model.config.vocab_size)

    def free_forward(input_ids=None, past_key_values=None, **_):
        seen = input_ids.shape[1] + (past_key_values.seen if past_key_values else 0)
        return FastRWACausalLMOutput(logits=fixed.clone(),
                                     past_key_values=FastRWACache(None, seen))
    hf.forward = free_forward
    loop = best_s(lambda: hf.generate(prompt, max_new_tokens=n_bytes, do_sample=False),
                  repeats)
    out["transformers_loop_ms_per_token"] = 1e3 * loop / n_bytes
    return out


def onnx_against_fused(model: ByteLM, batches: list[int], n_bytes: int,
                       repeats: int) -> dict | None:
    """Greedy bytes/s (all rows, after the first byte, best of ``repeats``, interleaved) of
    the model's ONNX export run by onnxruntime (``prompt.onnx`` then ``step.onnx``, NumPy's
    argmax between steps, as docs/onnx.md's loop; its session on as many threads as
    PyTorch has) and of fastrwa's fused CPU decode (``weights="float32"``, ``top_k=1``) at
    each batch, on a 4-byte prompt per row. ``None`` without onnxruntime (the ``onnx``
    extra)."""
    try:
        from fastrwa.export import OnnxLM, export_onnx
    except ImportError:
        return None
    import tempfile

    threads = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        lm = OnnxLM(export_onnx(model, tmp), threads=threads)
    packed = PackedLM(model, "float32")
    out = {}
    for B in batches:
        n = n_bytes if B == 1 else max(20, n_bytes * 8 // B // 10)
        prompt = torch.tensor([list(b"The ")] * B)

        def run_onnx():
            logits, state = lm.prompt(prompt.numpy())
            began = None
            for i in range(n):
                token = logits[:, :lm.bos_token].argmax(-1)
                began = began or time.perf_counter()
                if i + 1 < n:
                    logits, state = lm.step(token, state)
            return time.perf_counter() - began

        def run_fused():
            began = None
            for _ in model.stream(prompt, n, top_k=1, weights=packed):
                began = began or time.perf_counter()
            return time.perf_counter() - began

        best = dict(onnxruntime=float("inf"), fused=float("inf"))
        for _ in range(repeats):
            for name, run in (("onnxruntime", run_onnx), ("fused", run_fused)):
                best[name] = min(best[name], run())
        out[B] = {name: B * (n - 1) / s for name, s in best.items()}
        out[B]["onnxruntime_over_fused"] = out[B]["onnxruntime"] / out[B]["fused"]
    out["threads"] = threads
    out["onnxruntime"] = __import__("onnxruntime").__version__
    return out


def draws_per_row(model: ByteLM, batch: int, repeats: int) -> dict:
    """Milliseconds of one step's draws at ``batch`` rows, each row with its own settings
    and generator (the server's streams): a call of ``PackedLM.draw`` a row (a ``(1, V)``
    row and one ``Sampling``), against one call over every row (a list of ``Sampling``);
    the same ids (checked). Median of ``repeats`` steps, the two interleaved."""
    from fastrwa.models.decoding import Sampling

    packed = PackedLM(model, "float32")
    cache = packed.allocate_cache(batch)
    logits = packed.prefill(torch.tensor([list(b"The ")] * batch), cache).clone()
    rows = logits.split(1)

    def settings() -> list:
        return [Sampling(1.0, None, None, torch.Generator().manual_seed(i))
                for i in range(batch)]
    each, one = settings(), settings()
    times = dict(per_row=[], one_call=[])
    for _ in range(repeats):
        began = time.perf_counter()
        alone = [int(packed.draw(rows[i], each[i], 256)) for i in range(batch)]
        middle = time.perf_counter()
        together = packed.draw(logits, one, 256).tolist()
        times["per_row"].append(middle - began)
        times["one_call"].append(time.perf_counter() - middle)
        if alone != together:
            raise AssertionError("the draws in one call differ from the draws a row a call")
    out = {name: 1e3 * sorted(t)[len(t) // 2] for name, t in times.items()}
    return dict(batch=batch, per_row_ms=out["per_row"], one_call_ms=out["one_call"])


COLD = r"""
import json, sys, time
began = time.perf_counter()
import torch
import fastrwa
from fastrwa.models import ByteLM, LMConfig
torch.manual_seed(0)
model = ByteLM(LMConfig(d_model=64, n_layers=2))
tokens = torch.randint(0, 256, (4, 64))
imported = time.perf_counter()
def forward_backward():
    logits, _ = model(tokens)
    logits.float().logsumexp(-1).mean().backward()
def first_byte():
    next(iter(model.stream(tokens[0, :4], 1)))
def numba_floor():
    from fastrwa.kernels.cpu.scan_fwd import time_index
    time_index(0, 10, 3, False)
fn = {"forward_backward": forward_backward, "first_byte": first_byte,
      "numba_floor": numba_floor}[sys.argv[1]]
t = time.perf_counter(); fn(); first = time.perf_counter() - t
warm = min(__import__("timeit").repeat(fn, number=1, repeat=5))
print(json.dumps(dict(first_s=first, warm_s=warm, import_s=imported - began)))
"""


def cold_start(runs: int) -> dict:
    """Per call (a first forward+backward, a first streamed byte), each in fresh processes:
    the first call's and the warm call's seconds, and the import's (median of ``runs``)."""
    out = {}
    for call in ("forward_backward", "first_byte", "numba_floor"):
        results = []
        for _ in range(runs):
            done = subprocess.run([sys.executable, "-c", COLD, call], capture_output=True,
                                  text=True, cwd=ROOT, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        out[call] = sorted(results, key=lambda r: r["first_s"])[len(results) // 2]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--model``'s sizes
    and ``--quick``'s applied, ``args.config`` made and ``--out`` settled."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="default",
                   help="default: d_model 256 x 4 blocks (18 MB of float32 weights, in this "
                        "machine's L3); large: 1024 x 6 (107M parameters, 429 MB: read from "
                        "DRAM), with fewer bytes, batches 8, no eager step and no cold start "
                        "unless given")
    p.add_argument("--d-model", type=positive_int, default=None, help="overrides --model's")
    p.add_argument("--layers", type=positive_int, default=None, help="overrides --model's")
    p.add_argument("--bytes", type=int_at_least(2), default=3000,
                   help="bytes streamed at batch 1 (the rate is taken after the first)")
    p.add_argument("--rss-bytes", type=nonnegative_int, default=10000,
                   help="bytes streamed while watching resident memory (0: not watched)")
    p.add_argument("--threads", type=int_list(), default=[1, 2],
                   help="thread counts at batch 1 (comma-separated)")
    p.add_argument("--batches", type=int_list(empty=True), default=[8, 64],
                   help="larger batches (max threads; '' for none)")
    p.add_argument("--weights", type=choices_list(WEIGHTS), default=list(WEIGHTS),
                   help="the steps measured (comma-separated)")
    p.add_argument("--lm", action="append", type=parse_lm_field, default=[], metavar="KEY=VALUE",
                   help="LMConfig fields (as the trainer's --lm)")
    p.add_argument("--cold-runs", type=nonnegative_int, default=3,
                   help="fresh processes (0: none)")
    add_out(p, "generation", "generation.json (with --model large: generation-large)")
    p.add_argument("--quick", action="store_true", help="a tiny model, a few bytes (CI)")
    args = p.parse_args(argv)
    preset = PRESETS[args.model]
    sized = ("d_model", "layers", "bytes", "rss_bytes", "threads", "batches", "weights",
             "cold_runs")                   # (a full run's values: the defaults, the preset's)
    full = {name: p.get_default(name) for name in sized[2:]} | preset
    for name, value in preset.items():
        if getattr(args, name) is None or (name not in ("d_model", "layers")
                                           and getattr(args, name) == p.get_default(name)):
            setattr(args, name, value)
    small = [f"--{name.replace('_', '-')}" for name in sized
             if smaller(getattr(args, name), full[name])]
    args.repeats = 200 if args.model == "default" else 20
    if args.quick:
        args.d_model, args.layers, args.bytes, args.rss_bytes = 32, 2, 50, 0
        args.batches, args.cold_runs, args.repeats = [8], 0, 5
    fields = dict(args.lm)
    taken = sorted(set(fields) & {"d_model", "n_layers"})
    if taken:
        p.error(f"--lm {taken[0]}=...: set by --d-model and --layers; use those flags")
    try:
        args.config = LMConfig(d_model=args.d_model, n_layers=args.layers, **fields)
    except (TypeError, ValueError) as exc:
        p.error(f"--lm: {exc}")
    name = "generation" if args.model == "default" else f"generation-{args.model}"
    check_out(p, args, name, small=small)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config, repeats = args.config, args.repeats
    torch.manual_seed(0)
    model = ByteLM(config).eval()
    params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    threads, batches = args.threads, args.batches
    flops = gemm_flops(repeats // 10 + 1)
    formats = {}
    for weights in args.weights:
        formats[weights] = measure(model, weights, threads, args.bytes if weights != "eager"
                                   else min(args.bytes, 500), batches,
                                   args.rss_bytes if weights != "eager" else 0, repeats, flops)
    hf = hf_against_bytelm(model, 20 if args.quick else 200, 2 if args.quick else 3) \
        if args.model == "default" else None
    onnx = onnx_against_fused(model, [1, 8, 64] if not args.quick else [1, 8],
                              args.bytes if not args.quick else 20, 2 if args.quick else 3)
    draws = draws_per_row(model, 8 if args.quick else 64, 5 if args.quick else 200)
    cold = cold_start(args.cold_runs) if args.cold_runs else None
    result = dict(config=config.to_dict(), params=params, torch=torch.__version__,
                  cpu_count=os.cpu_count(), gemm_flops=flops, formats=formats, cold_start=cold,
                  hugging_face=hf, onnx=onnx, draws=draws, date=time.strftime("%Y-%m-%d"))
    save_json(args.out / "generation.json", result)
    print(f"ByteLM d_model {args.d_model} x {args.layers} blocks ({params:,} parameters); "
          f"torch.mm peak {flops / 1e9:.0f} GFLOP/s")
    rows = [("weight bytes read per step, MB", lambda r: f"{r['weight_bytes'] / 1e6:.1f}")]
    for n in threads:
        rows.append((f"limit, {n} thread(s) (bytes / read bandwidth), bytes/s",
                     lambda r, n=n: f"{r['batch1'][n]['limit_bytes_per_s']:,.0f}"))
        rows.append((f"batch 1, {n} thread(s), bytes/s (x limit)",
                     lambda r, n=n: f"{r['batch1'][n]['bytes_per_s']:,.1f} "
                                    f"({r['batch1'][n]['of_limit']:.2f})"))
        rows.append((f"  weights read, GB/s (read bandwidth, {n} thread(s))",
                     lambda r, n=n: f"{r['batch1'][n]['weights_gb_per_s']:.1f} "
                                    f"({r['batch1'][n]['read_gb_per_s']:.1f})"))
    for B in batches:
        rows.append((f"batch {B}, bytes/s all rows (arithmetic bound)",
                     lambda r, B=B: f"{r['batches'][B]['bytes_per_s']:,.0f} "
                                    f"({r['batches'][B]['arithmetic_bound']:,.0f})"))
    rows.append(("first byte after load, ms", lambda r: f"{r['first_byte_ms']:.1f}"))
    rows.append(("resident memory over the stream, MB",
                 lambda r: "{:.0f} -> {:.0f}".format(*r["rss_mb"]) if "rss_mb" in r else "-"))
    width = max(len(name) for name, _ in rows)
    print(f"{'':<{width}}  " + "  ".join(f"{w:>16}" for w in formats))
    for name, cell in rows:
        print(f"{name:<{width}}  " + "  ".join(f"{cell(r):>16}" for r in formats.values()))
    if hf:
        print(f"greedy, batch 1, {torch.get_num_threads()} threads, bytes/s (best of the "
              f"interleaved runs): " + "; ".join(
                  f"ByteLM.generate {w} {hf[f'ByteLM {w}']['bytes_per_s']:,.0f}, Hugging Face "
                  f"generate() {hf[f'hf {w}']['bytes_per_s']:,.0f} "
                  f"({hf[f'hf {w}']['time_over_ByteLM']:.2f}x the time)" for w in ("auto", "eager"))
              + f"; transformers' loop alone {hf['transformers_loop_ms_per_token']:.3f} ms "
                f"a token")
    if onnx:
        print(f"greedy, {onnx['threads']} threads, bytes/s all rows: " + "; ".join(
            f"batch {B}: onnxruntime {onnx[B]['onnxruntime']:,.0f}, fused float32 decode "
            f"{onnx[B]['fused']:,.0f} ({onnx[B]['onnxruntime_over_fused']:.2f}x)"
            for B in onnx if isinstance(B, int)) + " (docs/onnx.md)")
    print(f"a step's draws at batch {draws['batch']}, each row its own settings and generator: "
          f"{draws['per_row_ms']:.3f} ms a row a call, {draws['one_call_ms']:.3f} ms in one call "
          f"(median; the same ids)")
    if cold:
        fb, byte = cold["forward_backward"], cold["first_byte"]
        print(f"cold start (a fresh process each, median of {args.cold_runs}; d_model 64 x 2): "
              f"import {fb['import_s']:.2f} s; first forward+backward {fb['first_s']:.2f} s "
              f"against {fb['warm_s']:.3f} s warm (+{fb['first_s'] - fb['warm_s']:.2f} s); "
              f"first streamed byte {1e3 * byte['first_s']:.0f} ms against "
              f"{1e3 * byte['warm_s']:.1f} ms warm; first call of the smallest cached kernel "
              f"{1e3 * cold['numba_floor']['first_s']:.0f} ms (numba's start)")
    print(args.out / "generation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
