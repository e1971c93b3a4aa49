"""GPU throughput of the Triton kernels, for users who have a CUDA GPU.

    python bench/gpu.py [--batch 16 --length 4096 --channels 256]

Times forward and forward+backward of rwa_scan and rda_scan with ``triton.testing.do_bench``
for both forward algorithms, float32 and bfloat16, and reports achieved bandwidth (the
minimum bytes of docs/math.md over time) in GB/s and as a share of the device's peak
(from its memory clock and bus width), beside ``copy_`` of the same bytes.

Never run on this project's machines (they have no GPU): no number from it is quoted in
docs/ until someone measures one on a GPU.
"""

from __future__ import annotations

import argparse
import sys

import torch


def peak_bandwidth_gbs(device: torch.device) -> float | None:
    """Theoretical DRAM bandwidth from the memory clock and bus width, if the driver reports them."""
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9   # double data rate


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--channels", type=int, default=256)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu.py needs a CUDA GPU; none is visible here.")
        return 0
    import triton.testing

    import fastrwa
    from fastrwa.ops.backends.triton import host as triton_backend

    dev = torch.device("cuda")
    B, T, D = args.batch, args.length, args.channels
    peak = peak_bandwidth_gbs(dev)
    print(f"{torch.cuda.get_device_name(dev)}, B={B} T={T} D={D}, "
          f"peak {'unknown' if peak is None else f'{peak:.0f} GB/s'}")
    print(f"{'op':<10}{'algorithm':<13}{'dtype':<10}{'pass':<9}{'ms':>8}{'GB/s':>8}"
          f"{'% peak':>8}{'copy GB/s':>11}")
    for dtype in (torch.float32, torch.bfloat16):
        z, a, g, gy = (torch.randn(B, T, D, device=dev, dtype=dtype) for _ in range(4))
        for op in ("rwa_scan", "rda_scan"):
            n_in = 2 if op == "rwa_scan" else 3
            inputs = [x.clone().requires_grad_() for x in (z, a, g)[:n_in]]
            fn = getattr(fastrwa, op)
            for algorithm in ("looped", "three_phase"):
                triton_backend.set_options(algorithm=algorithm)
                with fastrwa.use_backend("triton"):
                    def fwd():
                        with torch.no_grad():
                            fn(*inputs)

                    def fwd_bwd():
                        y, _ = fn(*inputs)
                        torch.autograd.grad(y, inputs, gy)

                    for name, run, n_tensors in (("fwd", fwd, n_in + 1),
                                                 ("fwd+bwd", fwd_bwd, 3 * n_in + 2)):
                        nbytes = n_tensors * z.numel() * z.element_size()
                        ms = triton.testing.do_bench(run)
                        src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
                        dst = torch.empty_like(src)
                        copy_ms = triton.testing.do_bench(lambda: dst.copy_(src))
                        gbs = nbytes / ms / 1e6
                        share = "" if peak is None else f"{100 * gbs / peak:.0f}%"
                        print(f"{op:<10}{algorithm:<13}{str(dtype)[6:]:<10}{name:<9}{ms:>8.3f}"
                              f"{gbs:>8.0f}{share:>8}{nbytes / copy_ms / 1e6:>11.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
