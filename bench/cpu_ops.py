"""The CPU run's sections (``python -m bench.ops --device cpu``, bench/ops.py): each takes the
run's config and returns JSON-able rows."""

from __future__ import annotations

import statistics

import torch

import fastrwa
from bench.common import (DTYPES, OPS, forward_backward_fn, forward_fn, inputs,
                          interleaved, median_seconds, min_bytes, seconds)
from bench.cli import save_figure
from fastrwa.testing import NewStorageCounter, backend_options, storages
from fastrwa.models import ByteLM, LMConfig

NAMES = ["throughput", "triton_interpreter", "rnn", "scaling", "streaming"]


def _table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n## {title}")
    widths = [max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(r, widths)))


def throughput(cfg: dict) -> list[dict]:
    B, D = cfg["B"], cfg["D"]
    rows = []
    for path in cfg["paths"]:
        T = cfg["T_reference"] if path == "reference" else cfg["T"]
        repeats = cfg["repeats"] if path in ("numba", "triton") else min(3, cfg["repeats"])
        for op_name in cfg["ops"]:
            op = OPS[op_name]
            for dt_name in cfg["dtypes"]:
                dtype = DTYPES[dt_name]
                z, a, g = inputs(op, B, T, D, dtype)
                if path == "triton":
                    z, a, g = (None if x is None else x.cuda() for x in (z, a, g))
                size = z.element_size()
                for pass_name, make, backward in (("fwd", forward_fn, False),
                                                  ("fwd+bwd", forward_backward_fn, True)):
                    fn = make(op, z, a, g, path)
                    if path == "triton":
                        fn = _synchronized(fn)
                    nbytes = min_bytes(op, B * T * D, size, backward)
                    t_op, t_copy, ratio = interleaved(fn, nbytes, dtype, repeats)
                    rows.append(dict(path=path, op=op_name, dtype=dt_name, pass_=pass_name,
                                     shape=[B, T, D], seconds=t_op,
                                     elements_per_s=B * T * D / t_op, gbps=nbytes / t_op / 1e9,
                                     copy_gbps=nbytes / t_copy / 1e9, ratio=ratio))
    _table("throughput: minimum bytes / time, as a fraction of copy_ of the same bytes "
           "(median of paired ratios)",
           ["path", "op", "dtype", "pass", "B,T,D", "M elem/s", "GB/s", "copy GB/s", "ratio"],
           [[r["path"], r["op"], r["dtype"], r["pass_"], ",".join(map(str, r["shape"])),
             f"{r['elements_per_s'] / 1e6:.1f}", f"{r['gbps']:.2f}", f"{r['copy_gbps']:.1f}",
             f"{r['ratio']:.3f}"] for r in rows])
    return rows


def _synchronized(fn):
    def run():
        fn()
        torch.cuda.synchronize()
    return run


def triton_interpreter(cfg: dict) -> list[dict]:
    """Max |error| of the Triton kernels (forward and gradients) against the reference.
    Interpreted (on the CPU), the channel blocks are the inputs' 8 channels, not the
    default 32: the interpreter runs every lane of a block, each scan element by element,
    so the default blocks would run 4 times the lanes for the same 8 channels."""
    rows = []
    device = "cuda" if torch.cuda.is_available() else "cpu"
    blocks = {} if device == "cuda" else dict(block_d=8, block_d_backward=8)
    for op_name in cfg["ops"]:
        op = OPS[op_name]
        z, a, g = inputs(op, 2, 37, 8, torch.float64)
        leaves = [x.clone().requires_grad_() for x in (z, a, g) if x is not None]
        y_ref = op.reference(*leaves, *([None] * (3 - len(leaves))))
        grads_ref = torch.autograd.grad(y_ref.sum(), leaves)
        fast = [x.detach().float().to(device).requires_grad_() for x in leaves]
        with fastrwa.use_backend("triton"), backend_options("triton", **blocks):
            y = op.run(*fast, *([None] * (3 - len(fast))))
            grads = torch.autograd.grad(y.sum(), fast)
        rows.append(dict(op=op_name, device=device,
                         y_error=(y.double().cpu() - y_ref).abs().max().item(),
                         grad_error=max((gr.double().cpu() - gw).abs().max().item()
                                        for gr, gw in zip(grads, grads_ref))))
    _table("triton kernels " + ("on the GPU" if device == "cuda" else
                                "under TRITON_INTERPRET=1 (correctness only, not speed)"),
           ["op", "max |y - reference|", "max |grad - reference|"],
           [[r["op"], f"{r['y_error']:.1e}", f"{r['grad_error']:.1e}"] for r in rows])
    return rows


def rnn(cfg: dict) -> list[dict]:
    """Forward+backward tokens/s of an RDA scan layer beside LSTM and GRU, same sizes."""
    B, T, H = cfg["rnn"]["B"], cfg["rnn"]["T"], cfg["rnn"]["H"]
    torch.manual_seed(0)
    x = torch.randn(B, T, H)
    models = {"fastrwa.nn.RDA (numba)": ("numba", fastrwa.nn.RDA(H, H)),
              "fastrwa.nn.RDA (torch)": ("torch", fastrwa.nn.RDA(H, H)),
              "torch.nn.LSTM": (None, torch.nn.LSTM(H, H, batch_first=True)),
              "torch.nn.GRU": (None, torch.nn.GRU(H, H, batch_first=True))}
    rows = []
    for name, (backend, model) in models.items():
        def step(model=model, backend=backend):
            with (fastrwa.use_backend(backend) if backend else torch.enable_grad()):
                out = model(x)[0]
                out.backward(torch.ones_like(out))
        t = median_seconds(step, max(2, cfg["repeats"] // 2))
        rows.append(dict(model=name, shape=[B, T, H], seconds=t, tokens_per_s=B * T / t))
    lstm = next(r["tokens_per_s"] for r in rows if r["model"] == "torch.nn.LSTM")
    for r in rows:
        r["vs_lstm"] = r["tokens_per_s"] / lstm
    _table(f"rnn layers, forward+backward, B={B} T={T} hidden={H}",
           ["layer", "tokens/s", "x LSTM"],
           [[r["model"], f"{r['tokens_per_s']:.0f}", f"{r['vs_lstm']:.2f}"] for r in rows])
    return rows


def scaling(cfg: dict) -> list[dict]:
    """ns per token of rda_scan (exp) forward, B=1, D=256, T from 1K up, per path: the best
    of several rounds, each round timing every T once (each T about 16M elements of work), so
    that the machine's slow spells fall on all lengths alike. The question is whether the
    cost per token grows with T."""
    D, rows = 256, []
    limits = dict(reference=cfg["reference_max_T"], torch=cfg["torch_max_T"])
    op = OPS["rda-exp"]
    for path in cfg["paths"]:
        lengths = [T for T in cfg["lengths"] if T <= limits.get(path, T)]
        fns = {}
        for T in lengths:
            z, a, g = inputs(op, 1, T, D, torch.float32)
            if path == "triton":
                z, a, g = z.cuda(), a.cuda(), g.cuda()
            fn = forward_fn(op, z, a, g, path)
            fns[T] = fn if path != "triton" else _synchronized(fn)
            for _ in range(3):
                fns[T]()
        best = {T: float("inf") for T in lengths}
        for _ in range(cfg.get("scaling_rounds", 5)):
            for T in lengths:
                calls = max(1, min(16, (1 << 24) // (T * D)))
                best[T] = min(best[T], min(seconds(fns[T]) for _ in range(calls)))
        for T in lengths:
            rows.append(dict(path=path, T=T, D=D, seconds=best[T],
                             ns_per_token=best[T] / T * 1e9, tokens_per_s=T / best[T]))
        del fns
    summary = []
    for path in cfg["paths"]:
        per = [r["ns_per_token"] for r in rows if r["path"] == path]
        if per:
            summary.append([path, " ".join(f"{v:.0f}" for v in per),
                            f"{max(per) / min(per):.2f}"])
    _table("scaling: rda_scan forward, B=1, D=256, best-of-runs ns per token at T = "
           + ", ".join(str(T) for T in cfg["lengths"]), ["path", "ns/token", "worst/best"],
           summary)
    return rows


def _allocations(fn, steps: int, known: set[int]) -> float:
    """New tensor storages per call of ``fn`` (``known``: those existing before)."""
    with NewStorageCounter(known) as counter:
        for _ in range(steps):
            fn()
    return len(counter.new) / steps


def streaming(cfg: dict) -> dict:
    """Single-token latency and allocations of ByteLM.step_ (in place) and .step (functional)."""
    torch.manual_seed(0)
    model = ByteLM(LMConfig(**cfg["lm"])).eval()
    prompt = torch.randint(0, 256, (1, 16))
    cache = model.allocate_cache(1)
    token = torch.tensor([65])
    rows = {}
    with torch.no_grad():
        model.prefill(prompt, cache)
        state = cache.state
        calls = {"ByteLM.step_ (in place)": lambda: model.step_(token, cache),
                 "ByteLM.step (functional)": lambda: model.step(token, state)}
        for name, fn in calls.items():
            fn()
            latency = statistics.median(seconds(fn) for _ in range(max(20, cfg["repeats"] * 10)))
            known = storages(list(model.parameters()), cache.scan, cache.work, token, state)
            rows[name] = dict(latency_us=latency * 1e6,
                              allocations_per_step=_allocations(fn, 5, known))
        z = torch.randn(1, cfg["lm"]["d_model"])
        st, out = fastrwa.ScanState.empty(1, z.shape[1]), torch.empty_like(z)
        op = lambda: fastrwa.rda_step_(z, z, z, st, out)    # noqa: E731
        op()
        rows["fastrwa.rda_step_ (one layer's scan)"] = dict(
            latency_us=statistics.median(seconds(op) for _ in range(200)) * 1e6,
            allocations_per_step=_allocations(op, 5, storages(z, st, out)))
    result = dict(config=cfg["lm"], steps=rows,
                  state_bytes_per_layer=cache.nbytes // cfg["lm"]["n_layers"])
    _table(f"streaming: ByteLM d_model={cfg['lm']['d_model']} n_layers={cfg['lm']['n_layers']}, "
           f"batch 1; state {result['state_bytes_per_layer']} bytes per layer, any length",
           ["call", "latency (us)", "allocations/step"],
           [[k, f"{v['latency_us']:.1f}", f"{v['allocations_per_step']:.0f}"]
            for k, v in rows.items()])
    return result


def plot_scaling(rows: list[dict], path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in dict.fromkeys(r["path"] for r in rows):
        mine = [r for r in rows if r["path"] == name]
        ax.plot([r["T"] for r in mine], [r["tokens_per_s"] for r in mine], marker="o", label=name)
    ax.set(xscale="log", yscale="log", xlabel="sequence length T (B=1, D=256)",
           ylabel="tokens / s (rda_scan forward)", title="fastrwa throughput vs length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
