"""The prefix cache (``--prefix-cache-mb``): the longest stored prefix is found exactly, the
least recently used state is evicted past the capacity, and a hit does not change a byte of
a stream (greedy and seeded; prompts sharing 1 to hundreds of bytes, cut on and off the
grid, whole prompts repeated)."""

from __future__ import annotations

import random

import pytest
import torch

from fastrwa.models import PackedLM
from fastrwa.serve.batcher import Engine
from fastrwa.serve.prefix_cache import PrefixCache, key_of
from fastrwa.serve.rows import DecoderRows, make_rows
from fastrwa.serve.schema import Completion

from .test_engine import TIMEOUT, expected, run_all


def test_plan_finds_the_longest_stored_prefix_and_the_branch():
    cache = PrefixCache(10_000, every=8)
    assert cache.plan(key_of(range(20))) == (0, None, [8, 16, 20])
    for cut in (8, 16, 20):
        cache.store(key_of(range(cut)), cut, 100)
    # (parts after 11 ids: from the state after 8, a state kept at the branch, 11)
    assert cache.plan(key_of([*range(11), 99, 98])) == (8, 8, [11, 13])
    # (the same prompt again: nothing to prefill; a longer one: from its end)
    assert cache.plan(key_of(range(20))) == (20, 20, [])
    assert cache.plan(key_of(range(23))) == (20, 20, [23])
    # (an id past a byte, BOS, differs from every byte: keys are ids, exact)
    assert cache.plan(key_of([256, 1])) == (0, None, [2])
    # (a look, counting nothing: the ids the longest stored prefix covers)
    assert [cache.cached(key_of(ids)) for ids in ([*range(11), 99], range(23), [7])] == \
        [8, 20, 0]
    assert (cache.queries, cache.hits, cache.ids_saved) == (5, 3, 8 + 20 + 20)


def test_least_recently_used_is_evicted():
    """Least recently used out first; a key's own bytes count with its value's (2 a key
    here: one id)."""
    cache = PrefixCache(306, every=1000)
    for i in range(3):
        cache.store(key_of([i]), i, 100)
    cache.plan(key_of([0, 5]))              # (uses [0]: [1] is now the oldest)
    cache.store(key_of([3]), 3, 100)
    assert cache.plan(key_of([1, 5])).value is None
    assert [cache.plan(key_of([i, 5])).value for i in (0, 2, 3)] == [0, 2, 3]
    assert cache.nbytes == 306 and len(cache) == 3 and cache.evictions == 1
    cache.store(key_of([9]), 9, 305)        # (with its key, larger than the whole cache)
    assert len(cache) == 3
    with pytest.raises(ValueError):
        PrefixCache(-1)


def shared_requests(rng: random.Random, base: bytes, n: int, seed: int) -> list:
    out = []
    for i in range(n):
        keep = rng.choice([0, 1, 5, 63, 64, 65, len(base) // 2, len(base)])
        tail = bytes(rng.randrange(256) for _ in range(rng.choice([0, 1, 3, 40])))
        prompt = base[:keep] + tail or b"x"
        out.append(Completion(prompt=prompt, max_tokens=rng.randrange(1, 24),
                              temperature=rng.choice([0.0, 0.7, 1.3]),
                              top_k=rng.choice([None, 5]), top_p=rng.choice([None, 0.9]),
                              seed=seed + i))
    return out


def test_a_hit_changes_no_byte(tiny_model):
    """Prompts sharing prefixes of many lengths with each other (states on a grid of 64
    ids, at branch points and at prompts' ends), greedy and seeded, one at a time and in a
    crowd: every stream's bytes are generate's, and most prompts hit."""
    packed = PackedLM(tiny_model)
    rng = random.Random(3)
    base = bytes(rng.randrange(256) for _ in range(300))
    requests = shared_requests(rng, base, 40, 1000)
    rows = DecoderRows(packed, 6, tiny_model.config.bos_token, PrefixCache(1 << 24, every=64))
    engine = Engine(rows, tiny_model.config.bos_token)
    try:
        alone = [bytes(job.generated) for req in requests[:20]
                 for job in run_all(engine, [req])]
        crowd = run_all(engine, requests[20:] + requests[:5])
    finally:
        assert engine.close(timeout=TIMEOUT)
    want = [expected(tiny_model, packed, req) for req in requests]
    assert alone == want[:20]
    assert [bytes(job.generated) for job in crowd] == want[20:] + want[:5]
    cache = rows.prefix_cache
    assert cache.queries == 45 and cache.hits >= 30 and cache.ids_saved > 0


def test_make_rows_keeps_states_only_for_a_decoder_cut_anywhere(tiny_model):
    assert make_rows(tiny_model, "float32", 2, 1 << 20).prefix_cache is not None
    assert make_rows(tiny_model, "eager", 2, 1 << 20).prefix_cache is None
    assert make_rows(tiny_model, "float32", 2, 0).prefix_cache is None


def _samples(text: str) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line and not line.startswith("#")}


def test_the_server_reuses_prompts_and_counts_it(server):
    """On by default (the fused decoder): the same long prompt twice, then one sharing part
    of it: the same bytes as without a hit, and /metrics counts the queries, hits and ids
    saved."""
    c = server.client
    c.wait_idle()
    before = _samples(c.request("GET", "/metrics").body.decode())
    prompt = "The prefix cache keeps the state after a prompt. " * 4
    texts = [c.complete(prompt=p, max_tokens=12, temperature=0.9, seed=5).json()
             ["choices"][0]["text"] for p in (prompt, prompt, prompt[:100] + "Q?")]
    c.wait_idle()
    after = _samples(c.request("GET", "/metrics").body.decode())
    gained = {k: after[k] - before.get(k, 0) for k in after}
    assert texts[0] == texts[1]
    assert gained["fastrwa_prefix_cache_queries_total"] == 3
    assert gained["fastrwa_prefix_cache_hits_total"] >= 1
    assert gained["fastrwa_prefix_cache_tokens_saved_total"] >= len(prompt)
    assert after["fastrwa_prefix_cache_bytes"] > 0


def test_the_command_line_options():
    """--prefix-cache-mb and --prefill-chunk: their defaults, 0 turns each off, a negative
    value is refused naming it."""
    from pathlib import Path

    from fastrwa.serve.cli import PREFILL_CHUNK, PREFIX_CACHE_MB, check_args, parser
    from fastrwa.serve.prefix_cache import megabytes

    args = parser().parse_args(["somewhere"])
    assert (args.prefix_cache_mb, args.prefill_chunk) == (PREFIX_CACHE_MB, PREFILL_CHUNK)
    assert megabytes(args.prefix_cache_mb) == int(PREFIX_CACHE_MB * 2 ** 20)
    assert megabytes(0) == 0
    for option, value in (("--prefix-cache-mb", "-1"), ("--prefill-chunk", "-1"),
                          ("--prefix-cache-mb", "inf"), ("--prefix-cache-mb", "nan")):
        bad = parser().parse_args([str(Path("somewhere")), option, value])
        with pytest.raises(ValueError, match=option):
            check_args(bad)


def test_long_prompts_arriving_together_reuse_each_others_prefix(tiny_model):
    """Long prompts with one shared prefix submitted at once, prefilled in pieces: each is
    looked up in the prefix cache when its first piece runs, not when it arrives, so all but
    the first start from the shared prefix's state (they were all planned against an empty
    cache and all missed); the bytes are generate's."""
    from fastrwa.models import PackedLM

    from .test_engine import run_checked

    packed = PackedLM(tiny_model)
    rng = random.Random(4)
    shared = bytes(rng.randrange(256) for _ in range(300))
    requests = [Completion(prompt=shared + bytes([i, 7, i]), max_tokens=3, seed=i)
                for i in range(6)]
    cache = PrefixCache(1 << 24, every=100)
    run_checked(tiny_model, packed, packed, requests, 8, cache, prefill_chunk=64)
    assert cache.queries == 6 and cache.hits >= 5, (cache.queries, cache.hits)


def test_a_long_prompt_mostly_cached_is_not_held_behind_one_in_pieces(tiny_model):
    """Whether a prompt is prefilled in pieces depends on the ids left to prefill after its
    longest cached prefix, not on its length: a prompt longer than the chunk whose rest is
    within it is prefilled whole at admission, not queued behind a long prompt being
    prefilled in pieces; the bytes are generate's."""
    from .test_engine import run_checked

    packed = PackedLM(tiny_model)
    rng = random.Random(5)
    shared = bytes(rng.randrange(256) for _ in range(300))
    cache = PrefixCache(1 << 24, every=100)
    run_checked(tiny_model, packed, packed, [Completion(prompt=shared, max_tokens=1, seed=0)],
                4, cache, prefill_chunk=64)
    finished: list = []
    hits = cache.hits
    engine = Engine(DecoderRows(packed, 4, 256, cache), 256, prefill_chunk=64,
                    notify=lambda jobs: finished.extend(
                        j.number for j in jobs if j.finish is not None and
                        j.number not in finished))
    requests = [Completion(prompt=bytes(rng.randrange(256) for _ in range(2000)),
                           max_tokens=2, seed=1),
                Completion(prompt=shared + b"?!", max_tokens=2, seed=2)]
    try:
        jobs = run_all(engine, requests)
    finally:
        assert engine.close(timeout=TIMEOUT)
    assert [bytes(job.generated) for job in jobs] == \
        [expected(tiny_model, packed, req) for req in requests]
    assert finished == [jobs[1].number, jobs[0].number]
    assert cache.hits == hits + 1           # (the second, from the state after `shared`)
