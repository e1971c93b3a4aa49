"""A training step on a shared machine: ByteLM against the Transformer baseline, each timed on
an idle machine and beside a busy loop that holds one core, with the thread settings a user
can choose (issue: the first hour on a shared machine; results in docs/training.md).

    python -m bench.busy_core                       # both models, every setting (~4 minutes)
    python -m bench.busy_core --seconds 2 --quick   # a check that it runs

Each setting runs in a fresh process (``OMP_WAIT_POLICY`` is read when PyTorch's OpenMP
starts), timing whole training steps (forward, cross-entropy, backward, clipping, AdamW) on
the README's five-minute run's shapes: ``--hidden 128 --layers 2``, batch 32 x 128 bytes.
The busy loop is a second Python process spinning (``while True: pass``), started before
the worker and stopped after it. Prints one table and writes ``busy_core.json`` into
``--out`` (``bench-results/busy_core``, which git ignores; the record
``bench/results/busy_core`` with ``--record``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.cli import add_out, check_out, positive_float, positive_int

# (name, busy loop on the other core, torch threads, extra environment)
# (SCAN_THREADS=1: fastrwa's scans on the calling thread alone, PyTorch's ops on 2: what of
# the slowdown is the scans' own threads)
SETTINGS = (
    ("idle, 2 threads", False, 2, {}),
    ("idle, 1 thread", False, 1, {}),
    ("busy, 2 threads", True, 2, {}),
    ("idle, 2 threads, OMP_WAIT_POLICY=passive", False, 2, {"OMP_WAIT_POLICY": "passive"}),
    ("busy, 2 threads, OMP_WAIT_POLICY=passive", True, 2, {"OMP_WAIT_POLICY": "passive"}),
    ("busy, 2 threads, the scans on 1", True, 2, {"SCAN_THREADS": "1"}),
    ("busy, 1 thread", True, 1, {}),
)
MODELS = {"ByteLM (rda-scan)": "rda", "Transformer": "transformer"}

WORKER = r"""
import json, os, sys, time
import torch
import fastrwa.ops.numba_host
from fastrwa.models import LMConfig, build

if os.environ.get("SCAN_THREADS"):
    fastrwa.ops.numba_host.threads = lambda: int(os.environ["SCAN_THREADS"])

layer, threads, seconds, d_model, layers, batch, bptt = sys.argv[1:8]
torch.set_num_threads(int(threads))
torch.manual_seed(0)
model = build(LMConfig(layer=layer, d_model=int(d_model), n_layers=int(layers),
                       attention="sigmoid", context=int(bptt)))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
x = torch.randint(0, 256, (int(batch), int(bptt) + 1))

def step():
    logits, _ = model(x[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()

for _ in range(3):                       # compiles, allocator warm
    step()
times = []
start = time.perf_counter()
while time.perf_counter() - start < float(seconds) or len(times) < 3:
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
times.sort()
print(json.dumps(dict(params=sum(p.numel() for p in model.parameters()), steps=len(times),
                      median_s=times[len(times) // 2])))
"""


def measure(layer: str, busy: bool, threads: int, env: dict, args) -> dict:
    """One setting in a fresh process: the median step time and tokens/s."""
    spinner = (subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None)
    try:
        out = subprocess.run(
            [sys.executable, "-c", WORKER, layer, str(threads), str(args.seconds),
             str(args.hidden), str(args.layers), str(args.batch_size), str(args.bptt)],
            env={**os.environ, **env}, capture_output=True, text=True, check=True)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["tokens_per_s"] = args.batch_size * args.bptt / result["median_s"]
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2), ``--out`` settled."""
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=positive_float, default=8.0,
                   help="timed seconds per setting, after 3 warm-up steps (default 8)")
    p.add_argument("--hidden", type=positive_int, default=128)
    p.add_argument("--layers", type=positive_int, default=2)
    p.add_argument("--batch-size", type=positive_int, default=32)
    p.add_argument("--bptt", type=positive_int, default=128)
    p.add_argument("--quick", action="store_true", help="the idle and busy 2-thread settings")
    add_out(p, "busy_core", "busy_core.json")
    args = p.parse_args(argv)
    check_out(p, args, "busy_core", sizes=["seconds", "hidden", "layers", "batch_size", "bptt"])
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    out = args.out
    settings = SETTINGS[::2][:2] if args.quick else SETTINGS
    rows = []
    for model, layer in MODELS.items():
        for name, busy, threads, env in settings:
            if "SCAN_THREADS" in env and layer == "transformer":
                continue                      # (no scan)
            r = measure(layer, busy, threads, env, args)
            rows.append(dict(model=model, setting=name, busy=busy, threads=threads, env=env, **r))
            print(f"{model:18s} {name:42s} {r['median_s'] * 1e3:8.1f} ms/step "
                  f"{r['tokens_per_s']:9,.0f} tokens/s  ({r['steps']} steps, "
                  f"{r['params']:,} parameters)", flush=True)
    for model in MODELS:
        idle = next(r for r in rows if r["model"] == model and r["setting"] == settings[0][0])
        for r in rows:
            if r["model"] == model and r is not idle:
                r["slowdown_vs_idle_2_threads"] = r["median_s"] / idle["median_s"]
                print(f"{model:18s} {r['setting']:42s} {r['slowdown_vs_idle_2_threads']:5.2f}x "
                      f"the idle 2-thread step")
    (out / "busy_core.json").write_text(json.dumps(dict(
        argv=sys.argv[1:], quick=args.quick, when=time.strftime("%Y-%m-%d %H:%M"),
        cpus=os.cpu_count(), results=rows), indent=1))
    print(f"wrote {out / 'busy_core.json'}")


if __name__ == "__main__":
    main()
