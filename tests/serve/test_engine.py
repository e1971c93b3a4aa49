"""The engine without HTTP: a stream's bytes are ``ByteLM.generate``'s for the same prompt,
settings and seed, whatever else is in the batch (the fused decode step is batch-invariant
bit for bit); cancelled jobs free their rows; stop sequences are held back and cut."""

from __future__ import annotations

import copy
import random
import threading
import time

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, PackedLM
from fastrwa.serve.batcher import Engine, Job, QueueFull
from fastrwa.serve.rows import GREEDY_TEMPERATURE, make_rows
from fastrwa.serve.schema import Completion

TIMEOUT = 30


def expected(model, weights, req: Completion) -> bytes:
    """What generate makes of ``req`` (before any stop sequence)."""
    prompt = torch.tensor(list(req.prompt), dtype=torch.long)
    out = model.generate(prompt, req.max_tokens, req.temperature or GREEDY_TEMPERATURE,
                         req.top_k, req.top_p, weights=weights,
                         generator=torch.Generator().manual_seed(req.seed))
    return bytes(out[0, len(req.prompt):].tolist())


def random_request(rng: random.Random, seed: int) -> Completion:
    return Completion(prompt=bytes(rng.randrange(256) for _ in range(rng.randrange(0, 24))),
                      max_tokens=rng.randrange(1, 48),
                      temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
                      top_k=rng.choice([None, 1, 7, 300]), top_p=rng.choice([None, 0.3, 0.9]),
                      seed=seed)


def run_all(engine: Engine, requests) -> list[Job]:
    jobs = [engine.submit(r) for r in requests]
    for job in jobs:
        assert job.done.wait(TIMEOUT), "a job did not finish"
    return jobs


def run_checked(model, decoder, weights, requests, capacity: int, cache=None,
                prefill_chunk=None) -> list[Job]:
    """``requests`` through an engine over ``decoder``'s rows (``capacity`` of them, the
    prefix cache ``cache``, ``prefill_chunk``); every stream's bytes must be what
    ``generate`` makes with ``weights``. Returns the jobs."""
    from fastrwa.serve.rows import DecoderRows

    engine = Engine(DecoderRows(decoder, capacity, 256, cache), 256, prefill_chunk=prefill_chunk)
    try:
        jobs = run_all(engine, requests)
    finally:
        assert engine.close(timeout=TIMEOUT)
    assert engine.active == 0
    assert [bytes(job.generated) for job in jobs] == \
        [expected(model, weights, req) for req in requests]
    return jobs


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_fused_step_is_batch_invariant(weights):
    """A row's logits are the same bits at batch 1 and at batch 13 (rows in blocks of four
    and in the tail, split among threads): what lets a stream ignore its neighbours."""
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=48, n_layers=2)).eval()
    packed = PackedLM(model, weights)
    N = 13
    prompts = torch.randint(0, 256, (N, 5))
    batch = packed.allocate_cache(N)
    packed.prefill(prompts, batch)
    together = packed.step_(torch.arange(N) + 60, batch).clone()
    for i in range(N):
        one = packed.allocate_cache(1)
        packed.prefill(prompts[i:i + 1], one)
        alone = packed.step_(torch.tensor([60 + i]), one)
        assert torch.equal(alone[0], together[i]), f"row {i}"


def test_engine_matches_generate_alone_and_in_a_batch(tiny_model):
    """Greedy and seeded sampling (temperature, top_k, top_p): the bytes of a request alone,
    and inside batches of other random requests that come and go, are generate's."""
    packed = PackedLM(tiny_model)
    rng = random.Random(1)
    target = [Completion(prompt=b"hello", max_tokens=40, temperature=0.0, seed=3),
              Completion(prompt=b"", max_tokens=33, temperature=0.8, top_k=20, top_p=0.9,
                         seed=2 ** 64 - 1)]
    engine = Engine(make_rows(tiny_model, packed, 9), tiny_model.config.bos_token)
    try:
        alone = [bytes(job.generated) for job in run_all(engine, target)]
        others = [random_request(rng, 100 + i) for i in range(16)]
        mixed = run_all(engine, others[:8] + target + others[8:])
    finally:
        assert engine.close(timeout=TIMEOUT)
    for req, got, job in zip(target, alone, mixed[8:10]):
        assert got == bytes(job.generated) == expected(tiny_model, packed, req)
        assert job.finish == "length" and len(got) == req.max_tokens
    for req, job in zip(others[:8] + others[8:], mixed[:8] + mixed[10:]):
        assert bytes(job.generated) == expected(tiny_model, packed, req)
    assert engine.stats.admitted == 2 + 18


def test_eager_rows_match_generate(tiny_model):
    """The decoder of other devices and dtypes (the eager step over the whole cache): the
    same bytes as generate with weights='eager' on this small model (in general within
    float rounding: the products may pick other kernels at another batch)."""
    rows = make_rows(tiny_model, "eager", 4)
    assert not isinstance(rows.decoder, PackedLM)
    reqs = [random_request(random.Random(5), 7 + i) for i in range(3)]
    engine = Engine(rows, tiny_model.config.bos_token)
    try:
        jobs = run_all(engine, reqs)
    finally:
        engine.close(timeout=TIMEOUT)
    for req, job in zip(reqs, jobs):
        assert bytes(job.generated) == expected(tiny_model, "eager", req)


def test_cancelled_jobs_free_their_rows(tiny_model):
    engine = Engine(make_rows(tiny_model, "float32", 2), tiny_model.config.bos_token)
    try:
        long = [engine.submit(Completion(prompt=b"x", max_tokens=10 ** 9)) for _ in range(2)]
        waiting = engine.submit(Completion(prompt=b"y", max_tokens=5, seed=1))
        for job in long:
            job.cancel()
        assert waiting.done.wait(TIMEOUT) and waiting.finish == "length"
        assert all(job.done.wait(TIMEOUT) and job.finish == "cancelled" for job in long)
        assert engine.active == 0
    finally:
        assert engine.close(timeout=TIMEOUT)


def feed(stops, data: bytes, max_tokens: int = 1000) -> tuple[list, str | None]:
    """Released bytes after each byte fed to a job with ``stops``, and its finish."""
    job = Job(Completion(prompt=b"", max_tokens=max_tokens, stop=tuple(stops)), 256)
    out = []
    for b in data:
        done = job.accept(b)
        out.append(job.take()[0])
        if done:
            break
    return out, job.finish


def test_stop_sequences_are_held_back_and_cut():
    out, finish = feed([b"ab"], b"xaab!")
    assert out == [b"x", b"", b"a", b""] and finish == "stop"      # (the stop not released)
    out, finish = feed([b"aab"], b"aaab")          # a prefix of the stop occurs first
    assert b"".join(out) == b"a" and finish == "stop"
    out, finish = feed([b"\xc3\xa9!", b"zz"], "caf\u00e9 ok".encode())   # é, no "!" after it
    assert b"".join(out) == "caf\u00e9 ok".encode() and finish is None
    out, finish = feed([b"ab"], b"xxa", max_tokens=3)   # the length ends a held prefix
    assert b"".join(out) == b"xxa" and finish == "length"
    out, finish = feed([b"x"], b"x")               # a stop at the first byte: nothing
    assert out == [b""] and finish == "stop"


# -- faults, admission and the queue (scripted rows: no model) ------------------------------

def test_a_failed_admission_fails_its_job_only(script_rows):
    """A prefill that raises (not a ValueError: a defect, or a CUDA error) ends its own job
    with "error"; the jobs admitted in the same batch run on, none is left hanging."""
    engine = Engine(script_rows(4, prefill_error=b"X"), 256)
    try:
        with engine._cond:          # (all three wait when the engine wakes: one batch)
            jobs = [engine.submit(Completion(prompt=p, max_tokens=3)) for p in (b"a", b"X", b"b")]
        assert all(job.done.wait(5) for job in jobs), [job.finish for job in jobs]
        assert [job.finish for job in jobs] == ["length", "error", "length"]
        assert "scripted prefill failure" in jobs[1].error
        assert [bytes(job.generated) for job in (jobs[0], jobs[2])] == [b"aaa", b"bbb"]
        end = time.monotonic() + TIMEOUT        # (a job is done a moment before it leaves)
        while (engine.active, engine.queued) != (0, 0):
            assert time.monotonic() < end, (engine.active, engine.queued)
            time.sleep(0.001)
        # and the engine still serves
        again = engine.submit(Completion(prompt=b"c", max_tokens=2))
        assert again.done.wait(5) and bytes(again.generated) == b"cc"
    finally:
        assert engine.close(timeout=TIMEOUT)


def test_jobs_being_admitted_count_as_active(script_rows):
    """A job popped from the queue and being prefilled is neither lost from /stats nor
    from close(drain=False)."""
    gate = threading.Event()
    engine = Engine(script_rows(2, prefill_gate=gate), 256)
    try:
        job = engine.submit(Completion(prompt=b"a", max_tokens=10 ** 9))
        end = time.monotonic() + TIMEOUT
        while engine.queued:        # (popped by the engine, now waiting in its prefill)
            assert time.monotonic() < end
            time.sleep(0.001)
        assert engine.active == 1
    finally:
        gate.set()
        assert engine.close(drain=False, timeout=TIMEOUT)
    assert job.finish == "cancelled"


def test_max_queue_0_takes_jobs_while_rows_are_free(script_rows):
    """--max-queue 0: a job is taken while a row is free (none waits for one)."""
    engine = Engine(script_rows(2, step_delay=0.002), 256, max_queue=0)
    try:
        jobs = [engine.submit(Completion(prompt=b"a", max_tokens=10 ** 9)) for _ in range(2)]
        with pytest.raises(QueueFull):
            engine.submit(Completion(prompt=b"b", max_tokens=1))
        jobs[0].cancel()
        assert jobs[0].done.wait(TIMEOUT)
        last = engine.submit(Completion(prompt=b"c", max_tokens=2))
        assert last.done.wait(TIMEOUT) and bytes(last.generated) == b"cc"
    finally:
        assert engine.close(drain=False, timeout=TIMEOUT)


def test_cancelled_waiting_jobs_do_not_fill_the_queue(script_rows):
    engine = Engine(script_rows(1, step_delay=0.002), 256, max_queue=1)
    try:
        running = engine.submit(Completion(prompt=b"a", max_tokens=10 ** 9))
        waiting = engine.submit(Completion(prompt=b"b", max_tokens=3))
        waiting.cancel()                    # (its client left while it waited)
        later = engine.submit(Completion(prompt=b"c", max_tokens=3))   # not QueueFull
        assert waiting.done.wait(TIMEOUT) and waiting.finish == "cancelled"
        running.cancel()
        assert later.done.wait(TIMEOUT) and bytes(later.generated) == b"ccc"
    finally:
        assert engine.close(drain=False, timeout=TIMEOUT)


def test_step_rows_draw_on_the_logits_device(tiny_model):
    """The eager decoder (what runs on CUDA besides the graph): each job's generator is on
    the device of the rows' logits (a CPU generator cannot draw from CUDA logits), and the
    engine's bytes are generate's with a generator on that device."""
    rows = make_rows(tiny_model, "eager", 2)
    engine = Engine(rows, tiny_model.config.bos_token)
    try:
        req = Completion(prompt=b"hi", max_tokens=12, temperature=0.9, seed=4)
        job = engine.submit(req)
        assert job.done.wait(TIMEOUT) and job.finish == "length"
    finally:
        assert engine.close(timeout=TIMEOUT)
    assert job.sampling.generator.device == rows.device == tiny_model.embed.weight.device
    assert bytes(job.generated) == expected(tiny_model, "eager", req)


def test_job_generator_follows_the_device(monkeypatch):
    """Without a GPU here: a job for rows on CUDA asks for a CUDA generator."""
    made = []

    class Recorder:
        def __init__(self, device="cpu"):
            made.append(torch.device(device))

        def manual_seed(self, seed):
            return self
    monkeypatch.setattr(torch, "Generator", Recorder)
    Job(Completion(prompt=b"a", seed=1), 256, torch.device("cuda"))
    assert made == [torch.device("cuda")]


@pytest.mark.cuda
def test_engine_on_cuda_matches_generate_with_a_cuda_generator(tiny_model):
    """On CUDA (the graph decoder over every row): no error, and a seeded request's bytes
    are generate's with ``torch.Generator('cuda').manual_seed(seed)`` (greedy: exactly; a
    sampled one can differ where the batch's products round otherwise)."""
    model = copy.deepcopy(tiny_model).cuda()
    rows = make_rows(model, "auto", 4)
    reqs = [Completion(prompt=b"hello", max_tokens=20, temperature=0.0, seed=3),
            Completion(prompt=b"", max_tokens=20, temperature=0.8, top_k=20, seed=5)]
    engine = Engine(rows, model.config.bos_token)
    try:
        jobs = run_all(engine, reqs)
    finally:
        assert engine.close(timeout=TIMEOUT)
    assert [job.finish for job in jobs] == ["length", "length"], [job.error for job in jobs]
    prompt = torch.tensor(list(reqs[0].prompt), dtype=torch.long, device="cuda")
    want = model.generate(prompt, 20, GREEDY_TEMPERATURE,
                          generator=torch.Generator("cuda").manual_seed(3))
    assert bytes(jobs[0].generated) == bytes(want[0, len(reqs[0].prompt):].tolist())


def test_each_joiner_gets_its_first_byte_before_the_next_joiners_prefill(script_rows):
    """Prompts admitted at one step: each one's first byte is handed over (notify) as soon as
    its own prefill is done, not after every other joiner's (a chunked-prefill change had
    moved the hand-off after the loop, to the last joiner only)."""
    events, gate = [], threading.Event()

    class Recorded(script_rows):
        def prefill(self, context):
            super().prefill(context)
            events.append(("prefill", bytes(context[0].tolist())))

    engine = Engine(Recorded(4, prefill_gate=gate), 256,
                    notify=lambda jobs: events.append(
                        ("notify", [j.request.prompt for j in jobs])))
    try:
        first = engine.submit(Completion(prompt=b"a", max_tokens=2))
        time.sleep(0.2)                   # (the engine waits in the first prefill)
        later = [engine.submit(Completion(prompt=p, max_tokens=2)) for p in (b"b", b"c")]
        gate.set()
        for job in (first, *later):
            assert job.done.wait(TIMEOUT)
    finally:
        engine.close()
    assert events.index(("notify", [b"b"])) < events.index(("prefill", b"c")), events
