"""Layer- and model-level GPU measurements: ``fastrwa.nn.RDA`` against cuDNN LSTM and GRU, and
ByteLM's streaming step (eager, and replayed from a CUDA graph).

Layers: hidden 1024, B=16, T=4096, float32 and bfloat16 autocast; forward+backward tokens/s
(``B * T`` over the median time of ``do_bench``). Streaming: ms per generated token with
``ByteLM.step_`` at batch 1 and 64 (the default LMConfig), eager with the id check, and a
CUDA graph of the unchecked step replayed per token (tests/test_cuda.py checks that a replay
equals the eager step).
"""

from __future__ import annotations

import torch

import fastrwa
from fastrwa.models import ByteLM, LMConfig
from bench.gpu_ops import bench_ms
from bench.gpu_report import row

LAYER_SHAPE = (16, 4096, 1024)


def _layer(name: str, hidden: int) -> torch.nn.Module:
    if name == "nn.RDA":
        return fastrwa.nn.RDA(hidden, hidden)
    cls = torch.nn.LSTM if name == "nn.LSTM (cuDNN)" else torch.nn.GRU
    return cls(hidden, hidden, batch_first=True)


def layer_rows(log, shape=LAYER_SHAPE) -> tuple[list[dict], float | None]:
    """Rows for RDA, LSTM and GRU, and RDA's forward+backward tokens/s over LSTM's (float32)."""
    B, T, H = shape
    rows, tokens = [], {}
    for autocast in (None, torch.bfloat16):
        dtype_name = "float32" if autocast is None else "bfloat16-autocast"
        for name in ("nn.RDA", "nn.LSTM (cuDNN)", "nn.GRU (cuDNN)"):
            torch.manual_seed(0)
            layer = _layer(name, H).cuda()
            x = torch.randn(B, T, H, device="cuda", requires_grad=True)
            gy = torch.randn(B, T, H, device="cuda")
            def cast():
                return torch.autocast("cuda", dtype=autocast, enabled=autocast is not None)

            def fwd_bwd():
                with cast():
                    out = layer(x)[0]
                out.backward(gy.to(out.dtype))

            def fwd():
                with torch.no_grad(), cast():
                    layer(x)
            for pass_, fn in (("fwd", fwd), ("fwd+bwd", fwd_bwd)):
                try:
                    ms = bench_ms(fn)
                except Exception as e:  # noqa: BLE001 (e.g. no bf16 kernel for an RNN)
                    log(dict(layer=name, dtype=dtype_name, pass_=pass_,
                             error=f"{type(e).__name__}: {str(e)[:200]}"))
                    continue
                tokens[(name, dtype_name, pass_)] = B * T / (ms / 1e3)
                rows.append(row("layer", name, dtype_name, shape, None, pass_, ms,
                                tokens_per_s=tokens[(name, dtype_name, pass_)]))
                log(rows[-1])
            del layer, x, gy
            torch.cuda.empty_cache()
    rda, lstm = (tokens.get((n, "float32", "fwd+bwd")) for n in ("nn.RDA", "nn.LSTM (cuDNN)"))
    return rows, (rda / lstm if rda and lstm else None)


def streaming(log, config: LMConfig | None = None, batches=(1, 64)) -> list:
    """ms per token of ByteLM.step_, eager and from a CUDA graph, per batch size."""
    config = config or LMConfig()
    torch.manual_seed(0)
    model = ByteLM(config).cuda().eval()
    out = []
    for batch in batches:
        cache = model.allocate_cache(batch)
        token = torch.randint(0, 256, (batch,), device="cuda")
        with torch.no_grad():
            model.prefill(torch.randint(0, 256, (batch, 16), device="cuda"), cache)
            eager = bench_ms(lambda: model.step_(token, cache))
            graph_ms, why = None, ""
            try:
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(3):                   # warm-up on a side stream
                        model.step_(token, cache, check=False)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    model.step_(token, cache, check=False)
                graph_ms = bench_ms(graph.replay)
            except Exception as e:  # noqa: BLE001 (reported: the eager number still stands)
                why = f"{type(e).__name__}: {str(e)[:200]}"
        out.append(dict(batch=batch, d_model=config.d_model, n_layers=config.n_layers,
                        eager_ms_per_token=eager, graph_ms_per_token=graph_ms,
                        graph_error=why, tokens_per_s=batch / ((graph_ms or eager) / 1e3)))
        log(out[-1])
    return out
