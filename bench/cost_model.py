"""A cost model of the Triton scan kernels: each launch's time predicted from what can be
counted without a GPU, set beside the times a card measured (issue 52, item 2).

    python -m bench.cost_model --card h100          # the 2026-11-27-fixed H100 rows
    python -m bench.cost_model --card h100 --ncu    # and the Nsight Compute kernels (clock known)
    python -m bench.cost_model --card h100 --candidates   # predictions for launch changes
    python -m bench.cost_model --card h200          # predictions at the H200's copy bandwidth
    python -m bench.cost_model --record R.json --source worktree   # a new card's rows (R: its
                                                    # gpu-<device>.json), today's kernels
    ... --python /path/to/python                    # compile with that interpreter's Triton
                                                    # (the card ran 3.6.0; docs/kernels.md)

Every kernel launch of an op (forward; backward: its kernels; "segments": three launches a
pass) is compiled ahead of time for sm_90a, as launched (pointers 16-byte aligned, an integer
argument divisible by 16 so specialised, one equal to 1 a constant: Triton's runtime does
this), by the Triton of ``--python`` from the kernel source the card ran (``--source``: a git
commit, or the working tree). Its SASS (``cuobjdump -sass``; bench/sass.py) gives, per
iteration of the chunk loop (one chunk of ``BT x BD`` elements for the scan kernels):

* ``N``: warp instructions; ``M``: MUFU warp instructions;
* ``C(L)``: the cycles one warp alone takes for it, replaying the loop body in order with
  the stall counts and scoreboard waits ptxas wrote into each instruction's control bits:
  an instruction issues ``stall`` cycles after the one before it, and not before the
  scoreboards it waits on are released; a global load releases its scoreboard ``L`` cycles
  after it issues (DRAM latency), any other variable-latency instruction (MUFU, LDC, S2R,
  conversions) after ``VARIABLE_LATENCY`` cycles, a register read after ``READ_LATENCY``.
  The loop is replayed until one iteration's time repeats (a load's value used in the next
  iteration, the double buffer, waits there).

Terms of a launch of ``P`` programs of ``warps`` warps, each ``n`` iterations (chunks), on a
card of ``S`` SMs, 4 schedulers each, at clock ``f``; ``p`` programs resident an SM (the
grid's share, at most what the registers allow), ``w`` warps on the busiest scheduler, in
``waves`` rounds:

    issue  = waves * n * w * N / f                       one instruction a cycle a scheduler
    mufu   = waves * n * w * M * 8 / f                   16 MUFU lanes an SM: 8 cycles a warp op
    chain  = waves * (n * C(L) + C0) / f                 one warp's in-order critical path
    little = waves * n * L_s / (depth * ahead)           bytes in flight: p * depth * ahead *
                                                         chunk bytes an SM against
                                                         L_s * bandwidth (ahead: chunks the
                                                         build loads ahead; depth: a what-if)
    dram   = bytes / copy bandwidth                      bytes: every load and store, counted
    time   = max(issue, mufu, chain, little, dram)

Each term is the time one resource needs alone (the schedulers, the MUFU pipes, one warp's
dependences, the loads a program keeps in flight, DRAM), and the resources work at once: a
warp's loads are in flight while it and the others issue, so the slowest bounds the launch.
What cannot overlap is already inside ``chain``: a load that the code waits on before it has
issued enough other work to cover ``L`` adds its remaining latency there. ``L`` is the
card's :class:`Latency` at the launch's own DRAM throughput (its bytes over its time, of the
card's peak), solved per launch (:func:`terms`). An op's time is the
sum of its launches (one stream). Nothing is fitted per row; the constants are in
:data:`CARDS` and the module constants below, each with its source.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

if __name__ == "__main__" and not __package__:   # python bench/cost_model.py: run as the module
    _root = str(pathlib.Path(__file__).resolve().parents[1])
    os.execve(sys.executable, [sys.executable, "-m", "bench.cost_model", *sys.argv[1:]],
              {**os.environ, "PYTHONPATH": os.pathsep.join(
                  filter(None, (_root, os.environ.get("PYTHONPATH"))))})

from bench import kernels, sass  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent
CACHE = ROOT / "bench-results" / "cost_model"

# Cycles before a variable-latency instruction other than a global load (MUFU, LDC, S2R,
# F2F ...) releases its scoreboard, and before a store's or load's source registers may be
# written again. Assumptions (microbenchmarks of Volta to Hopper put MUFU and constant loads
# at a few tens of cycles); they move the predictions by under 2% (--check-sensitivity).
VARIABLE_LATENCY = 20
READ_LATENCY = 10
MUFU_LANES_PER_SM = 16       # CUDA C++ Programming Guide, throughput table: cc 9.0, exp2/rcp/lg2
SCHEDULERS = 4               # warp schedulers an SM (Hopper: 4 partitions, 1 warp instr/cycle)
REGS_PER_SCHEDULER = 16384   # 64 K 32-bit registers an SM, one quarter a partition
MAX_WARPS, MAX_BLOCKS = 64, 32   # resident an SM (cc 9.0)
# The "chained" forward (kernels/triton/scan_chained.py) walks each segment twice; its second
# walk's reads are taken as L2 hits when the segments of the programs resident at once fit in
# L2_SHARE of the L2 (50 MB on the H100 SXM5: NVIDIA H100 whitepaper; the share is an
# assumption: the rest holds y, the saved states and the look-back's summaries), else as
# DRAM reads. Its look-back: each window hop (one acquire of the flags, one read of the
# summaries, each an L2 round trip, and a WINDOW-row combine chain in one thread) taken as
# LOOKBACK_HOP_NS (an assumption: 2 x 600 ns under load and 32 x ~25 dependent cycles),
# one hop per window of a sequence's segments in series: the prefix's walk along the
# sequence, a lower bound under the walks (a term beside them, not added to them).
L2_BYTES = 50e6
L2_SHARE = 0.5
LOOKBACK_HOP_NS = 2000.0


@dataclasses.dataclass(frozen=True)
class Latency:
    """A global load's latency as DRAM fills up (ns): ``light_ns`` up to ``light_at`` of the
    card's peak DRAM throughput ``peak_bw`` (bytes/s), rising in a straight line through
    ``loaded_ns`` at ``loaded_at``; the two points are profiler readings (:data:`CARDS`).
    ``loaded_ns`` ``None`` or ``light_ns``: a fixed latency (the model before 2026-12-06)."""
    light_ns: float
    light_at: float = 0.0
    loaded_ns: float | None = None
    loaded_at: float = 1.0
    peak_bw: float = 0.0

    def __post_init__(self) -> None:
        if not self.light_ns > 0:
            raise ValueError(f"light_ns must be positive, got {self.light_ns}")
        if self.loaded_ns is not None and not (
                self.loaded_ns >= self.light_ns and 0 <= self.light_at < self.loaded_at <= 1):
            raise ValueError(f"a loaded latency needs loaded_ns >= light_ns and 0 <= light_at "
                             f"< loaded_at <= 1, got {self}")

    def at(self, u: float) -> float:
        """The latency (ns) at ``u``, the fraction of ``peak_bw`` a launch moves."""
        if self.loaded_ns is None or u <= self.light_at:
            return self.light_ns
        slope = (self.loaded_ns - self.light_ns) / (self.loaded_at - self.light_at)
        return self.light_ns + slope * (min(u, 1.0) - self.light_at)

    @property
    def fixed(self) -> bool:
        """True when the latency does not depend on the throughput."""
        return self.loaded_ns is None or self.loaded_ns == self.light_ns


@dataclasses.dataclass(frozen=True)
class Card:
    name: str
    sms: int
    clock_hz: float           # the SM clock the timed rows ran at (not recorded: max boost)
    latency_ns: float         # DRAM load latency, lightly loaded (Latency.light_ns)
    record: str | None        # the timed rows (bench/results/gpu/...)
    source: str | None        # the git commit whose kernels the card ran (None: working tree)
    ncu: str | None = None    # Nsight Compute output of the same run (kernel durations)
    ncu_clock_hz: float = 0.0
    notes: str = ""
    peak_bw: float = 0.0              # DRAM bytes/s, the datasheet's (0: latency fixed)
    light_at: float = 0.0             # the DRAM throughput (of peak) latency_ns was read at
    loaded_ns: float | None = None    # a load's latency at loaded_at of peak (None: fixed)
    loaded_at: float = 1.0

    def latency(self, light_ns: float | None = None, fixed: bool = False) -> Latency:
        """The card's :class:`Latency` (``light_ns``: another light-load latency, the line
        moved with it; ``fixed``: ``light_ns`` whatever the load)."""
        light = light_ns or self.latency_ns
        if fixed or self.loaded_ns is None:
            return Latency(light)
        return Latency(light, self.light_at, self.loaded_ns + light - self.latency_ns,
                       self.loaded_at, self.peak_bw)


CARDS = {
    # 132 SMs: NVIDIA H100 whitepaper (H100 SXM5) and the record's "sms"; 1.98 GHz: the H100
    # SXM5's maximum boost clock (NVIDIA's datasheet; the run recorded no clock, do_bench
    # times a card left at its default boost); latency: 500 ns, calibrated once on a
    # profiler reading, not on the timed rows: the value at which the replay gives the
    # backward Nsight Compute profiled (bench/results/gpu/2026-11-27-fixed/ncu-*.txt, 1.60
    # GHz, 26% DRAM throughput: near the unloaded latency) its measured 7.07 cycles an
    # instruction (450 ns: 6.55, 550 ns: 7.74); --latency-ns moves it. Commit 596ded5:
    # docs/benchmarks.md, "H100,
    # 2026-11-27 (second loan)": "The kernels are those of commit 596ded5". Triton 3.6.0 ran
    # there (the record's "triton"); --python compiles with another Triton.
    #
    # Under load a load waits longer (queues at the memory controllers): the same profile's
    # forward, at 68% of peak DRAM throughput (Nsight Compute's "DRAM Throughput"), issued
    # an instruction every 2.59 cycles, which the replay gives at 785 ns (750: 2.54, 800:
    # 2.61). The latency is taken as a line through the two readings (26%: 500 ns; 68%: 785
    # ns), flat below 26%; each launch's throughput is its bytes over its predicted time
    # against the datasheet's peak (3.35 TB/s, NVIDIA H100 SXM5 datasheet), solved with the
    # latency it gives (:func:`terms`). Two profiler readings, not the timed rows.
    "h100": Card("NVIDIA H100 80GB HBM3", 132, 1.98e9, 500.0,
                 "bench/results/gpu/2026-11-27-fixed/gpu-nvidia-h100-80gb-hbm3.json", "596ded5",
                 ncu="bench/results/gpu/2026-11-27-fixed/ncu-nvidia-h100-80gb-hbm3.txt",
                 ncu_clock_hz=1.60e9, peak_bw=3.35e12, light_at=0.2618, loaded_ns=785.0,
                 loaded_at=0.6812),
    # H200: 132 SMs, same SM and clock as the H100 SXM5 (NVIDIA H200 datasheet); its record
    # (2026-11-26) timed the kernels before one column a thread, so it gives the copy
    # bandwidth of that card and nothing to compare the current kernels with.
    "h200": Card("NVIDIA H200", 132, 1.98e9, 500.0, "bench/results/gpu/gpu-nvidia-h200.json",
                 None, notes="record of older kernels (2026-11-26): predictions only"),
}

OPS = {"rda-exp": dict(inputs=3, ATTN=0, DISCOUNT=2), "rwa": dict(inputs=2, ATTN=0, DISCOUNT=0)}
ITEMSIZE = {"float32": 4, "bfloat16": 2}
IO_POINTERS = {"z_ptr", "a_ptr", "g_ptr", "y_ptr", "gy_ptr", "gz_ptr", "ga_ptr", "gg_ptr"}
INDEX_POINTERS = {"cu_ptr", "co_ptr", "cs_ptr", "so_ptr", "ss_ptr"}
SASS_DTYPE = {"float32": "fp32", "bfloat16": "bf16"}


# ---------------------------------------------------------------------------- launches

@dataclasses.dataclass(frozen=True)
class Knobs:
    """The launcher's knobs (fastrwa/ops/triton_host.py ``Options``) and its heuristic's
    constants; :func:`default_knobs` reads them from there."""
    block_t: int = 16
    block_d: int = 32
    block_d_backward: int = 32
    warps: int = 1
    warps_backward: int = 1
    stages: int = 3
    segment_chunks: int = 0
    programs_per_sm: int = 2
    segment_programs_per_sm: int = 16
    min_segment_chunks: int = 8
    max_registers: int = 255
    lookahead: int | None = None       # None: triton_host.backward_lookahead; 0/1 force it
    depth: int = 1                     # chunks a load runs ahead (what-if: see --candidates)
    forward_lookahead: int = 1         # the forward kernel's LOOKAHEAD (a build: 1 or 2)
    carry_tile: int = 1                # segments a carry kernel's iteration takes (KT)
    forward_block_t: int = 0           # the forward's BT (0: block_t; states saved at block_t)
    chained: bool = False              # the "segments" rows' forward as "chained"
    chained_backward: bool = True      # ... and their backward (triton_host.Options's)
    chained_chunks: int = 4            # triton_host.Options.chained_chunks
    lookback_window: int = 32          # triton_host.Options.lookback_window
    chained_programs_per_sm: int = 0   # triton_host.Options's: the forward's programs an SM
                                       # at most (0: as many as the registers allow)
    chained_programs_per_sm_backward: int = 0    # the same, the backward's


def default_knobs() -> Knobs:
    from fastrwa.ops import triton_host as tb
    o = tb.Options()
    return Knobs(o.block_t, o.block_d, o.block_d_backward, o.warps, o.warps_backward, o.stages,
                 o.segment_chunks, tb.PROGRAMS_PER_SM, tb.SEGMENT_PROGRAMS_PER_SM,
                 tb.MIN_SEGMENT_CHUNKS, tb.MAX_REGISTERS,
                 forward_lookahead=o.forward_lookahead, carry_tile=o.carry_tile,
                 forward_block_t=o.forward_block_t, chained_chunks=o.chained_chunks,
                 chained_backward=o.chained_backward, lookback_window=o.lookback_window,
                 chained_programs_per_sm=o.chained_programs_per_sm,
                 chained_programs_per_sm_backward=o.chained_programs_per_sm_backward)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def segment_chunks(B: int, D: int, T: int, k: Knobs, sms: int) -> int:
    """triton_host.segment_chunks with the card's SM count."""
    if k.segment_chunks:
        return k.segment_chunks
    blocks = max(1, B * cdiv(D, k.block_d))
    wanted = cdiv(k.segment_programs_per_sm * sms, blocks)
    return max(k.min_segment_chunks, cdiv(cdiv(T, k.block_t), wanted))


def choose_algorithm(B: int, D: int, T: int, k: Knobs, sms: int) -> str:
    """triton_host.choose_algorithm with the card's SM count."""
    if B * cdiv(D, k.block_d) >= k.programs_per_sm * sms or T <= 2 * k.block_t:
        return "looped"
    return "looped" if cdiv(T, k.block_t) <= segment_chunks(B, D, T, k, sms) else "segments"


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch: what to compile (``kernel``, ``const``, ``ints``: the integer
    arguments' values, which decide their specialisation) and what it moves."""
    label: str
    kernel: str               # "scan_fwd.fwd_kernel" ...
    const: tuple              # sorted (name, value) constexprs
    ints: tuple               # (name, value) integer arguments as launched
    dtype: str
    warps: int
    stages: int
    maxnreg: int
    programs: int
    iterations: int           # chunk-loop iterations a program
    bytes: int                # DRAM bytes read + written
    chunk_load_bytes: int     # bytes a program loads an iteration
    depth: int                # iterations a load is issued ahead of its use (0: at use)
    ahead: int = 1            # chunks the build itself loads ahead (the forward's LOOKAHEAD)
    reread: int = 0           # bytes read again, from L2 if ``footprint`` fits (chained)
    footprint: int = 0        # a program's bytes that must stay in L2 for that
    hops: int = 0             # look-back window hops in series (chained)
    cap: int = 0              # programs an SM at most (0: registers decide; chained)


def lookahead(ATTN: int, k: Knobs) -> int:
    """triton_host.backward_lookahead, or the knob's forced value."""
    if k.lookahead is not None:
        return k.lookahead
    per_thread = k.block_t * k.block_d_backward // (32 * k.warps_backward)
    return 0 if ATTN in (1, 2, 3) or per_thread > 16 else 1


def plan(op: str, shape, dtype: str, algorithm: str, pass_: str, k: Knobs, sms: int,
         source_has_lookahead: bool = True,
         source_has_forward_lookahead: bool = True,
         source_has_carry_tile: bool = True,
         source_has_save_bt: bool = True) -> list[Launch]:
    """The launches of ``pass_`` ("fwd": the forward without autograd; "fwd+bwd": the
    forward that saves its chunk states, then the backward), as fastrwa/ops/triton_host.py
    makes them. ``source_has_*``: the kernels compiled have the backward's (the forward's)
    ``LOOKAHEAD`` constexpr, the carry kernels ``KT``; older sources have not (one chunk
    ahead in the forward, none in the backward, one segment a carry iteration), the
    forward ``SAVE_BT`` (its chunk apart from the saved states': ``forward_block_t``)."""
    B, T, D = shape
    spec = OPS[op]
    s, n_in = ITEMSIZE[dtype], spec["inputs"]
    E = B * T * D
    BT = k.block_t
    rows = B * cdiv(T, BT)                               # saved chunk states, BT steps each
    if k.forward_block_t and not source_has_save_bt:
        raise ValueError("forward_block_t: the kernels compiled have no SAVE_BT")
    fk = dataclasses.replace(k, block_t=k.forward_block_t or BT, forward_block_t=0)
    fBT = fk.block_t
    state = 3 * D * 4                                    # a chunk's saved state, float32
    save = pass_ != "fwd"
    out = []
    # forward
    BD = k.block_d
    n_d = cdiv(D, BD)
    fconst = dict(D=D, ATTN=spec["ATTN"], DISCOUNT=spec["DISCOUNT"], REVERSE=False,
                  SAVE_CHUNKS=save, IS_VARLEN=False, BT=fBT, BD=BD)
    if source_has_save_bt:
        fconst["SAVE_BT"] = BT
    fload = n_in * fBT * BD * s
    common = dict(dtype=dtype, stages=k.stages, maxnreg=k.max_registers)
    fahead = 1
    KT = k.carry_tile if source_has_carry_tile else 1
    ckt = dict(KT=KT) if source_has_carry_tile else {}
    if source_has_forward_lookahead:
        fconst["LOOKAHEAD"] = fahead = k.forward_lookahead
    if algorithm == "looped":
        out.append(Launch(f"fwd[one_pass{',save' if save else ''}]", "scan_fwd.fwd_kernel",
                          _items(fconst, PHASE=0, HAS_INIT=False, STORE_FINAL=save, CPS=1),
                          (("T", T), ("NS", B), ("NCT", rows), ("NSEG", B)),
                          warps=k.warps, programs=B * n_d, iterations=cdiv(T, fBT),
                          bytes=(n_in + 1) * E * s + save * (rows * state + B * state),
                          chunk_load_bytes=fload, depth=k.depth, ahead=fahead, **common))
    else:
        cps = k.chained_chunks if k.chained else segment_chunks(B, D, T, fk, sms)
        nseg = B * max(1, cdiv(cdiv(T, fBT), cps))
        ints = (("T", T), ("CPS", cps), ("NS", B), ("NCT", rows), ("NSEG", nseg))

        def walk(label: str, phase: int, bytes_: int, **more) -> Launch:
            """A launch of the summary (1) or output (2) pass over every segment."""
            return Launch(label, "scan_fwd.fwd_kernel",
                          _items(fconst, PHASE=phase, HAS_INIT=False, STORE_FINAL=False), ints,
                          warps=k.warps, programs=nseg * n_d, iterations=cps, bytes=bytes_,
                          chunk_load_bytes=fload, depth=k.depth, ahead=fahead, **more,
                          **common)

        if k.chained:
            # one launch, approximated by the two walks it makes: the summary pass's loop
            # (DRAM reads), then the output pass's (its reads again: L2 if they fit,
            # with_reread())
            out.append(walk("fwd[chained:1]", 1, n_in * E * s + 7 * nseg * D * 4,
                            cap=k.chained_programs_per_sm))
            out.append(walk(f"fwd[chained:2{',save' if save else ''}]", 2,
                            E * s + save * rows * state, reread=n_in * E * s,
                            footprint=cps * fload, hops=cdiv(nseg // B, k.lookback_window),
                            cap=k.chained_programs_per_sm))
        else:
            out.append(walk("fwd[summary]", 1, n_in * E * s + 4 * nseg * D * 4))
            out.append(_carry("fwd_carry", "scan_fwd.fwd_carry_kernel",
                              dict(D=D, IS_VARLEN=False, BT=fBT, BD=BD, **ckt,
                                   HAS_INIT=False, STORE_FINAL=save),
                              T, cps, B, nseg, KT, k.warps, n_d, 7 * nseg * D * 4,
                              4 * BD * 4, common))
            out.append(walk(f"fwd[output{',save' if save else ''}]", 2,
                            (n_in + 1) * E * s + 3 * nseg * D * 4 + save * rows * state))
    if not save:
        return out
    # backward
    BD = k.block_d_backward
    n_d = cdiv(D, BD)
    la = lookahead(spec["ATTN"], k)
    bconst = dict(D=D, ATTN=spec["ATTN"], DISCOUNT=spec["DISCOUNT"], REVERSE=False,
                  IS_VARLEN=False, BT=BT, BD=BD)
    if source_has_lookahead:
        bconst["LOOKAHEAD"] = la
    else:
        la = 0
    bload = (n_in + 1) * BT * BD * s + 3 * BD * 4
    bdepth = k.depth if la else 0
    bytes_one = (2 * n_in + 1) * E * s + rows * state
    if algorithm == "looped":
        out.append(Launch("bwd[one_pass]", "scan_bwd.bwd_kernel",
                          _items(bconst, PHASE=0, HAS_INIT=False, HAS_FINAL_GRAD=False, CPS=1),
                          (("T", T), ("NS", B), ("NCT", rows), ("NSEG", B)),
                          warps=k.warps_backward, programs=B * n_d, iterations=cdiv(T, BT),
                          bytes=bytes_one, chunk_load_bytes=bload, depth=bdepth, **common))
    else:
        cps = k.chained_chunks if k.chained and k.chained_backward else \
            segment_chunks(B, D, T, k, sms)
        nseg = B * max(1, cdiv(cdiv(T, BT), cps))
        ints = (("T", T), ("CPS", cps), ("NS", B), ("NCT", rows), ("NSEG", nseg))

        def bwalk(label: str, phase: int, bytes_: int, **more) -> Launch:
            """A launch of the backward's summary (1) or output (2) pass over every segment."""
            return Launch(label, "scan_bwd.bwd_kernel",
                          _items(bconst, PHASE=phase, HAS_INIT=False, HAS_FINAL_GRAD=False),
                          ints, warps=k.warps_backward, programs=nseg * n_d, iterations=cps,
                          bytes=bytes_, chunk_load_bytes=bload, depth=bdepth, **more, **common)

        if k.chained and k.chained_backward:
            # one launch, approximated by its two walks as the chained forward is: the summary
            # walk (DRAM reads; publishes (K, W, V) and (W, V)), then the output walk (its
            # reads again: L2 if they fit)
            out.append(bwalk("bwd[chained:1]", 1,
                             (n_in + 1) * E * s + rows * state + 5 * nseg * D * 4,
                             cap=k.chained_programs_per_sm_backward))
            out.append(bwalk("bwd[chained:2]", 2, n_in * E * s,
                             reread=(n_in + 1) * E * s + rows * state, footprint=cps * bload,
                             hops=cdiv(nseg // B, k.lookback_window),
                             cap=k.chained_programs_per_sm_backward))
        else:
            out.append(bwalk("bwd[summary]", 1,
                             (n_in + 1) * E * s + rows * state + 3 * nseg * D * 4))
            out.append(_carry("bwd_carry", "scan_bwd.bwd_carry_kernel",
                              dict(D=D, IS_VARLEN=False, BT=BT, BD=BD, **ckt, HAS_INIT=False,
                                   HAS_FINAL_GRAD=False),
                              T, cps, B, nseg, KT, k.warps_backward, n_d, 5 * nseg * D * 4,
                              3 * BD * 4, common))
            out.append(bwalk("bwd[output]", 2, bytes_one + 2 * nseg * D * 4))
    return out


def _carry(label: str, kernel: str, const: dict, T: int, cps: int, B: int, nseg: int, KT: int,
           warps: int, n_d: int, bytes_: int, summary_bytes: int, common: dict) -> Launch:
    """A carry kernel's launch: one program per sequence and channel block, walking its
    ``nseg // B`` segment summaries (``summary_bytes`` a channel block each) ``KT`` at a
    time."""
    return Launch(label, kernel, _items(const),
                  (("T", T), ("CPS", cps), ("NS", B), ("NSEG", nseg)),
                  warps=warps, programs=B * n_d, iterations=cdiv(nseg // B, KT), bytes=bytes_,
                  chunk_load_bytes=KT * summary_bytes, depth=0, **common)


def _items(base: dict, **more) -> tuple:
    return tuple(sorted({**base, **more}.items()))


# ---------------------------------------------------------------------------- compiling

def materialise(source: str | None) -> tuple[pathlib.Path, str]:
    """The kernels package (``kernels/``) at git commit ``source`` (None: the working tree)
    as a package of its own name in a cache folder: ``(folder, package name)``."""
    if source is None:
        files = {str(p.relative_to(ROOT / "kernels")): p.read_bytes()
                 for p in sorted((ROOT / "kernels").rglob("*.py"))}
    else:
        names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "-r", "--name-only", source,
                                "kernels/"], capture_output=True, text=True, check=True).stdout
        files = {n.removeprefix("kernels/"): subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{source}:{n}"], capture_output=True,
            check=True).stdout for n in names.split() if n.endswith(".py")}
    digest = hashlib.sha256(json.dumps(sorted((k, v.hex()) for k, v in files.items()))
                            .encode()).hexdigest()[:12]
    package = f"cm_kernels_{digest}"
    folder = CACHE / "src"
    if not (folder / package).exists():
        tmp = pathlib.Path(tempfile.mkdtemp(dir=_mkdir(folder)))
        for name, data in files.items():
            (tmp / package / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp / package / name).write_bytes(data)
        try:
            (tmp / package).rename(folder / package)
        except OSError:            # another run made it first
            pass
        shutil.rmtree(tmp, ignore_errors=True)
    return folder, package


def _mkdir(p: pathlib.Path) -> pathlib.Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


def _worker(request: dict) -> list[dict]:
    """Compile ``request["builds"]`` (run in the ``--python`` interpreter: needs only Triton
    and the materialised kernels package)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, request["folder"])
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    out = []
    for b in request["builds"]:
        module, name = b["kernel"].split(".")
        fn = getattr(importlib.import_module(f"{request['package']}.triton.{module}"), name)
        const = {k: v for k, v in b["const"] if k in fn.arg_names}
        ints = dict(b["ints"])
        signature, attrs = {}, {}
        for index, arg in enumerate(fn.arg_names):
            if arg in const:
                signature[arg] = "constexpr"
            elif arg in ints and ints[arg] == 1:          # Triton turns a 1 into a constant
                signature[arg] = "constexpr"
                const[arg] = 1
            elif arg in IO_POINTERS:
                signature[arg] = "*" + SASS_DTYPE[b["dtype"]]
            elif arg in INDEX_POINTERS:
                signature[arg] = "*i64"
            elif arg.endswith("_ptr"):
                signature[arg] = "*fp32"
            else:
                signature[arg] = "i32"
            if signature[arg].startswith("*") or (signature[arg] == "i32"
                                                  and ints.get(arg, 1) % 16 == 0):
                attrs[(index,)] = [["tt.divisibility", 16]]
        kernel = triton.compile(
            ASTSource(fn=fn, signature=signature, constexprs=const, attrs=attrs),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": b["warps"], "num_stages": b["stages"], "maxnreg": b["maxnreg"]})
        with tempfile.TemporaryDirectory() as tmp:
            cubin = os.path.join(tmp, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(kernel.asm["cubin"])
            run = lambda *a: subprocess.run([os.path.join(bin_dir, "cuobjdump"), *a, cubin],
                                            capture_output=True, text=True, check=True).stdout
            usage, listing = run("-res-usage"), run("-sass")
        field = lambda key: int(re.search(rf"\b{key}:(\d+)", usage).group(1))
        out.append(dict(sass=listing, regs=field("REG"), local=field("LOCAL"),
                        triton=triton.__version__))
    return out


def _build_key(launch: Launch) -> dict:
    return dict(kernel=launch.kernel, const=list(launch.const), ints=list(launch.ints),
                dtype=launch.dtype, warps=launch.warps, stages=launch.stages,
                maxnreg=launch.maxnreg)


def compile_all(launches: list[Launch], source: str | None, python: str,
                workers: int = 2) -> dict:
    """``{build key (json): compiled dict}`` for every distinct build, from the cache under
    bench-results/cost_model/ where it was compiled before (same source, same Triton)."""
    folder, package = materialise(source)
    version = subprocess.run([python, "-c", "import triton; print(triton.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    todo, done = {}, {}
    for launch in launches:
        key = json.dumps(_build_key(launch), sort_keys=True)
        path = _mkdir(CACHE / "builds") / (hashlib.sha256(
            f"{package}|{version}|{key}".encode()).hexdigest()[:20] + ".json")
        if path.exists():
            done[key] = json.loads(path.read_text())
        else:
            todo[key] = path
    keys = list(todo)
    if keys:
        print(f"compiling {len(keys)} builds with Triton {version} ({python})", file=sys.stderr,
              flush=True)
        parts = [keys[i::workers] for i in range(workers) if keys[i::workers]]
        procs = []
        for part in parts:
            request = json.dumps(dict(folder=str(folder), package=package,
                                      builds=[json.loads(k) for k in part]))
            p = subprocess.Popen([python, "-m", "bench.cost_model", "--worker"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
            p.stdin.write(request)
            p.stdin.close()
            procs.append((part, p))
        for part, p in procs:
            result = json.loads(p.stdout.read())
            if p.wait():
                raise RuntimeError("a compile worker failed")
            for key, compiled in zip(part, result):
                todo[key].write_text(json.dumps(compiled))
                done[key] = compiled
    return done


# ---------------------------------------------------------------------------- SASS

_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;\s*/\*\s*0x([0-9a-f]{16})\s*\*/")
_HIGH = re.compile(r"^\s*/\*\s*0x([0-9a-f]{16})\s*\*/\s*$")
_BACK = re.compile(r"\bBRA(?:\.\w+)*\s+0x([0-9a-f]+)")


@dataclasses.dataclass(frozen=True)
class Instr:
    addr: int
    text: str
    stall: int      # cycles before the next instruction may issue
    wbar: int       # scoreboard this instruction's result releases (7: none)
    rbar: int       # scoreboard its source registers' read releases (7: none)
    wait: int       # mask of scoreboards it waits on


def control(listing: str) -> list[Instr]:
    """Every instruction with its control bits (sm_70 and later: the 128-bit instruction's top
    23 bits, printed as the second word: stall 4 bits, yield 1, write barrier 3, read barrier
    3, wait mask 6, reuse 4)."""
    lines, out = listing.splitlines(), []
    for i, line in enumerate(lines):
        m = _LINE.match(line)
        h = _HIGH.match(lines[i + 1]) if m and i + 1 < len(lines) else None
        if m and h:
            c = int(h.group(1), 16) >> 41
            out.append(Instr(int(m.group(1), 16), m.group(2), c & 15, (c >> 5) & 7,
                             (c >> 8) & 7, (c >> 11) & 63))
    return out


def split_loop(ins: list[Instr]) -> tuple[list[Instr], list[Instr]]:
    """(the outermost loop's body, the rest up to EXIT): the span bench/sass.py's
    ``loop_body`` counts."""
    loops = []
    for x in ins:
        m = _BACK.search(x.text)
        if m and int(m.group(1), 16) < x.addr:
            loops.append((int(m.group(1), 16), x.addr))
    end = next((x.addr for x in ins if sass.opcode(x.text) == "EXIT"), ins[-1].addr)
    if not loops:
        return [], [x for x in ins if x.addr <= end]
    lo, hi = max(loops, key=lambda span: span[1] - span[0])
    last_exit = max((x.addr for x in ins if sass.opcode(x.text) == "EXIT"), default=hi)
    return ([x for x in ins if lo <= x.addr <= hi],
            [x for x in ins if (x.addr < lo or hi < x.addr <= last_exit)])


def latency_of(op: str, load_cycles: float) -> float:
    return load_cycles if (op == "LDG" or op.startswith("LDG.")) else VARIABLE_LATENCY


def replay(body: list[Instr], load_cycles: float, rounds: int = 8) -> float:
    """Cycles one warp alone takes for an iteration of ``body`` in steady state (in-order
    issue, stall counts, scoreboard waits; see the module docstring)."""
    if not body:
        return 0.0
    t, release, starts = 0.0, [0.0] * 6, []
    for _ in range(rounds):
        starts.append(t)
        for x in body:
            ready = max([t] + [release[b] for b in range(6) if x.wait >> b & 1])
            op = sass.opcode(x.text)
            if x.wbar != 7:
                release[x.wbar] = max(release[x.wbar], ready + latency_of(op, load_cycles))
            if x.rbar != 7:
                release[x.rbar] = max(release[x.rbar], ready + READ_LATENCY)
            t = ready + max(1, x.stall)
        if len(starts) >= 3 and abs((t - starts[-1]) - (starts[-1] - starts[-2])) < 0.5:
            break
    return t - starts[-1]


def straight(code: list[Instr], load_cycles: float) -> float:
    """Cycles of straight-line code run once (the part of a kernel outside its loop)."""
    t, release = 0.0, [0.0] * 6
    for x in code:
        ready = max([t] + [release[b] for b in range(6) if x.wait >> b & 1])
        if x.wbar != 7:
            release[x.wbar] = max(release[x.wbar],
                                  ready + latency_of(sass.opcode(x.text), load_cycles))
        if x.rbar != 7:
            release[x.rbar] = max(release[x.rbar], ready + READ_LATENCY)
        t = ready + max(1, x.stall)
    return max([t] + release)


@dataclasses.dataclass
class Counted:
    """What a build's SASS says (per iteration of its chunk loop, in warp instructions)."""
    instr: int
    mufu: int
    regs: int
    local: int
    body: list
    rest: list
    costs: dict


def count(compiled: dict, launch: Launch) -> Counted:
    ins = control(compiled["sass"])
    body, rest = split_loop(ins)
    const = dict(launch.const)
    per_iteration = const["BD"] * const.get("KT", 1) if launch.kernel.endswith(
        "carry_kernel") else const["BT"] * const["BD"]
    costs = sass.costs(compiled["sass"], per_iteration, 32 * launch.warps)
    mufu = sum(1 for x in body if sass.opcode(x.text).startswith("MUFU"))
    return Counted(len(body), mufu, compiled["regs"], compiled["local"], body, rest, costs)


# ---------------------------------------------------------------------------- the model

@dataclasses.dataclass
class Terms:
    issue: float
    mufu: float
    chain: float
    little: float
    dram: float
    programs_per_sm: int
    warps_per_scheduler: int
    waves: int
    inflight_kib: float       # bytes in flight an SM (KiB)
    need_kib: float           # latency x bandwidth an SM (KiB)
    cpi: float                # one warp's cycles an instruction in the loop (C / N)
    latency_ns: float = 0.0   # the load latency the terms were taken at
    lookback: float = 0.0     # the chained forward's look-back hops in series

    @property
    def time(self) -> float:
        return max(self.issue, self.mufu, self.chain, self.little, self.dram, self.lookback)

    @property
    def bound(self) -> str:
        terms = dict(issue=self.issue, mufu=self.mufu, chain=self.chain, little=self.little,
                     dram=self.dram, lookback=self.lookback)
        return max(terms, key=terms.get)


def resident(regs: int, warps: int, cap: int = 0) -> int:
    """Programs an SM holds at once: registers (per scheduler, allocated 8 a thread at a
    time), warps and blocks; at most ``cap`` where it is not 0 (a persistent launch)."""
    per_warp = 32 * cdiv(max(regs, 1), 8) * 8
    warps_per_scheduler = REGS_PER_SCHEDULER // per_warp
    held = max(1, min(MAX_BLOCKS, MAX_WARPS // warps, SCHEDULERS * warps_per_scheduler // warps))
    return min(held, cap) if cap else held


def terms(launch: Launch, c: Counted, card: Card, bandwidth: float, clock_hz: float,
          latency: float | Latency) -> Terms:
    """The five terms of one launch, in seconds (module docstring), with a load's latency
    ``latency`` (ns), or where it is a :class:`Latency`, the latency its DRAM throughput
    gives: the fixed point of latency -> time -> throughput -> latency, found by bisection.
    It is one point where a longer latency never shortens the replayed time (so never
    raises the throughput): what an in-order replay with waits gives, assumed here, not
    proven for every listing."""
    if not isinstance(latency, Latency):
        return _terms(launch, c, card, bandwidth, clock_hz, latency)
    if latency.fixed or not latency.peak_bw:
        return _terms(launch, c, card, bandwidth, clock_hz, latency.light_ns)

    def throughput(ns: float) -> tuple[float, Terms]:
        t = _terms(launch, c, card, bandwidth, clock_hz, ns)
        return launch.bytes / (t.time * latency.peak_bw), t

    lo, hi = latency.light_ns, latency.at(1.0)
    u, t = throughput(lo)
    if latency.at(u) <= lo:         # (light load: the light latency)
        return t
    for _ in range(14):             # (the line's span in 1/16384ths: under 0.05 ns)
        mid = (lo + hi) / 2
        if latency.at(throughput(mid)[0]) > mid:
            lo = mid
        else:
            hi = mid
    return throughput((lo + hi) / 2)[1]


def _terms(launch: Launch, c: Counted, card: Card, bandwidth: float, clock_hz: float,
           latency_ns: float) -> Terms:
    load_cycles = latency_ns * 1e-9 * clock_hz
    R = resident(c.regs, launch.warps, launch.cap)
    p = min(R, cdiv(launch.programs, card.sms))
    waves = cdiv(launch.programs, R * card.sms)
    w = cdiv(p * launch.warps, SCHEDULERS)
    n = launch.iterations
    overhead = straight(c.rest, load_cycles)
    issue = waves * w * (n * c.instr + len(c.rest)) / clock_hz
    mufu = waves * w * n * c.mufu * (32 // (MUFU_LANES_PER_SM // SCHEDULERS)) / clock_hz
    if launch.depth > 1:     # a deeper buffer: a load's value waits (depth - 1) more rounds
        cyc = replay(c.body, load_cycles)
        for _ in range(20):
            cyc_new = replay(c.body, max(0.0, load_cycles - (launch.depth - 1) * cyc))
            if abs(cyc_new - cyc) < 0.5:
                break
            cyc = cyc_new
    else:
        cyc = replay(c.body, load_cycles)
    chain = waves * (n * cyc + overhead) / clock_hz
    # (in flight: the what-if depth times the chunks the build itself loads ahead)
    little = waves * n * latency_ns * 1e-9 / (max(1, launch.depth) * launch.ahead)
    dram = launch.bytes / bandwidth
    inflight = p * max(1, launch.depth) * launch.ahead * launch.chunk_load_bytes / 1024
    need = latency_ns * 1e-9 * bandwidth / card.sms / 1024
    return Terms(issue, mufu, chain, little, dram, p, w, waves, inflight, need,
                 cyc / max(1, c.instr), latency_ns, launch.hops * LOOKBACK_HOP_NS * 1e-9)


# ---------------------------------------------------------------------------- records

def measured_rows(card: Card) -> list[dict]:
    """The op rows of the card's record (every shape, dtype, algorithm, pass)."""
    if not card.record:
        return []
    with open(ROOT / card.record) as f:
        data = json.load(f)
    return [r for r in data["rows"] if r.get("what") == "op" and r["name"] in OPS]


def copy_bandwidth(row: dict) -> float:
    """Bytes/s of the ``copy_`` of the row's bytes, timed in the same run (a measurement
    of the machine)."""
    return row["bytes"] / (row["copy_ms"] * 1e-3)


def ncu_kernels(path: pathlib.Path) -> list[dict]:
    """Kernel name, duration (s), SM clock (Hz) and cycles per issued instruction from an
    Nsight Compute text report."""
    out, current = [], None
    for line in path.read_text().splitlines():
        m = re.match(r"\s+(fwd_kernel|bwd_kernel)\s+\(", line)
        if m:
            current = dict(kernel=m.group(1))
            out.append(current)
            continue
        if current is None:
            continue
        m = re.match(r"\s+Duration\s+(us|ms)\s+([\d.,]+)", line)
        if m:
            current["seconds"] = float(m.group(2).replace(",", "")) * \
                (1e-6 if m.group(1) == "us" else 1e-3)
        m = re.match(r"\s+SM Frequency\s+Ghz\s+([\d.]+)", line)
        if m:
            current["clock_hz"] = float(m.group(1)) * 1e9
        m = re.match(r"\s+Warp Cycles Per Issued Instruction\s+cycle\s+([\d.]+)", line)
        if m:
            current["cpi"] = float(m.group(1))
        m = re.match(r"\s+Registers Per Thread\s+register/thread\s+(\d+)", line)
        if m:
            current["regs"] = int(m.group(1))
    return out


# ---------------------------------------------------------------------------- reports

def predict(rows: list[tuple], card: Card, knobs: Knobs, source: str | None, python: str,
            latency_ns: "float | Latency", clock_hz: float) -> list[dict]:
    """``rows``: ``(op, shape, dtype, algorithm, pass, bandwidth, measured_ms or None)``;
    returns each with its launches' terms and the predicted ms."""
    has_la = _source_has(source, "scan_bwd.py", "LOOKAHEAD")
    has_fla = _source_has(source, "scan_fwd.py", "LOOKAHEAD")
    has_kt = _source_has(source, "scan_fwd.py", "KT")
    has_sbt = _source_has(source, "scan_fwd.py", "SAVE_BT")
    plans = [plan(op, shape, dt, alg, ps, knobs, card.sms, has_la, has_fla, has_kt, has_sbt)
             for op, shape, dt, alg, ps, _, _ in rows]
    compiled = compile_all([l for p in plans for l in p], source, python)
    out = []
    for (op, shape, dt, alg, ps, bw, ms), launches in zip(rows, plans):
        parts = []
        for launch in launches:
            c = count(compiled[json.dumps(_build_key(launch), sort_keys=True)], launch)
            launch = with_reread(launch, c, card)
            parts.append((launch, c, terms(launch, c, card, bw, clock_hz, latency_ns)))
        out.append(dict(op=op, shape=shape, dtype=dt, algorithm=alg, pass_=ps, bandwidth=bw,
                        measured_ms=ms, parts=parts,
                        predicted_ms=1e3 * sum(t.time for _, _, t in parts)))
    return out


def with_reread(launch: Launch, c: Counted, card: Card) -> Launch:
    """``launch`` with its ``reread`` bytes added to its DRAM bytes unless the footprints of
    the programs resident at once (registers: ``c``) fit in :data:`L2_SHARE` of the L2."""
    if not launch.reread:
        return launch
    held = launch.footprint * min(launch.programs,
                                  resident(c.regs, launch.warps, launch.cap) * card.sms)
    if held <= L2_SHARE * L2_BYTES:
        return launch
    return dataclasses.replace(launch, bytes=launch.bytes + launch.reread)


def _source_has(source: str | None, module: str, name: str) -> bool:
    """Whether ``source``'s kernel ``module`` has the constexpr argument ``name``."""
    folder, package = materialise(source)
    return f"{name}: tl.constexpr" in (folder / package / "triton" / module).read_text()


def table(results: list[dict], title: str) -> str:
    """The report: a line per launch with its terms (ms), a line per op with the prediction,
    the measurement and their ratio."""
    head = (f"{'op / kernel':<24}{'shape':<14}{'dtype':<9}{'alg':<9}{'pass':<8}{'N/it':>6}"
            f"{'M/it':>5}{'regs':>5}{'p':>4}{'w':>3}{'C/N':>6}{'KiB fl':>7}"
            f"{'issue':>7}{'mufu':>7}{'chain':>7}{'little':>7}{'dram':>7}  bound "
            f"{'pred ms':>8}{'meas ms':>8}{'pred/meas':>10}")
    lines = [title, head, "-" * len(head)]
    for r in results:
        shape = "x".join(_short(x) for x in r["shape"])
        for launch, c, t in r["parts"]:
            lines.append(
                f"  {launch.label:<22}{shape:<14}{r['dtype']:<9}{r['algorithm']:<9}"
                f"{r['pass_']:<8}{c.instr:>6}{c.mufu:>5}{c.regs:>5}{t.programs_per_sm:>4}"
                f"{t.warps_per_scheduler:>3}{t.cpi:>6.2f}{t.inflight_kib:>7.1f}"
                f"{1e3 * t.issue:>7.3f}{1e3 * t.mufu:>7.3f}{1e3 * t.chain:>7.3f}"
                f"{1e3 * t.little:>7.3f}{1e3 * t.dram:>7.3f}  {t.bound:<6}{1e3 * t.time:>8.3f}")
        meas = r["measured_ms"]
        ratio = f"{r['predicted_ms'] / meas:>10.2f}" if meas else f"{'-':>10}"
        lines.append(f"{r['op']:<24}{shape:<14}{r['dtype']:<9}{r['algorithm']:<9}{r['pass_']:<8}"
                     f"{'':>97}{r['predicted_ms']:>8.3f}"
                     f"{(f'{meas:.3f}' if meas else '-'):>8}{ratio}")
    return "\n".join(lines)


def _short(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 and n % (1 << 20) == 0 else (
        f"{n >> 10}K" if n >= 16384 and n % 1024 == 0 else str(n))


def record_rows(card: Card, only_auto: bool = False) -> list[tuple]:
    rows = []
    for r in measured_rows(card):
        if r["algorithm"] not in ("looped", "segments"):
            continue
        rows.append((r["name"], tuple(r["shape"]), r["dtype"], r["algorithm"], r["pass"],
                     copy_bandwidth(r), r["ms"]))
    return rows


def with_record(card: Card, path: str, source: str | None) -> Card:
    """``card`` with the timed rows of ``path`` (a gpu-<device>.json), taken as measured with
    the kernels of ``source`` (a commit; ``None``: the working tree), and no Nsight Compute
    output (the card's is of its own record)."""
    return dataclasses.replace(card, record=os.path.abspath(path), source=source, ncu=None,
                               notes=f"record {path}: kernels of {source or 'the working tree'}")


def knob_field(text: str) -> tuple[str, int | bool]:
    """A ``type=`` for ``--knob``: ``NAME=VALUE`` (:func:`bench.kernels.knob`'s form), with
    ``NAME`` a :class:`Knobs` field (a bool field: 0 or 1)."""
    name, number = kernels.knob(text)
    fields = {f.name: f for f in dataclasses.fields(Knobs)}
    if name not in fields:
        raise argparse.ArgumentTypeError(
            f"NAME must be a field of Knobs ({', '.join(fields)}), got {name!r}")
    if fields[name].type in (bool, "bool"):
        if number not in (0, 1):
            raise argparse.ArgumentTypeError(f"{name} is a bool: 0 or 1, got {number}")
        return name, bool(number)
    return name, number


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--card", choices=sorted(CARDS), default="h100")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter whose Triton compiles (default: this one; the card "
                        "ran Triton 3.6.0)")
    p.add_argument("--source", default="record",
                   help="kernel source: 'record' (the commit the card ran, where known), "
                        "'worktree', or a git commit")
    p.add_argument("--latency-ns", type=float, default=None,
                   help="DRAM latency under light load (ns; the loaded line moves with it)")
    p.add_argument("--fixed-latency", action="store_true",
                   help="one latency whatever the DRAM throughput (the model before "
                        "2026-12-06)")
    p.add_argument("--clock-ghz", type=float, default=None, help="SM clock of the timed rows")
    p.add_argument("--ncu", action="store_true",
                   help="also the Nsight Compute kernels of the record, at their own clock")
    p.add_argument("--candidates", action="store_true",
                   help="predictions (not measurements) for launch changes, working tree")
    p.add_argument("--rows", choices=["all", "brief"], default="all",
                   help="brief: the five rows issue 52 quotes")
    p.add_argument("--shape", default=None, metavar="BxTxD",
                   help="only the record's rows of this shape (e.g. 1x1048576x256)")
    p.add_argument("--algorithm", choices=["looped", "segments"], default=None,
                   help="only the record's rows of this algorithm")
    p.add_argument("--record", default=None, metavar="FILE",
                   help="the timed rows of this gpu-<device>.json (bench/gpu_run.sh's report) in "
                        "place of the card's, measured with the kernels of --source")
    p.add_argument("--knob", action="append", type=knob_field, default=[], metavar="NAME=VALUE",
                   help="a launch knob of every row, a Knobs field (e.g. chained=1 "
                        "chained_programs_per_sm=6; the segments rows then run chained): "
                        "predictions, set beside no measurement")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        json.dump(_worker(json.loads(sys.stdin.read())), sys.stdout)
        return 0
    card = CARDS[args.card]
    latency = card.latency(args.latency_ns, args.fixed_latency)
    clock = (args.clock_ghz * 1e9) if args.clock_ghz else card.clock_hz
    source = {"record": card.source, "worktree": None}.get(args.source, args.source)
    if args.record:
        if args.source == "record":
            p.error("--record: name the kernels the card ran with --source (worktree or a "
                    "commit)")
        if not os.path.isfile(args.record):
            p.error(f"--record: no file {args.record!r}")
        card = with_record(card, args.record, source)
    knobs = dataclasses.replace(default_knobs(), **dict(args.knob))
    loaded = "" if latency.fixed else (f" ({latency.loaded_ns:.0f} ns at "
                                       f"{100 * latency.loaded_at:.0f}% of peak DRAM)")
    print(f"{card.name}: {card.sms} SMs, clock {clock / 1e9:.2f} GHz, DRAM latency "
          f"{latency.light_ns:.0f} ns{loaded}, kernels of {source or 'the working tree'}, "
          f"record {card.record}"
          + (f" ({card.notes})" if card.notes else ""))
    if args.knob:
        print("knobs: " + ", ".join(f"{name}={value}" for name, value in args.knob))
    rows = record_rows(card)
    if args.rows == "brief":
        brief = {("rda-exp", (16, 4096, 1024), "looped"), ("rda-exp", (8, 16384, 2048), "looped"),
                 ("rda-exp", (1, 1 << 20, 256), "segments")}
        rows = [r for r in rows if (r[0], r[1], r[3]) in brief and r[2] == "float32"]
    if args.shape:
        try:
            shape = tuple(int(x) for x in args.shape.lower().split("x"))
        except ValueError:
            p.error(f"--shape must be BxTxD in integers, got {args.shape!r}")
        rows = [r for r in rows if r[1] == shape]
    if args.algorithm:
        rows = [r for r in rows if r[3] == args.algorithm]
    if not rows:
        p.error("no row of the record has that shape and algorithm")
    measured = (source == card.source and (card.source is not None or bool(args.record))
                and not args.knob)
    if not measured:
        rows = [r[:-1] + (None,) for r in rows]
    results = predict(rows, card, knobs, source, args.python, latency, clock)
    print(table(results, "predicted (model) against measured (do_bench, ms)"))
    errors = [r["predicted_ms"] / r["measured_ms"] - 1 for r in results if r["measured_ms"]]
    if errors:
        within = sum(abs(e) <= 0.2 for e in errors)
        print(f"{within} of {len(errors)} rows within 20%; median |error| "
              f"{100 * sorted(map(abs, errors))[len(errors) // 2]:.0f}%, worst "
              f"{100 * max(errors, key=abs):+.0f}%")
    if args.ncu and card.ncu:
        print()
        print(ncu_report(card, knobs, source, args.python, latency))
    if args.candidates:
        print()
        print(candidates(card, knobs, args.python, latency, clock))
    return 0


def ncu_report(card: Card, knobs: Knobs, source, python: str, latency: "float | Latency") -> str:
    """The profiled kernels (bench/gpu_ncu.py: rda-exp 16x4096x1024 float32, forward that
    saves, then backward), predicted at the clock Nsight Compute held them at."""
    kernels = ncu_kernels(ROOT / card.ncu)
    bw = next(copy_bandwidth(r) for r in measured_rows(card) if r["name"] == "rda-exp" and
              tuple(r["shape"]) == (16, 4096, 1024) and r["dtype"] == "float32" and
              r["pass"] == "fwd+bwd")
    res = predict([("rda-exp", (16, 4096, 1024), "float32", "looped", "fwd+bwd", bw, None)],
                  card, knobs, source, python, latency, card.ncu_clock_hz)[0]
    lines = [f"Nsight Compute kernels at {card.ncu_clock_hz / 1e9:.2f} GHz ({card.ncu}):",
             f"{'kernel':<22}{'pred us':>9}{'ncu us':>9}{'ratio':>7}{'pred C/N':>9}"
             f"{'ncu cyc/instr':>14}{'regs':>6}{'ncu regs':>9}  bound"]
    for (launch, c, t), k in zip(res["parts"], kernels):
        cyc_per_instr = t.chain * card.ncu_clock_hz / max(1, launch.iterations * c.instr)
        lines.append(f"{launch.label:<22}{1e6 * t.time:>9.1f}{1e6 * k['seconds']:>9.1f}"
                     f"{t.time / k['seconds']:>7.2f}{cyc_per_instr:>9.2f}{k['cpi']:>14.2f}"
                     f"{c.regs:>6}{k.get('regs', 0):>9}  {t.bound}")
    return "\n".join(lines)


CANDIDATE_SHAPES = [((16, 4096, 1024), "looped"), ((8, 16384, 2048), "looped"),
                    ((1, 1 << 20, 256), "segments")]


def candidates(card: Card, knobs: Knobs, python: str, latency: "float | Latency",
               clock: float) -> str:
    """Predictions for the changes issue 52 names, with the working tree's kernels (the
    backward's double buffer included): none of these is a measurement."""
    bws = {}
    for r in measured_rows(card):
        bws[(tuple(r["shape"]), r["dtype"], r["pass"])] = copy_bandwidth(r)
    variants = [
        ("as now (working tree)", knobs),
        ("backward LOOKAHEAD 0", dataclasses.replace(knobs, lookahead=0)),
        ("lookahead depth 2 (what-if)", dataclasses.replace(knobs, depth=2)),
        ("forward LOOKAHEAD 2 (built)", dataclasses.replace(knobs, forward_lookahead=2)),
        ("carry tile 8 (built)", dataclasses.replace(knobs, carry_tile=8)),
        ("carry tile 16 (built)", dataclasses.replace(knobs, carry_tile=16)),
        ("forward BT 32 (built)", dataclasses.replace(knobs, forward_block_t=32)),
        ("forward BT 32, carry tile 8", dataclasses.replace(knobs, forward_block_t=32,
                                                            carry_tile=8)),
        ("BT 8", dataclasses.replace(knobs, block_t=8)),
        ("BT 32 (built: both passes)", dataclasses.replace(knobs, block_t=32)),
        ("BT 32, carry tile 8", dataclasses.replace(knobs, block_t=32, carry_tile=8)),
        ("chained forward only", dataclasses.replace(knobs, chained=True,
                                                     chained_backward=False)),
        ("chained fwd, BT 32, tile 8", dataclasses.replace(knobs, chained=True,
                                                           chained_backward=False, block_t=32,
                                                           carry_tile=8)),
        ("chained fwd, BT 32, 8, 3 chunks", dataclasses.replace(knobs, chained=True,
                                                                chained_backward=False,
                                                                block_t=32, carry_tile=8,
                                                                chained_chunks=3)),
        ("chained (both passes)", dataclasses.replace(knobs, chained=True)),
        ("chained, BT 32", dataclasses.replace(knobs, chained=True, block_t=32)),
        ("chained, BT 32, 2 chunks", dataclasses.replace(knobs, chained=True, block_t=32,
                                                         chained_chunks=2)),
        ("chained, 6 / 5 programs an SM", dataclasses.replace(
            knobs, chained=True, chained_programs_per_sm=6,
            chained_programs_per_sm_backward=5)),
        ("chained, 4 / 4 programs an SM", dataclasses.replace(
            knobs, chained=True, chained_programs_per_sm=4,
            chained_programs_per_sm_backward=4)),
        ("chained, 8 / 8 programs an SM", dataclasses.replace(
            knobs, chained=True, chained_programs_per_sm=8,
            chained_programs_per_sm_backward=8)),
        ("chained, BT 32, 2 chunks, 6/5", dataclasses.replace(
            knobs, chained=True, block_t=32, chained_chunks=2, chained_programs_per_sm=6,
            chained_programs_per_sm_backward=5)),
        ("2 warps, BD 64", dataclasses.replace(knobs, block_d=64, block_d_backward=64, warps=2,
                                               warps_backward=2)),
    ]
    lines = ["PREDICTIONS, not measured (working-tree kernels; ms; fwd / fwd+bwd):",
             f"{'variant':<30}" + "".join(f"{'x'.join(_short(x) for x in s) + ' ' + d:>24}"
                                          for s, _ in CANDIDATE_SHAPES
                                          for d in ("float32", "bfloat16"))]
    for label, k in variants:
        rows = []
        for shape, alg in CANDIDATE_SHAPES:
            for dt in ("float32", "bfloat16"):
                for ps in ("fwd", "fwd+bwd"):
                    bw = bws.get((shape, dt, ps)) or bws.get((shape, "float32", ps))
                    rows.append(("rda-exp", shape, dt, alg, ps, bw, None))
        try:
            res = predict(rows, card, k, None, python, latency, clock)
        except (RuntimeError, subprocess.CalledProcessError) as exc:
            lines.append(f"{label:<30}compile failed: {exc}")
            continue
        cells, notes = [], set()
        for i in range(0, len(res), 2):
            cells.append(f"{res[i]['predicted_ms']:.3f} / {res[i + 1]['predicted_ms']:.3f}")
            for r in res[i:i + 2]:
                for launch, c, _ in r["parts"]:
                    if c.local:
                        notes.add(f"{launch.label} {r['dtype']} spills ({c.local} B local)")
        lines.append(f"{label:<30}" + "".join(f"{x:>24}" for x in cells)
                     + (f"   [{'; '.join(sorted(notes))}]" if notes else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
