"""Generation speed of the byte LM at batch 1: ``python bench/generation.py``.

Streams ``--bytes`` bytes from a ``ByteLM`` (d_model 256, 4 blocks by default: the size of
docs/lm.md) as ``python -m fastrwa.generate`` does (``ByteLM.stream``: prefill, then one
in-place ``step_`` and one ``sample`` per byte) and reports, in one run:

* the steady rate in bytes/s (after the first byte) and the resident memory before and after
  (flat: the state is fixed-size);
* the time of one ``step_`` and of one ``sample``;
* what bounds the step: the same matrix-vector products alone (``addmm`` on the model's
  weights, batch 1), the in-place scan steps alone (``fastrwa.rda_step_``, as the layers
  call it), and the rest (the elementwise ops and norms between them, and Python).

Speed does not depend on the weights' values, so the model is freshly initialised (a trained
run's ``model/`` export streams at the same rate). Prints a table and writes
``OUT/generation.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fastrwa  # noqa: E402
from fastrwa.models import ByteLM, LMConfig  # noqa: E402
from fastrwa.models.sampling import sample  # noqa: E402


def rss_mb() -> float:
    """Resident memory of this process in MB (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def per_call_us(fn, repeats: int) -> float:
    """Median over 5 rounds of the mean time of ``repeats`` calls, in microseconds."""
    rounds = []
    for _ in range(5):
        began = time.perf_counter()
        for _ in range(repeats):
            fn()
        rounds.append((time.perf_counter() - began) / repeats * 1e6)
    return statistics.median(rounds)


def matvecs(model: ByteLM):
    """A function running the model's matrix-vector products of one token, alone."""
    x = torch.randn(1, model.config.d_model)
    calls = []
    for block in model.blocks:
        for linear in (block.mix.proj, *([block.gate] if block.gate is not None else []),
                       block.mlp[0], block.mlp[2]):
            inp = torch.randn(1, linear.in_features)
            out = torch.empty(1, linear.out_features)
            calls.append((linear.bias, inp, linear.weight.t(), out))
    head = (model.head.weight.t(), torch.empty(1, model.head.out_features))

    def run():
        for bias, inp, weight, out in calls:
            torch.addmm(bias, inp, weight, out=out)
        torch.mm(x, head[0], out=head[1])
    return run, len(calls) + 1


def measure(model: ByteLM, config: LMConfig, n_bytes: int, repeats: int) -> dict:
    """The stream's steady rate and memory, and the parts of one step (see the module doc)."""
    prompt = torch.tensor(list(b"The "))
    gen = torch.Generator().manual_seed(0)
    for _ in model.stream(prompt, 20, generator=gen):      # warm-up (kernels load)
        pass
    before = rss_mb()
    first, count = None, 0
    for _ in model.stream(prompt, n_bytes, generator=gen):
        count += 1
        first = first or time.perf_counter()
    steady = (count - 1) / (time.perf_counter() - first)
    after = rss_mb()
    cache = model.allocate_cache(1)
    token = torch.tensor([65])
    with torch.no_grad():
        model.prefill(prompt[None], cache)
        step_us = per_call_us(lambda: model.step_(token, cache), repeats)
        logits = model.step_(token, cache).clone()
        sample_us = per_call_us(lambda: sample(logits, 1.0, None, None, gen, 256), repeats)
        run, n_matvec = matvecs(model)
        matvec_us = per_call_us(run, repeats)
        z, a, g, y = (torch.randn(1, config.d_model) for _ in range(4))
        state = fastrwa.ScanState.empty(1, config.d_model)
        scan_step = ((lambda: fastrwa.rwa_step_(z, a, state, y)) if config.layer == "rwa" else
                     (lambda: fastrwa.rda_step_(z, a, g, state, y, config.attention)))
        scan_us = per_call_us(scan_step, repeats) * config.n_layers
    return dict(bytes=count, steady_bytes_per_s=steady, rss_mb_before=before,
                rss_mb_after=after, step_us=step_us, sample_us=sample_us, matvec_us=matvec_us,
                matvecs=n_matvec, scan_step_us=scan_us,
                other_us=step_us - matvec_us - scan_us, matvec_bound_bytes_per_s=1e6 / matvec_us)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--bytes", type=int, default=2000)
    p.add_argument("--threads", default=f"1,{torch.get_num_threads()}",
                   help="torch thread counts to measure, comma-separated")
    p.add_argument("--lm", action="append", default=[], metavar="KEY=VALUE",
                   help="LMConfig fields (as the trainer's --lm)")
    p.add_argument("--out", type=pathlib.Path,
                   default=pathlib.Path(__file__).parent / "results" / "generation")
    p.add_argument("--quick", action="store_true", help="a tiny model, a few bytes (CI)")
    args = p.parse_args(argv)
    if args.quick:
        args.d_model, args.layers, args.bytes = 32, 2, 50
    from fastrwa.train.config import parse_lm_field
    config = LMConfig(d_model=args.d_model, n_layers=args.layers,
                      **dict(parse_lm_field(item) for item in args.lm))
    torch.manual_seed(0)
    model = ByteLM(config).eval()
    params = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    threads = list(dict.fromkeys(int(t) for t in args.threads.split(",")))
    runs = {}
    for n in threads:
        torch.set_num_threads(n)
        runs[n] = measure(model, config, args.bytes, 20 if args.quick else 300)
    result = dict(config=config.to_dict(), params=params, torch=torch.__version__,
                  cpu_count=os.cpu_count(), by_threads=runs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "generation.json").write_text(json.dumps(result, indent=1))
    print(f"ByteLM d_model {args.d_model} x {args.layers} blocks ({params:,} parameters), "
          f"batch 1; one column per torch.set_num_threads")
    rows = [("stream (as python -m fastrwa.generate), bytes/s", "steady_bytes_per_s", ",.0f"),
            ("resident memory before -> after, MB", "rss", ""),
            ("ByteLM.step_ (one byte), us", "step_us", ",.0f"),
            ("sample (one byte), us", "sample_us", ",.0f"),
            ("  matrix-vector products alone, us", "matvec_us", ",.0f"),
            ("  scan steps alone (rda_step_), us", "scan_step_us", ",.0f"),
            ("  the rest of step_ (norms, gates, copies, Python), us", "other_us", ",.0f"),
            ("bytes/s the matrix-vector products alone would allow", "matvec_bound_bytes_per_s",
             ",.0f")]
    width = max(len(r[0]) for r in rows)
    print(f"{'':<{width}}  " + "  ".join(f"{f'{n} thread(s)':>14}" for n in runs))
    for name, key, fmt in rows:
        cells = [f"{r['rss_mb_before']:.0f} -> {r['rss_mb_after']:.0f}" if key == "rss"
                 else format(r[key], fmt) for r in runs.values()]
        print(f"{name:<{width}}  " + "  ".join(f"{c:>14}" for c in cells))
    print(args.out / "generation.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
