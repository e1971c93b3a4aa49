"""The compiled CPU backend ("numba") beyond the shared op tests: its float32 math functions,
bfloat16 conversion, many chunks and channel blocks, packed sequences, threads, and the
paths the autograd op does not take by default."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from numba import njit

import fastrwa
from fastrwa.kernels.cpu.fmath import fexp, flog, flog1p, load, log_sigmoid, store
from fastrwa.ops import numba_host
from fastrwa.ops.dispatch import ScanArgs
from fastrwa.testing import backend_options
from helpers import (ATTENTIONS, TOL, assert_close, compare_gradients, in_forked_child,
                     make_inputs, make_state, reference, run)

pytestmark = pytest.mark.usefixtures("numba_backend")


@pytest.fixture
def numba_backend():
    with fastrwa.use_backend("numba"):
        yield


@njit
def _apply(which, x, out):
    for i in range(x.size):
        if which == 0:
            out[i] = fexp(x[i])
        elif which == 1:
            out[i] = flog(x[i])
        elif which == 2:
            out[i] = flog1p(x[i])
        else:
            out[i] = log_sigmoid(x[i])


def _log_sigmoid64(x):
    return np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))


@pytest.mark.parametrize("which,sample,exact,tol", [
    (0, lambda r: r.uniform(-87, 0, 200_000), np.exp, 3e-7),
    (1, lambda r: np.exp(r.uniform(-100, 88, 200_000)), np.log, 3e-7),
    (2, lambda r: np.exp(r.uniform(-40, 0, 200_000)), np.log1p, 4e-7),
    (3, lambda r: r.uniform(-100, 100, 200_000), _log_sigmoid64, None),
])
def test_float32_math_matches_float64(which, sample, exact, tol):
    """Relative error of exp/log/log1p; log_sigmoid's error is absolute (it is a log-weight)."""
    x = sample(np.random.default_rng(which)).astype(np.float32)
    out = np.empty_like(x)
    _apply(which, x, out)
    want = exact(x.astype(np.float64))
    err = np.abs(out - want)
    if tol is None:     # 1.6e-7 of the polynomial, plus float32 rounding of the result
        assert (err - 1.2e-7 * np.abs(want)).max() < 2e-7
    else:
        keep = np.abs(want) > 1e-37
        assert (err[keep] / np.abs(want[keep])).max() < tol


def test_float32_math_special_values():
    x = np.array([-np.inf, np.inf, np.nan, 0.0, -1.0, -87.2, -88.0, 1e-45], np.float32)
    out = np.empty_like(x)
    _apply(0, x, out)
    np.testing.assert_array_equal(out[[0, 1, 3, 6]], [0.0, np.inf, 1.0, 0.0])
    assert np.isnan(out[2]) and out[5] > 0
    _apply(1, x, out)
    np.testing.assert_array_equal(out[[1, 3]], [np.inf, -np.inf])
    assert np.isnan(out[[0, 2, 4]]).all()
    assert abs(out[7] - np.log(np.float64(x[7]))) < 1e-4   # subnormal input


@njit
def _round_trip(src, dst, tmp):
    for i in range(src.size):
        tmp[i] = load(src, np.uint64(i), np.float32(0))
    for i in range(src.size):
        store(dst, np.uint64(i), tmp[i])


def test_bfloat16_widen_and_round_to_nearest_even():
    f = torch.cat([torch.randn(5000) * 1e3, torch.tensor([1e38, -1e-40, 0.0, float("inf"),
                                                        float("-inf"), float("nan")])])
    f = torch.cat([f, f.bfloat16().float() + 2.0 ** -9])   # ties and near-ties
    dst = np.empty(f.numel(), np.uint16)
    widened = np.empty(f.numel(), np.float32)
    bits = lambda t: t.view(torch.int16).numpy().view(np.uint16)
    _round_trip(f.numpy(), dst, widened)     # float32 -> bfloat16
    got = torch.from_numpy(dst.view(np.int16)).view(torch.bfloat16)
    want = f.bfloat16()
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~want.isnan()], want[~want.isnan()])
    _round_trip(bits(want), dst, widened)    # bfloat16 -> float32 -> bfloat16
    assert torch.equal(torch.from_numpy(widened)[~want.isnan()], want.float()[~want.isnan()])


@pytest.mark.parametrize("kind,attention", [("rwa", "exp")] + [("rda", a) for a in ATTENTIONS])
@pytest.mark.parametrize("reverse", [False, True])
def test_many_chunks_and_ragged_channel_blocks(kind, attention, reverse):
    z, a, g = make_inputs(3, 101, 11, attention=attention, seed=3)
    g = None if kind == "rwa" else g
    state = make_state(3, 11)
    y, final = run(z, a, g, attention, state, final=True, reverse=reverse, chunk=7)
    y_ref, final_ref = reference(z, a, g, attention, state, reverse)
    assert_close(y, y_ref, 1e-12, "y")
    assert_close(final.average(), final_ref.average(), 1e-12, "state")
    with backend_options("numba", block=4):
        compare_gradients(z, a, g, attention, state, reverse, 7, torch.float64)
        compare_gradients(z, a, g, attention, state, reverse, 7, torch.float32)


@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "split-over-threads"])
@pytest.mark.parametrize("reverse", [False, True])
def test_packed_sequences_across_chunk_edges(reverse, split, monkeypatch):
    """Also split over two threads (threshold lowered): uneven sequences, initial states and
    gradients, the tasks taken by the caller's and the pool's threads."""
    if split:
        monkeypatch.setattr(numba_host, "SERIAL_BELOW", 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    cu = torch.tensor([0, 0, 1, 9, 30, 31, 47])
    z, a, g = make_inputs(1, 47, 5, attention="sigmoid", seed=4)
    state = make_state(6, 5)
    y, final = run(z, a, g, "sigmoid", state, final=True, reverse=reverse, chunk=4,
                   cu_seqlens=cu)
    y_ref, final_ref = reference(z, a, g, "sigmoid", state, reverse, cu)
    assert_close(y, y_ref, 1e-12, "y")
    assert_close(final.average(), final_ref.average(), 1e-12, "state")
    compare_gradients(z, a, g, "sigmoid", state, reverse, 4, torch.float64, cu_seqlens=cu)


def test_thread_count_does_not_change_results():
    z, a, g = make_inputs(4, 50, 64, dtype=torch.float32, seed=8)
    previous = torch.get_num_threads()
    outs = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(fastrwa.rda_scan(z, a, g, "softplus")[0])
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(outs[0], outs[1])


def test_backward_without_saved_states_recomputes_them():
    """``saved = []`` (a forward run without saving) must still give the right gradients."""
    z, a, g = make_inputs(2, 40, 3, seed=9)
    gy = torch.randn(2, 40, 3, dtype=torch.float64)
    args = ScanArgs(z, a, g, "exp", "sigmoid", None, False, None)
    with backend_options("numba", chunk=6):
        y, final, saved = numba_host.forward(args, output_final_state=True, save=True)
        full = numba_host.backward(args, saved, final[0], gy, None)
        again = numba_host.backward(args, [], final[0], gy, None)
    for x, x2 in zip(full[:3], again[:3]):
        assert torch.equal(x, x2)


def test_non_contiguous_inputs():
    z, a, g = (x.transpose(1, 2) for x in make_inputs(2, 6, 30, dtype=torch.float32, seed=2))
    assert not z.is_contiguous()
    y, _ = fastrwa.rda_scan(z, a, g)
    y_ref, _ = reference(z, a, g)
    assert_close(y, y_ref, TOL[torch.float32]["y"], "y")


def test_masked_prefix_and_zero_discount_give_zero_not_nan():
    z, a, g = make_inputs(1, 12, 3, dtype=torch.float32, seed=6)
    a[:, :5] = float("-inf")
    g[:, 8] = float("-inf")          # gamma = 0: forget everything before step 8
    y, final = fastrwa.rda_scan(z, a, g, output_final_state=True)
    y_ref, _ = reference(z, a, g)
    assert torch.equal(y[:, :5], torch.zeros_like(y[:, :5]))
    assert_close(y, y_ref, TOL[torch.float32]["y"], "y")
    y, final = fastrwa.rwa_scan(z[:, :5], a[:, :5], output_final_state=True)
    assert torch.isneginf(final.m).all() and (final.d == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_decayed_past_reaches_zero_not_the_smallest_subnormal(dtype):
    """A discounted past with no new content decays by gamma per step, in the forward
    (``n~``) and in the backward (the adjoint): both must reach 0 where the float64 reference
    is below the dtype's smallest normal number. ``x * gamma`` rounds back to ``x`` for the
    smallest subnormal ``x`` and ``gamma > 1/2``: unflushed, the decay stops there and fills
    the state and every later gradient with subnormals (20x slower matrix products on x86)."""
    B, T, D, content = 2, 700 if dtype == torch.float32 else 5000, 4, 5
    gamma = 0.75                                       # the paper's discount bias of ~1
    z = torch.zeros(B, T, D, dtype=dtype)
    z[:, :content] = torch.randn(B, content, D, dtype=dtype,
                                 generator=torch.Generator().manual_seed(7))
    a = torch.zeros(B, T, D, dtype=dtype)              # equal weights: d~ = 1 / (1 - gamma)
    g = torch.full((B, T, D), math.log(gamma / (1 - gamma)), dtype=dtype)
    z.requires_grad_()
    y, final = fastrwa.rda_scan(z, a, g, output_final_state=True)
    y[:, -1].sum().backward()                          # a loss on the last step only
    # where the reference's value is far below tiny (gamma^k < tiny * 1e-3), exactly 0
    k = math.ceil(math.log(torch.finfo(dtype).tiny * 1e-3) / math.log(gamma))
    assert T - content > k
    assert torch.equal(final.n, torch.zeros_like(final.n)), "n~ stopped above 0"
    assert torch.equal(y[:, content + k:], torch.zeros_like(y[:, content + k:]))
    assert torch.equal(z.grad[:, :T - k], torch.zeros_like(z.grad[:, :T - k])), \
        "the adjoint stopped above 0"
    # (n~ is flushed where |y| < tiny, so y has none; a stuck decay gives T - k per channel)
    tiny = torch.finfo(dtype).tiny
    for what, x in (("y", y), ("z.grad", z.grad)):
        subnormal = ((x != 0) & (x.abs() < tiny)).sum().item()
        assert subnormal == 0, f"{what}: {subnormal} subnormal entries"
    z_ref = z.detach().double().requires_grad_()
    y_ref, _ = reference(z_ref, a, g)
    y_ref[:, -1].sum().backward()
    assert_close(y, y_ref, TOL[dtype]["y"], "y")
    assert_close(z.grad, z_ref.grad, TOL[dtype]["grad"], "z.grad")


def test_the_flush_is_relative_to_the_denominator():
    """A state of one's own with a subnormal ``n~`` and ``d~`` (average 0.5) keeps its
    average through masked steps: only ``|n~ / d~|`` below the smallest normal is flushed."""
    B, T, D = 1, 3, 2
    z, g = torch.zeros(B, T, D), torch.zeros(B, T, D)
    a = torch.full((B, T, D), float("-inf"))           # masked: the state passes unchanged
    state = fastrwa.ScanState(torch.zeros(B, D), torch.full((B, D), 1e-39),
                              torch.full((B, D), 2e-39))
    y, _ = fastrwa.rda_scan(z, a, g, initial_state=state)
    assert torch.equal(y, torch.full_like(y, 0.5))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 40), D=st.integers(1, 9),
       chunk=st.integers(1, 9), block=st.integers(1, 9), attention=st.sampled_from(ATTENTIONS),
       rda=st.booleans(), reverse=st.booleans(), with_state=st.booleans())
def test_random_shapes(B, T, D, chunk, block, attention, rda, reverse, with_state):
    attention = attention if rda else "exp"    # without a discount the op is RWA: exp weights
    z, a, g = make_inputs(B, T, D, attention=attention, seed=B * 1000 + T * 10 + D)
    g = g if rda else None
    state = make_state(B, D) if with_state else None
    with backend_options("numba", block=block):
        y, _ = run(z, a, g, attention, state, reverse=reverse, chunk=chunk)
        y_ref, _ = reference(z, a, g, attention, state, reverse)
        assert_close(y, y_ref, 1e-12, "y")
        compare_gradients(z, a, g, attention, state, reverse, chunk, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_large_calls_split_over_threads_give_the_serial_results(dtype, monkeypatch):
    """Above SERIAL_BELOW the caller's thread and the pool's take the tasks one at a time;
    the results are bit for bit what one thread gives, forward and backward."""
    z, a, g = make_inputs(4, 520, 256, dtype=dtype, seed=12)
    assert z.numel() >= numba_host.SERIAL_BELOW
    submitted, taken = [], []   # per pool submission: its tasks; the counter after it ran
    pool = numba_host.pool

    def spying_pool(workers):
        executor = pool(workers)
        submit = type(executor).submit.__get__(executor)     # (the pool's own, once)

        def spy(fn, claim, order, *args):
            submitted.append(len(order))

            def run():
                fn(claim, order, *args)
                taken.append((len(order), int(claim[0])))
            return submit(run)
        monkeypatch.setattr(executor, "submit", spy)
        return executor
    monkeypatch.setattr(numba_host, "pool", spying_pool)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    parallel = fastrwa_outputs(z, a, g)
    # fwd and bwd went to the pool too; every task taken (each thread's last claim finds
    # none left) where the pool thread ran
    assert len(submitted) >= 2 and all(n > 1 for n in submitted), submitted
    assert all(after >= n + 1 for n, after in taken), taken
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    serial = fastrwa_outputs(z, a, g)
    for x, x1 in zip(parallel, serial):
        assert torch.equal(x, x1)
    y_ref = reference(z.double(), a.double(), g.double(), "sigmoid")[0]
    assert_close(parallel[0].double(), y_ref, TOL[dtype]["y"], "y")


def test_a_thread_that_starts_late_leaves_the_tasks_to_the_others(monkeypatch):
    """A pool thread that starts late (its core busy) finds every task taken by the
    caller's thread: the call does not wait for it to do a share, and the results are the
    serial ones."""
    import threading
    z, a, g = make_inputs(4, 520, 256, dtype=torch.float32, seed=13)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    serial = fastrwa_outputs(z, a, g)
    pool, found = numba_host.pool, []
    started, done = threading.Event(), threading.Event()

    def late_pool(workers):
        executor = pool(workers)
        submit = type(executor).submit.__get__(executor)     # (the pool's own, once)

        def late(fn, claim, order, *args):
            def run():
                started.set()
                done.wait(60)               # (until the caller has taken every task)
                found.append(int(claim[0]) >= len(order))
                fn(claim, order, *args)
            return submit(run)
        monkeypatch.setattr(executor, "submit", late)
        return executor

    real = numba_host.forward_kernel

    def caller_side(claim, order, *args):   # once the pool thread runs: the caller's part,
        started.wait(60)                    # then the pool thread's release
        real(claim, order, *args)
        done.set()
    monkeypatch.setattr(numba_host, "pool", late_pool)
    monkeypatch.setattr(numba_host, "forward_kernel", caller_side)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    with torch.no_grad():
        y, _ = fastrwa.rda_scan(z, a, g, "sigmoid")
    assert found == [True] and torch.equal(y, serial[0])


def fastrwa_outputs(z, a, g):
    z, a, g = (x.clone().requires_grad_() for x in (z, a, g))
    y = fastrwa.rda_scan(z, a, g, "sigmoid")[0]
    return (y, *torch.autograd.grad(y, (z, a, g), torch.ones_like(y)))


@pytest.mark.parametrize("work,n_blk", [([1, 1000], 1), ([1000, 1], 1), ([5, 0, 7], 3),
                                        ([400_000], 2)])
def test_every_task_runs_once_however_uneven_the_work(work, n_blk, monkeypatch):
    """The threads of a call take every task exactly once from the shared counter
    (``sync.next_task``), the longest first, however uneven the work, and the caller's
    thread takes part."""
    import threading
    from fastrwa.kernels.cpu.sync import next_task

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    ran, lock, callers = [], threading.Lock(), []

    def kernel(claim, order, tag):
        callers.append(threading.get_ident())
        while (k := int(next_task(claim))) < len(order):
            with lock:
                ran.append((k, int(order[k]), tag))
    numba_host._launch(kernel, np.array(work), n_blk, 1 << 17, ("x",))
    assert sorted(t for _, t, _ in ran) == list(range(len(work) * n_blk))
    steps = [max(1, work[t // n_blk]) for _, t, _ in sorted(ran)]     # in the order taken
    assert steps == sorted(steps, reverse=True)         # (the longest tasks first)
    # (a pool thread that had not started when the tasks were done was not waited for)
    assert threading.get_ident() in callers and 1 <= len(callers) <= 2


def test_a_forked_child_makes_its_own_pool(monkeypatch):
    """A forked child (a DataLoader worker) inherits the pool object without its threads: the
    pool records its pid, and a call from another pid builds a new one instead of waiting
    forever."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    z, a, g = make_inputs(4, 520, 256, dtype=torch.float32, seed=12)
    y = fastrwa.rda_scan(z, a, g)[0]
    ranges = numba_host._POOLS["ranges"]
    pool = ranges.executor
    assert pool is not None
    monkeypatch.setattr(ranges, "pid", -1)       # as seen from a forked child
    assert torch.equal(fastrwa.rda_scan(z, a, g)[0], y)
    assert ranges.executor is not pool


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_prefetching_kernels_give_the_same_bits(dtype, monkeypatch):
    """Large inputs take the forward and backward that prefetch what they read next
    (PREFETCH_ABOVE, lowered here): outputs, final states and gradients equal the plain
    kernels' bit for bit, dense and packed, forward and reverse, with strided rows, over
    several chunks."""
    z, a, g = make_inputs(3, 75, 40, dtype=dtype, seed=50)
    cu = torch.tensor([0, 7, 7, 75 + 75 + 75])

    def calls(z, a, g):
        gate = torch.cat([a, a], -1)[..., 40:]             # strided rows: a gate slice
        return [fastrwa.rda_scan(z, gate, g, "sigmoid", output_final_state=True),
                fastrwa.rda_scan(z, a, g, reverse=True, output_final_state=True),
                fastrwa.rwa_scan(z, a, output_final_state=True),
                fastrwa.rda_scan(z.reshape(1, -1, 40), a.reshape(1, -1, 40),
                                 g.reshape(1, -1, 40), cu_seqlens=cu, output_final_state=True)]

    def run():
        leaves = [x.clone().requires_grad_() for x in (z, a, g)]
        outs = calls(*leaves)
        loss = sum((y.float() * torch.linspace(-1, 1, y.shape[-1])).sum() +
                   sum(s.float().sum() for s in state[1:]) for y, state in outs)
        return outs, torch.autograd.grad(loss, leaves)

    aheads, launch = [], numba_host._launch

    def spy(kernel, *args):
        aheads.append((kernel.__name__, args[-1][-1]))     # the kernel's last argument
        return launch(kernel, *args)
    monkeypatch.setattr(numba_host, "_launch", spy)
    with fastrwa.use_backend("numba"):
        plain = run()
        monkeypatch.setattr(numba_host, "PREFETCH_ABOVE", 0)
        prefetched = run()
    ahead = numba_host.PREFETCH_AHEAD
    assert sorted(aheads) == sorted([("forward", 0)] * 4 + [("backward", 0)] * 4 +
                                    [("forward", ahead)] * 4 + [("backward", ahead)] * 4)
    for (y0, s0), (y1, s1) in zip(plain[0], prefetched[0]):
        assert torch.equal(y0, y1)
        for f0, f1 in zip(s0, s1):
            assert torch.equal(f0, f1)
    for g0, g1 in zip(plain[1], prefetched[1]):
        assert torch.equal(g0, g1)


def _scan_and_decode(inputs, model):
    """A scan large enough to split over threads, its gradients, and 12 greedy bytes from the
    fused decoder."""
    x = [t.clone().requires_grad_() for t in inputs]
    y = fastrwa.rda_scan(*x, "sigmoid")[0]
    grads = torch.autograd.grad(y.square().sum(), x)
    tokens = model.generate(torch.tensor([[72, 105]]), 12, top_k=1)
    return [t.detach() for t in (y, *grads, tokens)]


class _ForkedWork(torch.utils.data.Dataset):
    def __init__(self, inputs, model):
        self.inputs, self.model = inputs, model

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return _scan_and_decode(self.inputs, self.model)


def _scan_in_child(inputs, queue):
    # The tests' NaN poisoning fills buffers with a PyTorch op, which like every PyTorch
    # parallel op hangs in a raw fork child (GNU OpenMP): off here, as outside the tests.
    from fastrwa.ops import buffers
    buffers.set_poison(False)
    # as a NumPy array: a tensor would travel as a shared-memory handle the child's exit closes
    queue.put(fastrwa.rda_scan(*inputs, "sigmoid")[0].numpy())


def test_forked_children_compute_the_parents_results():
    """After the parent's pool threads and decoder ran: a process forked directly runs a scan
    split over its own new pool, and a forked DataLoader worker runs a scan, its gradients
    and greedy decoding; neither hangs, and each result equals the parent's bit for bit.
    (A raw fork child must not run PyTorch's own parallel ops: GNU OpenMP is not fork-safe,
    which is why DataLoader workers take one thread.)"""
    import multiprocessing
    import queue as queue_module
    import time
    from fastrwa.models import ByteLM, LMConfig
    inputs = make_inputs(4, 520, 256, dtype=torch.float32, seed=40)
    assert 4 * 520 * 256 >= numba_host.SERIAL_BELOW      # the calls split over the pool
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=32, n_layers=2)).eval()
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        want = _scan_and_decode(inputs, model)             # the parent, first
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_scan_in_child, args=(inputs, queue))
        child.start()
        got, deadline = None, time.monotonic() + 60
        try:
            while got is None and time.monotonic() < deadline:
                try:
                    got = queue.get(timeout=1)
                except queue_module.Empty:
                    if not child.is_alive():        # it died without an answer
                        break
        finally:
            child.join(timeout=10)
            if child.is_alive():                    # hung: the failure this test is for
                child.kill()
                child.join()
        assert got is not None, f"the forked child gave no result (exit code {child.exitcode})"
        assert child.exitcode == 0 and torch.equal(torch.from_numpy(got), want[0])
        loader = torch.utils.data.DataLoader(_ForkedWork(inputs, model), batch_size=None,
                                             num_workers=1, multiprocessing_context="fork",
                                             timeout=60)
        (got,) = list(loader)
    finally:
        torch.set_num_threads(previous)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_concurrent_calls_from_python_threads(monkeypatch):
    """Several Python threads scanning at once (a threaded server): each call launches its own
    team (or shares the pool) and every result equals the single-threaded one."""
    from concurrent.futures import ThreadPoolExecutor
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    inputs = [make_inputs(4, 520, 256, dtype=torch.float32, seed=20 + i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda x: fastrwa.rda_scan(*x, "sigmoid")[0], inputs * 2))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    for x, y in zip(inputs * 2, outs):
        assert torch.equal(y, fastrwa.rda_scan(*x, "sigmoid")[0])


@pytest.mark.parametrize("split", [False, True], ids=["one-thread", "split-over-threads"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
@pytest.mark.parametrize("layout", ["gate-slices", "time-major"])
def test_strided_rows_are_read_in_place(layout, dtype, split, monkeypatch):
    """Inputs whose channels are adjacent but whose rows are strided (gate slices of a
    projection, or a time-major tensor transposed), each input with its own strides, are read
    where they lie, not copied, and give the reference's outputs and gradients."""
    if split:
        monkeypatch.setattr(numba_host, "SERIAL_BELOW", 0)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    B, T, D = 3, 37, 5
    gen = torch.Generator().manual_seed(30)
    if layout == "gate-slices":     # z, a: slices of a (B, T, 2D) projection; g of a (B, T, 3D)
        bases = (torch.randn(B, T, 2 * D, generator=gen, dtype=torch.float64),
                 torch.randn(B, T, 3 * D, generator=gen, dtype=torch.float64))
        views = lambda p, q: (*p.split(D, dim=-1), q[..., D:2 * D])            # noqa: E731
    else:                           # z, a: (T, B, 2, D) transposed; g: (T, B, D) transposed
        bases = (torch.randn(T, B, 2, D, generator=gen, dtype=torch.float64),
                 torch.randn(T, B, D, generator=gen, dtype=torch.float64))
        views = lambda p, q: (p[:, :, 0].transpose(0, 1), p[:, :, 1].transpose(0, 1),  # noqa: E731
                              q.transpose(0, 1))
    weight = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
    leaves = [x.to(dtype).requires_grad_() for x in bases]
    z, a, g = views(*leaves)
    assert all(x.stride(2) == 1 and not x.is_contiguous() for x in (z, a, g))
    assert z.stride()[:2] != g.stride()[:2]
    copies = []
    contiguous = torch.Tensor.contiguous

    def counting(x, *args, **kw):
        if not x.is_contiguous():
            copies.append(tuple(x.shape))
        return contiguous(x, *args, **kw)
    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    y = fastrwa.rda_scan(z, a, g, "sigmoid")[0]
    grads = torch.autograd.grad((y.double() * weight).sum(), leaves)
    monkeypatch.setattr(torch.Tensor, "contiguous", contiguous)
    assert (B, T, D) not in copies, copies
    ref_leaves = [x.to(dtype).double().requires_grad_() for x in bases]
    y_ref = reference(*(x.contiguous() for x in views(*ref_leaves)), "sigmoid")[0]
    ref_grads = torch.autograd.grad((y_ref * weight).sum(), ref_leaves)
    assert_close(y, y_ref, TOL[dtype]["y"], "y")
    for got, want in zip(grads, ref_grads):
        assert_close(got, want, TOL[dtype]["grad"], "gradient of an input tensor")


def test_a_forked_child_runs_after_the_parent_used_the_pool():
    """fork() does not copy the pool's threads: the child makes its own pool and gets the
    parent's results, split over threads as in the parent."""
    z, a, g = make_inputs(4, 520, 256, dtype=torch.float32, seed=14)
    y = fastrwa_outputs(z, a, g)            # threaded, forward and backward, in the parent

    def child():        # the parent's outputs y are in the child's (copied) memory
        # PyTorch's own OpenMP ops hang in a child forked after they ran (PyTorch's
        # DataLoader sets one thread in its workers for this); fastrwa still splits its
        # calls over 2 threads, on a pool of the child's own.
        torch.set_num_threads(1)
        torch.get_num_threads = lambda: 2
        return [bool(torch.equal(x, want)) for x, want in zip(fastrwa_outputs(z, a, g), y)]

    assert in_forked_child(child) == [True] * 4, "the child's results differ from the parent's"


@pytest.mark.parametrize("plan,kernel", [("ForwardLaunch", "scan_fwd.forward"),
                                         ("BackwardLaunch", "scan_bwd.backward")])
def test_a_launch_names_the_kernels_arguments_in_their_order(plan, kernel):
    # The launcher builds a kernel's arguments by name and passes them by position: the
    # names and their order must be the kernel's (after the task counter and order).
    import importlib
    import inspect

    from fastrwa.ops import numba_host

    module, name = kernel.split(".")
    compiled = getattr(importlib.import_module(f"fastrwa.kernels.cpu.{module}"), name)
    wanted = list(inspect.signature(compiled.py_func).parameters)
    assert wanted[:2] == ["claim", "tasks"]
    assert list(getattr(numba_host, plan)._fields) == wanted[2:]
