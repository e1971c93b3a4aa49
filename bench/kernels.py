"""Compile every Triton kernel ahead of time for sm_80 and sm_90a, without a GPU, and report
its static cost: SASS instructions per element in the chunk loop, MUFU ops (EX2, LG2, RCP, RSQ)
per element, barriers, shuffles and shared-memory operations per chunk, registers, spills,
stack, local and shared memory; "use": how many instructions after a global load in the chunk
loop its value is first read, at the least (bench/sass.py ``load_use``: what a loop leaves a
load to arrive while the warp issues other work; a load used in the next iteration counts the
rest of this one).

    python -m bench.kernels            # the full table: every kernel x constexpr variant x arch x dtype
    python -m bench.kernels --quick    # the one-pass forward and backward of rda-exp, float32,
                                       # sm_90a (what the test suite runs)
    python -m bench.kernels --option block_t=4 --option block_d=4 --option block_d_backward=4
                                       # the blocks of the op tests' Triton columns

Exits 1 on any compile failure or spill. Instruction counts come from ``cuobjdump -sass``
(bench/sass.py: the outermost loop's body, or the whole kernel without a loop, over the
``BT x BD`` elements it covers, in thread instructions; for the carry kernels, over the ``BD``
channels of one segment summary); registers and memory from
``cuobjdump -res-usage`` on Triton's cubin; spill bytes from ``ptxas -v`` (the ptxas Triton
uses for that arch) on Triton's PTX. "shared" is static + the dynamic shared memory Triton
launches with. Launch shapes (BT, BD, warps, stages) are the launcher's defaults in
fastrwa/ops/triton_host.py unless ``--option`` sets them; ``D`` (a compile-time constant of
every kernel) is ``--channels``, 1024 by default. Arguments are specialised as a launch at
B=16, T=4096, D=1024 specialises them (``LAUNCH_ATTRS``: every pointer 16-byte aligned).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)        # compile for real, not for the interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

from bench import sass  # noqa: E402
from bench.cli import (below_defaults, check_record, make_dir, out_file,  # noqa: E402
                 positive_int, results_dir)

ARCHS = {"sm_80": 80, "sm_90a": 90}
DTYPES = {"float32": "fp32", "bfloat16": "bf16"}
# (label, ATTN, DISCOUNT) actually used: RWA, weighted_scan with log decay, RDA per attention.
MATH = [("rwa", 0, 0), ("weighted", 0, 1), ("rda-exp", 0, 2), ("rda-sigmoid", 1, 2),
        ("rda-softplus", 2, 2), ("rda-relu", 3, 2)]
FLAGS = dict(HAS_INIT=True, STORE_FINAL=True, SAVE_CHUNKS=True, HAS_FINAL_GRAD=True,
             IS_VARLEN=False, REVERSE=False)
# The heaviest math variant is also compiled reversed and packed (varlen).
EXTRA_FLAGS = [("rda-softplus,reverse", 2, 2, dict(REVERSE=True)),
               ("rda-softplus,varlen", 2, 2, dict(IS_VARLEN=True))]
IO_POINTERS = {"z_ptr", "a_ptr", "g_ptr", "y_ptr", "gy_ptr", "gz_ptr", "ga_ptr", "gg_ptr"}
INDEX_POINTERS = {"cu_ptr", "co_ptr", "cs_ptr"}
FLAG_POINTERS = {"f_ptr"}              # the chained kernels' flags and ticket (int32)
# What a launch at B=16, T=4096, D=1024 tells the compiler about its arguments. Triton's
# runtime specialises an argument that is a multiple of 16 (a pointer: in bytes; PyTorch's
# allocations are) and turns an integer equal to 1 into a constant; the layout it picks for
# a block's loads depends on it, so a build without it is not the kernel that runs. Every
# pointer, and the sizes T, NS and NCT (4096, 16, 4096 there), get the divisibility; the
# looped algorithm's one-pass launches pass CPS = 1; CPS and NSEG of the segments algorithm
# (52 and 80 on 132 SMs) and the step kernel's B get nothing.
LAUNCH_ATTRS = [["tt.divisibility", 16]]
DIVISIBLE_INTS = {"T", "NS", "NCT"}


def _kernels(opts=None):
    """``(name, kernel, (warps, maxnreg), constexprs)`` of every build: the scan kernels once
    per phase (``fwd[one_pass]`` is the "looped" algorithm's forward; ``summary``, the carry
    kernel and ``output`` are the "segments" algorithm's; ``fwd[chained]`` and
    ``bwd[chained]`` the "chained" algorithm's one launch a pass)."""
    from fastrwa.kernels import codes
    from fastrwa.kernels.triton import scan_bwd, scan_chained, scan_fwd, step
    from fastrwa.ops import triton_host as tb

    opts = opts or tb.Options()
    fwd = ((opts.warps, tb.MAX_REGISTERS), dict(BT=opts.forward().block_t, BD=opts.block_d,
                                                LOOKAHEAD=opts.forward_lookahead,
                                                SAVE_BT=opts.block_t))
    bwd = ((opts.warps_backward, tb.MAX_REGISTERS),
           dict(BT=opts.block_t, BD=opts.block_d_backward))
    phases = {"one_pass": codes.ONE_PASS, "summary": codes.SUMMARY, "output": codes.OUTPUT}
    out = []
    for kernel, (launch, blocks) in ((scan_fwd.fwd_kernel, fwd), (scan_bwd.bwd_kernel, bwd)):
        short = kernel.__name__.removesuffix("_kernel")
        for phase, code in phases.items():
            out.append((f"{short}[{phase}]", kernel, launch, dict(blocks, PHASE=code)))
    out += [("fwd_carry", scan_fwd.fwd_carry_kernel, *fwd), ("bwd_carry", scan_bwd.bwd_carry_kernel,
                                                              *bwd), ("step", step.step_kernel, *fwd)]
    out.append(("fwd[chained]", scan_chained.fwd_chained_kernel, fwd[0],
                dict(fwd[1], WINDOW=opts.lookback_window, PREFIX_EVERY=True,
                     SPIN=True, PERSISTENT=opts.chained_programs_per_sm > 0)))
    out.append(("bwd[chained]", scan_chained.bwd_chained_kernel, bwd[0],
                dict(bwd[1], WINDOW=opts.lookback_window, PREFIX_EVERY=True,
                     SPIN=True, PERSISTENT=opts.chained_programs_per_sm_backward > 0)))
    return out


def jobs(quick: bool, opts=None, channels: int = 1024):
    """Every (kernel, variant, arch, dtype) to compile; kernels without a constexpr skip it."""
    from fastrwa.ops import triton_host as tb

    out, seen = [], set()
    opts = opts or _default_options()
    stages = opts.stages
    for name, fn, (warps, maxnreg), blocks in _kernels(opts):
        variants = [(label, attn, disc, {}) for label, attn, disc in MATH] + EXTRA_FLAGS
        for label, attn, disc, extra in variants:
            # (the backward's LOOKAHEAD depends on the math; the forward's is a knob)
            const = dict(FLAGS, ATTN=attn, DISCOUNT=disc, D=channels, KT=opts.carry_tile,
                         LOOKAHEAD=tb.backward_lookahead(attn, opts), **extra)
            const.update(blocks)
            const = {k: v for k, v in const.items() if k in fn.arg_names}
            key = (name, tuple(sorted(const.items())))
            if key in seen:           # e.g. the carry kernels do not depend on ATTN
                continue
            seen.add(key)
            for arch in ARCHS:
                for dtype in DTYPES:
                    out.append((name, label, const, (warps, stages, maxnreg), arch, dtype))
    if quick:
        return [j for j in out if j[0] in ("fwd[one_pass]", "bwd[one_pass]")
                and j[1] == "rda-exp" and j[4] == "sm_90a" and j[5] == "float32"]
    return out


def _default_options():
    from fastrwa.ops import triton_host as tb
    return tb.Options()


def _find(name: str):
    for build, fn, _, _ in _kernels():
        if build == name:
            return fn
    raise KeyError(name)


def compile_one(job):
    """Compile one job; return its table row (a dict) or raise."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from fastrwa.kernels.codes import ONE_PASS

    name, label, const, (warps, stages, maxnreg), arch, dtype = job
    fn = _find(name)
    if const.get("PHASE") == ONE_PASS and "CPS" in fn.arg_names:
        const = dict(const, CPS=1)          # the looped launch's literal 1: a constant
    signature, attrs = {}, {}
    for index, arg in enumerate(fn.arg_names):
        if arg in const:
            signature[arg] = "constexpr"
        elif arg in IO_POINTERS:
            signature[arg] = "*" + DTYPES[dtype]
        elif arg in INDEX_POINTERS:
            signature[arg] = "*i64"
        elif arg in FLAG_POINTERS:
            signature[arg] = "*i32"
        elif arg.endswith("_ptr"):
            signature[arg] = "*fp32"
        else:
            signature[arg] = "i32"
        if signature[arg].startswith("*") or arg in DIVISIBLE_INTS:
            attrs[(index,)] = LAUNCH_ATTRS
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs),
                            target=GPUTarget("cuda", ARCHS[arch], 32),
                            options={"num_warps": warps, "num_stages": stages,
                                     "maxnreg": maxnreg})
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
        usage = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-res-usage", cubin],
                               capture_output=True, text=True, check=True).stdout
        listing = subprocess.run([os.path.join(bin_dir, "cuobjdump"), "-sass", cubin],
                                 capture_output=True, text=True, check=True).stdout
        ptxas = get_ptxas(ARCHS[arch]).path
        log = subprocess.run([ptxas, f"-arch={arch}", "-v", ptx, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    field = lambda key: int(re.search(rf"\b{key}:(\d+)", usage).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    blocks = f"{const.get('BT', 1)}x{const['BD']}"
    # a carry kernel's loop walks one segment summary a channel per iteration
    per_iteration = const["BD"] if name.endswith("_carry") else const.get("BT", 1) * const["BD"]
    # (the chained kernels: their second walk, the output loop, as the others report)
    cost = sass.costs(listing, per_iteration, 32 * warps, last=name.endswith("[chained]"))
    return dict(kernel=name, variant=label, arch=arch, dtype=dtype, warps=warps, blocks=blocks,
                regs=field("REG"), spill=spill, stack=field("STACK"), local=field("LOCAL"),
                shared=field("SHARED") + kernel.metadata.shared, **cost)


def knob(text: str) -> tuple[str, int]:
    """A ``type=`` for ``--option``: ``KNOB=INT`` -> ``(knob, value)``."""
    key, sep, value = text.partition("=")
    try:
        if not (key and sep):
            raise ValueError
        return key, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be KNOB=INT, got {text!r}") from None


def options_from(items: list[tuple[str, int]]):
    """``[("block_t", 4), ...]`` -> the backend's Options with those knobs; ``ValueError``
    for a knob it does not have or a value it refuses."""
    import dataclasses

    from fastrwa.ops import triton_host as tb
    knobs = dict(items)
    for key in knobs:
        if key not in {f.name for f in dataclasses.fields(tb.Options)} or key == "algorithm":
            raise ValueError(f"--option {key}: not a launch knob of the Triton backend")
    opts = dataclasses.replace(tb.Options(), **knobs)
    try:
        tb._check(opts)
    except ValueError as exc:
        raise ValueError(f"--option: {exc}") from None
    return opts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The flags, every bad value refused (one ``error:`` line, exit 2) before any compile;
    ``args.opts`` (the launch knobs) made, ``--json``'s file settled."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="compile the one-pass forward and backward of rda-exp only")
    p.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1)
    p.add_argument("--channels", type=positive_int, default=1024, metavar="D",
                   help="D, a compile-time constant of the kernels (default 1024)")
    p.add_argument("--json", type=out_file, metavar="FILE",
                   help="also write the rows to FILE as JSON (bench/results/kernels.json, the "
                        "committed table, only with --record, and --record's default)")
    p.add_argument("--record", action="store_true",
                   help="write the committed table, bench/results/kernels.json (or --json "
                        "under bench/results/); refused for --quick, a smaller D, --option")
    p.add_argument("--option", action="append", type=knob, default=[], metavar="KNOB=INT",
                   help="a launch knob of the Triton backend's Options instead of its default, "
                        "e.g. --option block_t=4 (repeatable)")
    args = p.parse_args(argv)
    try:
        args.opts = options_from(args.option)
    except ValueError as exc:
        p.error(str(exc))
    if args.record and args.json is None:
        args.json = results_dir("kernels.json")
    if args.json is not None:
        small = ["--quick"] * args.quick + below_defaults(p, args, ["channels"]) + \
            ["--option"] * bool(args.option)
        check_record(p, "--json", args.json, args.record, small)
        make_dir(p, "--json's folder", args.json.parent)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    todo = jobs(args.quick, args.opts, args.channels)
    header = f"{'kernel':<20}{'variant':<22}{'arch':<8}{'dtype':<10}{'warps':>6}{'BTxBD':>7}" \
             f"{'instr/el':>9}{'EX2':>6}{'LG2':>6}{'RCP':>6}{'RSQ':>6}{'BAR':>5}{'SHFL':>5}{'LDS+STS':>8}" \
             f"{'use':>5}{'regs':>6}{'spill B':>9}{'stack':>7}{'local':>7}{'shared B':>10}"
    print(header)
    failures, rows = 0, []
    with concurrent.futures.ProcessPoolExecutor(max_workers=args.workers) as pool:
        futures = {pool.submit(compile_one, job): job for job in todo}
        for future in concurrent.futures.as_completed(futures):
            job = futures[future]
            try:
                r = future.result()
            except Exception as exc:  # a compile failure is a result to report, then fail
                failures += 1
                print(f"{job[0]:<20}{job[1]:<22}{job[4]:<8}{job[5]:<10} COMPILE FAILED: "
                      f"{str(exc).splitlines()[0][:200]}")
                continue
            rows.append(r)
            bad = r["spill"] > 0 or r["local"] > 0
            failures += bad
            print(f"{r['kernel']:<20}{r['variant']:<22}{r['arch']:<8}{r['dtype']:<10}"
                  f"{r['warps']:>6}{r['blocks']:>7}{r['instr']:>9}{r['ex2']:>6}{r['lg2']:>6}"
                  f"{r['rcp']:>6}{r['rsq']:>6}{r['bar']:>5}{r['shfl']:>5}{r['lds'] + r['sts']:>8}"
                  f"{str(r['load_use'] if r['load_use'] is not None else '-'):>5}"
                  f"{r['regs']:>6}{r['spill']:>9}{r['stack']:>7}{r['local']:>7}"
                  f"{r['shared']:>10}{'  SPILL' if bad else ''}", flush=True)
    if args.json:
        import json
        with open(args.json, "w") as f:
            json.dump(sorted(rows, key=lambda r: (r["kernel"], r["variant"], r["arch"],
                                                  r["dtype"])), f, indent=1)
    print(f"{len(todo)} compiled, {failures} failed or spilled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
