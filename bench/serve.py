"""The continuous-batching server against ``ByteLM.generate``: ``python -m bench.serve``.

One run, on one freshly initialised model (speed does not depend on the weights' values;
default: the default ``ByteLM``, d_model 256 x 4 blocks, its float32 fused CPU decode step):

* ``ByteLM.generate`` at **batch 1** and **batch 64** (a 16-byte prompt, ``--bytes`` new
  bytes a row, seeded sampling at temperature 1): bytes/s of the whole call (prompt
  included), in ``--rounds`` rounds interleaved with the server's runs (another program's
  load changes the machine's speed over a run: each round's 64 streams are compared with
  that round's ``generate``, and the median ratio is reported);
* ``python -m fastrwa.serve`` in a subprocess on 127.0.0.1, and for **1, 8 and 64
  concurrent streams** (``--streams``), each a streaming ``/v1/completions`` request of
  ``--bytes`` bytes from a real HTTP client (asyncio, HTTP/1.1, one connection a stream,
  all sent at once): aggregate bytes/s (every stream's bytes over the time from the first
  request to the last ``[DONE]``), time to first byte (request sent to the first text
  event: queueing, the prompt's prefill, the first draw) and each stream's bytes/s (its
  bytes over its time from request to ``[DONE]``; median);
* where the server's time goes in each run (its ``/stats``): the decode step, the draws,
  the prompts' prefill, the hand-over to the event loop, and the rest of the wall time
  (the event loop's HTTP work and waits for the GIL; the client shares the machine too:
  ``--server-cpus`` and ``--client-cpus`` put the server and ``generate`` on some CPUs, as
  many threads, and the client on others, where the machine has enough of them;
  ``--threads`` sets the decode step's threads in both, fewer than the CPUs leaving the
  server's event loop a CPU of its own).

* the prefix cache (``--prefix-cache-mb``, in process: the server's rows, each prompt's
  prefill and first draw one after another): a ``--prefix``-byte shared prefix (4,096) asked
  ``--questions`` (32) different 64-byte questions, first byte and total prefill time with
  and without the cache (the first bytes drawn must be the same), and the hit rate of
  prompts sharing each of ``--shares`` bytes (1, 100, 1,000);
* bursts of ``max(--streams)`` different prompts arriving at once (``--burst-bytes``: 16 and
  2,048 bytes), in process: each one's first byte with the prompts prefilled one after
  another and together, against one packed prefill of all of them and one decode step.
  ``--prefill-only``: these two in-process runs only (``OUT/serve_prefill.json``).

The targets: 64 streams at 0.7x or more of batch-64 ``generate``'s bytes/s with the client
sharing the cores (issue 55), 0.9x with a CPU to spare for the server's HTTP work (issue 61:
``--threads`` one fewer than the CPUs; docs/serve.md).
Prints a table and writes ``OUT/serve.json`` (``--out``: by default ``bench-results/serve``,
which git ignores; a committed record under bench/results/ only with ``--record``, never
from ``--quick`` or smaller sizes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Optional

import torch

from bench.cli import (ROOT, add_out, check_out, int_at_least, int_list, positive_int,
                       smaller)
from bench.cli import save_json
from fastrwa.models import ByteLM, LMConfig, PackedLM
from fastrwa.models.decoding import Sampling
from fastrwa.serve.cli import PREFILL_CHUNK, PREFIX_CACHE_MB
from fastrwa.serve.prefix_cache import megabytes
from fastrwa.serve.batcher import Engine
from fastrwa.serve.rows import GREEDY_TEMPERATURE, make_rows
from fastrwa.serve.schema import Completion

PROMPT = b"The quick brown "       # 16 bytes


def generate_rate(packed: PackedLM, batch: int, n_bytes: int) -> float:
    """Aggregate bytes/s of one ``generate`` call at ``batch`` rows with weights packed once,
    as the server's (warmed first)."""
    prompt = torch.tensor([list(PROMPT)] * batch)
    packed.generate(prompt, 4, generator=torch.Generator().manual_seed(0))
    began = time.perf_counter()
    packed.generate(prompt, n_bytes, generator=torch.Generator().manual_seed(0))
    return batch * n_bytes / (time.perf_counter() - began)


async def one_stream(port: int, n_bytes: int, seed: int) -> dict:
    """One streaming completion: when it was sent, its first text event, its end, bytes."""
    body = json.dumps({"prompt": PROMPT.decode(), "max_tokens": n_bytes, "seed": seed,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: "
                 b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"the server answered {head[:200]!r}")
    first, count, buffer, done = None, 0, b"", False
    while not done:
        size = int((await reader.readline()).strip(), 16)
        if size == 0:
            break
        buffer += (await reader.readexactly(size + 2))[:-2]
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            data = event[len(b"data: "):]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if chunk["choices"] and chunk["choices"][0]["text"] and first is None:
                first = time.perf_counter()
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
    end = time.perf_counter()
    writer.close()
    return dict(sent=sent, first=first or end, end=end, bytes=count)


def fetch(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60) as r:
        return json.loads(r.read())


@contextlib.contextmanager
def pinned(cpus: Optional[list]):
    """This thread on ``cpus`` (``None``: as it is) for the block: the client of
    ``--client-cpus`` (Linux: a thread's own affinity; threads started in the block inherit
    it)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def serve_run(port: int, streams: int, n_bytes: int, client_cpus: Optional[list] = None) -> dict:
    """``streams`` streams of ``n_bytes`` from the client (on ``client_cpus``, if given)."""
    with pinned(client_cpus):
        before = fetch(port, "/stats")
        results = asyncio.run(_gather(port, streams, n_bytes))
        after = fetch(port, "/stats")
    began = min(r["sent"] for r in results)
    wall = max(r["end"] for r in results) - began
    total = sum(r["bytes"] for r in results)
    spent = {k: after[k] - before[k] for k in ("step_s", "draw_s", "prefill_s", "notify_s",
                                               "busy_s", "steps", "rows_stepped")}
    return dict(
        streams=streams, bytes=total, wall_s=wall, bytes_per_s=total / wall,
        ttfb_ms=dict(median=1e3 * statistics.median(r["first"] - r["sent"] for r in results),
                     max=1e3 * max(r["first"] - r["sent"] for r in results)),
        per_stream_bytes_per_s=statistics.median(
            r["bytes"] / (r["end"] - r["sent"]) for r in results),
        engine=dict(spent, rows_per_step=spent["rows_stepped"] / max(1, spent["steps"]),
                    other_s=wall - spent["busy_s"] - spent["notify_s"]))


async def _gather(port: int, streams: int, n_bytes: int) -> list:
    return await asyncio.gather(*(one_stream(port, n_bytes, seed) for seed in range(streams)))


def prefill_run(packed: PackedLM, prompts: list, cache_bytes: int) -> dict:
    """The server's admission of ``prompts`` (bytes) one after another, in process: each
    prompt's prefill and first draw (its first byte, queueing aside) through the server's
    rows, with a prefix cache of ``cache_bytes`` (0: none), at greedy settings. The prefix
    cache's counters, and the first bytes drawn (a hit must not change them)."""
    rows = make_rows(packed.model, packed, 1, cache_bytes)
    greedy = Sampling(GREEDY_TEMPERATURE, generator=torch.Generator().manual_seed(0))
    rows.prefill(torch.tensor([list(b"warm")]))
    times, drawn = [], []
    for prompt in prompts:
        began = time.perf_counter()
        rows.prefill(torch.tensor([list(prompt)]))
        drawn.append(rows.draw_staged(greedy))
        times.append(time.perf_counter() - began)
    cache = rows.prefix_cache
    return dict(first_byte_ms=dict(median=1e3 * statistics.median(times),
                                   max=1e3 * max(times), first=1e3 * times[0]),
                total_s=sum(times), drawn=drawn,
                queries=cache.queries - 1 if cache is not None else len(prompts),
                hits=cache.hits if cache is not None else 0,
                ids_saved=cache.ids_saved if cache is not None else 0,
                ids=sum(len(p) for p in prompts),
                cache_bytes=cache.nbytes if cache is not None else 0)


def burst_run(packed: PackedLM, prompt_bytes: int, n: int) -> dict:
    """``n`` different prompts of ``prompt_bytes`` arriving at once, in process (the
    server's rows, no prefix cache): each one's first byte (prefill and first draw, ms from
    the burst's start) with the prompts prefilled one after another at batch 1 and together
    (``DecoderRows.prefill_many``), and the physical reference: one packed prefill of all of
    them at batch ``n`` and one decode step. The first bytes drawn must be the same."""
    rng = random.Random(prompt_bytes)
    contexts = [torch.tensor([[rng.randrange(32, 127) for _ in range(prompt_bytes)]])
                for _ in range(n)]
    greedy = [Sampling(GREEDY_TEMPERATURE, generator=torch.Generator().manual_seed(i))
              for i in range(n)]
    rows = make_rows(packed.model, packed, n, 0)
    rows.prefill_many(contexts[:2])                     # (warm)
    out: dict = dict(prompt_bytes=prompt_bytes, prompts=n)
    drawn = {}
    for way in ("one_by_one", "together"):
        began, firsts, drawn[way] = time.perf_counter(), [], []
        if way == "together":
            rows.prefill_many(contexts)
        for i, context in enumerate(contexts):
            if way == "together":
                rows.select(i)
            else:
                rows.prefill(context)
            drawn[way].append(rows.draw_staged(greedy[i]))
            firsts.append(1e3 * (time.perf_counter() - began))
        out[way] = dict(median_ms=statistics.median(firsts), max_ms=max(firsts))
    if drawn["one_by_one"] != drawn["together"]:
        raise RuntimeError("prefilling the prompts together changed a first byte")
    cache = packed.allocate_cache(n)
    began = time.perf_counter()
    packed.prefill(torch.cat(contexts), cache)
    packed.step_(torch.zeros(n, dtype=torch.int64), cache)
    out["reference_ms"] = 1e3 * (time.perf_counter() - began)
    out["max_over_reference"] = out["together"]["max_ms"] / out["reference_ms"]
    return out


def stall_run(packed: PackedLM, chunk: int | None, prompt_bytes: int = 4096,
              long_prompts: int = 4, streams: int = 8) -> dict:
    """How long ``streams`` running streams wait between two of their bytes while
    ``long_prompts`` prompts of ``prompt_bytes`` arrive, in process (the server's engine
    and rows, no HTTP, no prefix cache), with ``prefill_chunk`` ``chunk`` (``None``: each
    prompt whole): the longest gap between two steps' hand-overs, and the median."""
    rows = make_rows(packed.model, packed, streams + long_prompts, 0)
    marks: list = []
    engine = Engine(rows, packed.model.config.bos_token, notify=lambda jobs: marks.append(
        time.perf_counter()), prefill_chunk=chunk)
    rng = random.Random(1)
    try:
        running = [engine.submit(Completion(prompt=PROMPT, max_tokens=100_000, seed=i))
                   for i in range(streams)]
        while len(marks) < 20:
            time.sleep(0.001)
        began = time.perf_counter()
        longs = [engine.submit(Completion(prompt=bytes(rng.randrange(32, 127)
                                                       for _ in range(prompt_bytes)),
                                          max_tokens=1, seed=i)) for i in range(long_prompts)]
        for job in longs:
            job.done.wait(600)
        ended = time.perf_counter()
        for job in running:
            job.cancel()
    finally:
        engine.close(drain=False, timeout=60)
    gaps = [b - a for a, b in zip(marks, marks[1:]) if b > began and a < ended] \
        or [ended - began]
    return dict(chunk=chunk, prompt_bytes=prompt_bytes, long_prompts=long_prompts,
                streams=streams, burst_s=ended - began, max_gap_ms=1e3 * max(gaps),
                median_gap_ms=1e3 * statistics.median(gaps))


def print_bursts(bursts: list) -> None:
    """The table of :func:`burst_run` s' results."""
    print(f"{'burst':>16} {'one by one (median, max) ms':>28} {'together (median, max) ms':>27} "
          f"{'1 forward + 1 step ms':>22} {'max / it':>8}")
    for b in bursts:
        print(f"{b['prompts']:>3} x {b['prompt_bytes']:>5} bytes "
              f"{b['one_by_one']['median_ms']:>14.1f}, {b['one_by_one']['max_ms']:>11.1f} "
              f"{b['together']['median_ms']:>13.1f}, {b['together']['max_ms']:>11.1f} "
              f"{b['reference_ms']:>22.1f} {b['max_over_reference']:>7.2f}x")


def stall_runs(packed: PackedLM, args: argparse.Namespace) -> list:
    """:func:`stall_run` with each prompt whole and with ``--prefill-chunk``, prompts of
    ``--prefix`` bytes."""
    return [stall_run(packed, chunk, args.prefix) for chunk in (None, args.prefill_chunk)]


def print_stalls(stalls: list) -> None:
    """The table of :func:`stall_runs`' results."""
    for r in stalls:
        print(f"{r['long_prompts']} prompts of {r['prompt_bytes']} bytes arriving while "
              f"{r['streams']} streams run, prefill chunk {r['chunk'] or 'none (whole)'}: "
              f"the streams' longest wait between steps {r['max_gap_ms']:.0f} ms (median "
              f"{r['median_gap_ms']:.1f} ms), the prompts in after {r['burst_s']:.2f} s")


def prefix_cache_runs(packed: PackedLM, prefix: int, questions: int, shares: list,
                      cache_bytes: int) -> dict:
    """A ``prefix``-byte shared prefix asked ``questions`` different questions, with and
    without the prefix cache; and ``questions`` prompts sharing each of ``shares`` bytes
    (each a shared start and a 64-byte tail of its own): hit rates and ids saved."""
    rng = random.Random(0)
    text = bytes(rng.randrange(32, 127) for _ in range(max(prefix, *shares)))

    def tails(n: int) -> list:         # (64 bytes each, their first bytes all different)
        return [bytes([33 + i % 94, *(rng.randrange(32, 127) for _ in range(63))])
                for i in range(n)]
    asked = [text[:prefix] + q for q in tails(questions)]
    out = dict(prefix=prefix, questions=questions,
               without=prefill_run(packed, asked, 0),
               with_cache=prefill_run(packed, asked, cache_bytes), shares={})
    if out["without"]["drawn"] != out["with_cache"]["drawn"]:
        raise RuntimeError("a prefix-cache hit changed a first byte")
    for share in shares:
        out["shares"][str(share)] = prefill_run(
            packed, [text[:share] + t for t in tails(questions)], cache_bytes)
    return out


class Server:
    """``python -m fastrwa.serve DIR --port 0`` in a subprocess."""

    def __init__(self, directory: str, capacity: int, weights: str,
                 cpus: Optional[list] = None, threads: Optional[int] = None):
        """``cpus``: the CPUs the server runs on, ``None``: any (a child runs where the
        thread that starts it may: main() pins itself to them first); ``threads``: its
        decode step's (``None``: the server's default)."""
        thread_args = ["--threads", str(threads)] if threads else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastrwa.serve", directory, "--port", "0", "--max-batch",
             str(capacity), "--weights", weights, "--max-tokens-limit", "1000000", *thread_args],
            stdout=subprocess.PIPE, cwd=ROOT, text=True)
        if cpus and os.sched_getaffinity(self.proc.pid) != set(cpus):
            self.proc.kill()
            raise RuntimeError(f"the server runs on CPUs {os.sched_getaffinity(self.proc.pid)}"
                               f", not {cpus}")
        found: list = []
        reader = threading.Thread(target=lambda: found.append(self.proc.stdout.readline()))
        reader.start()
        reader.join(120)
        match = re.search(r":(\d+)\s*$", found[0] if found else "")
        if not match:
            self.proc.kill()
            raise RuntimeError(f"the server did not start: {found}")
        self.port = int(match.group(1))

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=positive_int, default=256)
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--weights", choices=("float32", "bfloat16", "int8"), default="float32")
    p.add_argument("--bytes", type=int_at_least(2), default=512,
                   help="bytes a stream (and a row of generate; default 512)")
    p.add_argument("--streams", type=int_list(), default=[1, 8, 64],
                   help="concurrent streams, comma-separated (default 1,8,64)")
    p.add_argument("--rounds", type=positive_int, default=3,
                   help="rounds of generate and the server's runs, interleaved (default 3)")
    p.add_argument("--prefix", type=int_at_least(1), default=4096,
                   help="bytes of the shared prefix of the prefix-cache run (default 4096)")
    p.add_argument("--questions", type=positive_int, default=32,
                   help="different questions after it, and prompts of each share (default 32)")
    p.add_argument("--shares", type=int_list(), default=[1, 100, 1000],
                   help="bytes shared by the prompts of the hit-rate runs (default 1,100,1000)")
    p.add_argument("--prefix-cache-mb", type=float, default=PREFIX_CACHE_MB,
                   help=f"the prefix cache's size (default {PREFIX_CACHE_MB:g}, the server's)")
    p.add_argument("--burst-bytes", type=int_list(), default=[16, 2048],
                   help="prompt sizes of the in-process bursts of max(--streams) prompts "
                        "(default 16,2048)")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=PREFILL_CHUNK,
                   help=f"the engine's prefill chunk of the stall runs (default "
                        f"{PREFILL_CHUNK}, the server's)")
    p.add_argument("--prefill-only", action="store_true",
                   help="only the in-process prefill runs: the prefix cache's and the "
                        "bursts' (no server, no generate)")
    p.add_argument("--server-cpus", type=int_list(0), default=None,
                   help="CPUs (comma-separated) of the server and of generate (with as many "
                        "threads, unless --threads says fewer); with --client-cpus, the HTTP "
                        "client runs on others (default: both anywhere, the two sharing the "
                        "machine's cores)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="the decode step's threads, in the server and in generate (default: "
                        "as many as --server-cpus, else torch's default); fewer than the "
                        "CPUs leaves the server's HTTP work a CPU of its own")
    p.add_argument("--client-cpus", type=int_list(0), default=None,
                   help="CPUs of the HTTP client (with --server-cpus, none in common)")
    add_out(p, "serve", "serve.json")
    p.add_argument("--quick", action="store_true", help="a tiny model, a few bytes (CI)")
    args = p.parse_args(argv)
    check_cpus(p, args.server_cpus, args.client_cpus)
    if args.server_cpus and args.threads is None:
        args.threads = len(args.server_cpus)
    if args.server_cpus and args.threads > len(args.server_cpus):
        p.error(f"argument --threads: {args.threads} threads on {len(args.server_cpus)} "
                f"--server-cpus; at most one a CPU")
    small = [f"--{n.replace('_', '-')}" for n in ("d_model", "layers", "bytes", "streams", "rounds",
                                                  "prefix", "questions")
             if smaller(getattr(args, n), p.get_default(n))]
    if args.quick:
        args.d_model, args.layers, args.bytes, args.streams, args.rounds = 32, 2, 40, [1, 8], 1
        args.prefix, args.questions, args.burst_bytes = 512, 4, [16]
    check_out(p, args, "serve", small=small)
    return args


def check_cpus(p: argparse.ArgumentParser, server: Optional[list],
               client: Optional[list]) -> None:
    """``--server-cpus`` and ``--client-cpus``: both or neither, apart, each CPU one this
    process may run on (Linux)."""
    if (server is None) != (client is None):
        p.error("argument --server-cpus and --client-cpus: give both or neither")
    if server is None:
        return
    if not hasattr(os, "sched_setaffinity"):
        p.error("argument --server-cpus: CPU affinity is not available on this system")
    allowed = os.sched_getaffinity(0)
    for flag, cpus in (("--server-cpus", server), ("--client-cpus", client)):
        if not set(cpus) <= allowed:
            p.error(f"argument {flag}: CPUs {sorted(set(cpus) - allowed)} are not among the "
                    f"{len(allowed)} this process may run on ({sorted(allowed)})")
    if set(server) & set(client):
        p.error(f"argument --client-cpus: shares CPUs {sorted(set(server) & set(client))} "
                f"with --server-cpus")


def print_prefix(prefix: dict, mb: float) -> None:
    """The table of :func:`prefix_cache_runs`' result."""
    print(f"prefix cache ({mb:g} MiB): a {prefix['prefix']}-byte prefix, "
          f"{prefix['questions']} questions of 64 bytes, prefilled one after another "
          f"(first byte: prefill and first draw, ms)")
    print(f"{'':>14} {'first byte median':>17} {'max':>7} {'total s':>8} {'hits':>6} "
          f"{'ids saved':>10}")
    for name in ("without", "with_cache"):
        r = prefix[name]
        print(f"{name:>14} {r['first_byte_ms']['median']:>17.2f} {r['first_byte_ms']['max']:>7.2f} "
              f"{r['total_s']:>8.3f} {r['hits']:>3}/{r['queries']:<2} "
              f"{r['ids_saved'] / r['ids']:>9.0%}")
    for share, r in prefix["shares"].items():
        print(f"prompts sharing {share:>5} bytes: {r['hits']}/{r['queries']} hits, "
              f"{r['ids_saved'] / r['ids']:.0%} of prompt ids not prefilled")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.server_cpus:        # (generate, and every thread started from here, on them)
        os.sched_setaffinity(0, args.server_cpus)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = LMConfig(d_model=args.d_model, n_layers=args.layers)
    model = ByteLM(config).eval()
    packed = PackedLM(model, args.weights)
    if args.prefill_only:
        prefix = prefix_cache_runs(packed, args.prefix, args.questions, args.shares,
                                   megabytes(args.prefix_cache_mb))
        bursts = [burst_run(packed, n, max(args.streams)) for n in args.burst_bytes]
        stalls = stall_runs(packed, args)
        args.out.mkdir(parents=True, exist_ok=True)
        save_json(args.out / "serve_prefill.json", dict(config=config.to_dict(),
                  weights=args.weights, threads=torch.get_num_threads(), prefix_cache=prefix,
                  bursts=bursts, stalls=stalls, date=time.strftime("%Y-%m-%d")))
        print(f"d_model {args.d_model} x {args.layers}, {args.weights}, "
              f"{torch.get_num_threads()} threads")
        print_prefix(prefix, args.prefix_cache_mb)
        print_bursts(bursts)
        print_stalls(stalls)
        return 0
    big = max(args.streams)
    gen_batches = sorted({1, big})
    rates: dict = {b: [] for b in gen_batches}
    runs: dict = {n: [] for n in args.streams}
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        server = Server(directory, big, args.weights, args.server_cpus, args.threads)
        try:
            serve_run(server.port, 1, 8, args.client_cpus)          # (warm-up)
            for _ in range(args.rounds):     # interleaved: the machine's load changes
                for b in gen_batches:
                    rates[b].append(generate_rate(packed, b, args.bytes))
                for streams in args.streams:
                    runs[streams].append(serve_run(server.port, streams, args.bytes,
                                                   args.client_cpus))
        finally:
            code = server.stop()
    prefix = prefix_cache_runs(packed, args.prefix, args.questions, args.shares,
                               megabytes(args.prefix_cache_mb))
    bursts = [burst_run(packed, n, big) for n in args.burst_bytes]
    stalls = stall_runs(packed, args)
    ratios = [r["bytes_per_s"] / g for r, g in zip(runs[big], rates[big])]
    result = dict(config=config.to_dict(), weights=args.weights, bytes=args.bytes,
                  rounds=args.rounds, torch=torch.__version__, cpu_count=os.cpu_count(),
                  threads=torch.get_num_threads(), server_exit=code,
                  server_cpus=args.server_cpus, client_cpus=args.client_cpus,
                  generate={str(b): rates[b] for b in gen_batches},
                  serve={str(n): runs[n] for n in args.streams},
                  ratios_to_generate=ratios, ratio_median=statistics.median(ratios),
                  prefix_cache=prefix, bursts=bursts, stalls=stalls,
                  date=time.strftime("%Y-%m-%d"))
    args.out.mkdir(parents=True, exist_ok=True)
    save_json(args.out / "serve.json", result)
    print(f"d_model {args.d_model} x {args.layers}, {args.weights}, {args.bytes} bytes a "
          f"stream, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
          f"{args.rounds} interleaved rounds"
          + (f"; server and generate on CPUs {args.server_cpus}, the client on "
             f"{args.client_cpus}" if args.server_cpus else ""))
    for b in gen_batches:
        print(f"generate batch {b:>3}: " + ", ".join(f"{r:,.0f}" for r in rates[b])
              + " bytes/s")
    print(f"{'streams':>7} {'bytes/s':>9} {'TTFB ms (median, max)':>22} {'per stream':>10} "
          f"{'rows/step':>9} {'step s':>7} {'draw s':>7} {'prefill':>7} {'notify':>7} "
          f"{'other':>7} {'wall s':>7}")
    for streams in args.streams:
        for r in runs[streams]:
            e = r["engine"]
            print(f"{r['streams']:>7} {r['bytes_per_s']:>9,.0f} "
                  f"{r['ttfb_ms']['median']:>10.0f}, {r['ttfb_ms']['max']:>9.0f} "
                  f"{r['per_stream_bytes_per_s']:>10,.0f} {e['rows_per_step']:>9.1f} "
                  f"{e['step_s']:>7.2f} {e['draw_s']:>7.2f} {e['prefill_s']:>7.2f} "
                  f"{e['notify_s']:>7.2f} {e['other_s']:>7.2f} {r['wall_s']:>7.2f}")
    print(f"{big} streams / generate batch {big} (each round against its own generate): "
          + ", ".join(f"{x:.2f}x" for x in ratios)
          + f"; median {result['ratio_median']:.2f}x (targets: 0.7x, and 0.9x with a CPU to "
          "spare for the server's HTTP work)")
    print_prefix(prefix, args.prefix_cache_mb)
    print_bursts(bursts)
    print_stalls(stalls)
    print(args.out / "serve.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
