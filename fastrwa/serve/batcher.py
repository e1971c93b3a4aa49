"""The continuous-batching engine: one thread owns the model's rows (:mod:`.rows`) and loops

    admit waiting jobs into free rows (each prompt prefilled alone, its first byte drawn;
        a prompt with more than ``prefill_chunk`` ids left to prefill after its longest
        cached prefix: a chunk a loop, then admitted)
    drop the rows of jobs done or cancelled (the last row moves into the hole)
    one decode step over the rows in flight, then every row's draw in one call, each
        from its own settings and generator
    hand the new bytes to the consumers (one call of ``notify`` per step)

so a job joins at the next step and leaves the step its last byte is drawn (or the step
after its client went away). A job's bytes depend on its own prompt, settings and seed only
(:mod:`.rows`): ``ByteLM.generate(prompt, max_tokens, temperature, top_k, top_p,
generator=torch.Generator(device).manual_seed(seed))``'s, cut at the first stop sequence,
where ``device`` is the rows' (``rows.device``: the model's; on CUDA the draws are made there
as ``generate`` makes them, from a CUDA generator).

A job in the engine is waiting (the queue), being admitted (popped from the queue, its
prompt prefilled) or active (in a row); ``active`` counts the last two. ``submit`` takes a
job while fewer than ``capacity + max_queue`` are in the engine (so ``max_queue`` 0 still
takes a job while a row is free); a waiting job whose client left is dropped from the
queue when it is full. An exception that is not the model's ``ValueError`` (NaN logits)
fails the job it happened in (admission) or every active job (the step), is logged, and
the engine serves on.

Stop sequences are matched on bytes as they are drawn; the bytes that could be the start of
a stop sequence are held back until they cannot, and the stop sequence itself is never
released. The completion ends before the first match in the text: the first to end, and of
those ending at the same byte the one that starts first (the longest), whatever the order
of the request's list. The consumer (:mod:`.app`) decodes the released bytes as UTF-8.
"""

from __future__ import annotations

import collections
import itertools
import logging
import secrets
import threading
import time
from typing import Callable, Optional

import torch

from ..models.decoding import Sampling
from ..models.scoring import scores_of
from .rows import GREEDY_TEMPERATURE, PiecewiseRows, Rows
from .schema import Completion

log = logging.getLogger("fastrwa.serve")


class QueueFull(Exception):
    """The engine's queue is full (the server answers 503 with Retry-After)."""


class Closed(Exception):
    """The engine takes no more jobs (shutting down)."""


class Job:
    """One completion in the engine. The engine writes; a consumer calls :meth:`take` (any
    thread) after ``notify`` named the job or ``done`` is set, and :meth:`cancel` to free its
    row."""

    _ids = itertools.count()

    def __init__(self, request: Completion, bos_token: int,
                 device: torch.device = torch.device("cpu")):
        """``device``: where the job's logits are drawn from (its generator is made there)."""
        self.request = request
        self.number = next(self._ids)
        self.seed = request.seed if request.seed is not None else secrets.randbits(63)
        temperature = request.temperature or GREEDY_TEMPERATURE
        self.sampling = Sampling(temperature, request.top_k, request.top_p,
                                 torch.Generator(device).manual_seed(self.seed))
        prompt = list(request.prompt) or [bos_token]      # (an empty prompt: BOS, as generate)
        self.context = torch.tensor([prompt], dtype=torch.int64)
        self.stops = request.stop
        self.generated = bytearray()        # every byte drawn (engine thread only)
        # (with logprobs: per byte drawn, its (logprob, top ids, top logprobs) from the
        # logits its draw read, appended before the byte is released)
        self.scores: Optional[list] = [] if request.logprobs is not None else None
        self.released = 0                   # of them, handed out
        self.finish: Optional[str] = None   # "stop" | "length" | "cancelled" | "error"
        self.error: Optional[str] = None
        self.done = threading.Event()
        self.submitted = time.perf_counter()
        self.first_at: Optional[float] = None
        self.waker = None                   # the consumer's (app: an asyncio.Event)
        self._lock = threading.Lock()
        self._out = bytearray()             # released, not yet taken
        self.cancelled = False

    def cancel(self) -> None:
        """Stop generating (the client left): the row is freed before the next step."""
        self.cancelled = True

    def take(self) -> tuple[bytes, Optional[str]]:
        """The bytes released since the last call, and the finish reason once done (then
        the bytes are the last ones)."""
        with self._lock:
            out, self._out = bytes(self._out), bytearray()
            return out, self.finish

    # -- engine side ------------------------------------------------------------------------
    def _release(self, upto: int) -> None:
        if upto > self.released:
            with self._lock:
                self._out += self.generated[self.released:upto]
            self.released = upto

    def _end(self, reason: str, error: Optional[str] = None) -> None:
        with self._lock:
            self.finish, self.error = reason, error
        self.done.set()

    def score(self, logits: torch.Tensor, token: int) -> None:
        """Note ``token``'s log-probabilities under ``logits`` ``(1, V)``, the ones its draw
        read (a request with ``logprobs`` only: ``scores`` is a list)."""
        lp, ids, top = scores_of(logits, [token], self.request.logprobs)
        self.scores.append((float(lp[0]), ids[0].tolist(), top[0].tolist()))

    def accept(self, token: int) -> bool:
        """Add a drawn byte; True when the job is done."""
        gen = self.generated
        gen.append(token)
        if self.first_at is None:
            self.first_at = time.perf_counter()
        # (of the stop sequences ending at this byte, the longest starts first: the first
        # match in the text, whatever the order of the list)
        matched = max((stop for stop in self.stops if gen.endswith(stop)), key=len,
                      default=None)
        if matched is not None:
            self._release(len(gen) - len(matched))
            self._end("stop")
            return True
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(gen)), hold, -1):
                if gen.endswith(stop[:k]):       # (could be a stop's start: held back)
                    hold = k
                    break
        if len(gen) >= self.request.max_tokens:
            self._release(len(gen))
            self._end("length")
            return True
        self._release(len(gen) - hold)
        return False


class Stats:
    """Where the engine's time goes (seconds, cumulative; ``GET /stats``)."""

    def __init__(self) -> None:
        self.steps = self.rows_stepped = self.admitted = self.finished = 0
        self.prefill_s = self.step_s = self.draw_s = self.notify_s = 0.0
        self.busy_s = 0.0
        self.started = time.perf_counter()

    def as_dict(self) -> dict:
        """The counters, and ``uptime_s`` (seconds since the engine started)."""
        d = dict(vars(self))
        d["uptime_s"] = time.perf_counter() - d.pop("started")
        return d


class Engine:
    """Continuous batching over ``rows`` (:func:`fastrwa.serve.rows.make_rows`): at most
    ``rows.capacity`` jobs in flight and ``max_queue`` more waiting (module doc).
    ``notify(jobs)`` is called from the engine's thread after each step with the jobs that
    have new bytes or finished."""

    def __init__(self, rows: Rows, bos_token: int, max_queue: int = 256,
                 notify: Optional[Callable[[list], None]] = None,
                 prefill_chunk: Optional[int] = None):
        """``rows``: the batch's rows (:class:`fastrwa.serve.rows.DecoderRows`, or any
        object with its methods, ``capacity`` and ``tokens``; ``device``, where draws are
        made, is CPU if it has none);
        ``bos_token``: what an empty prompt starts from; ``max_queue`` >= 0;
        ``prefill_chunk``: a prompt with more ids than this left to prefill (after its
        longest cached prefix) is prefilled this many ids a loop, between the decode steps
        (the others whole at admission; rows that can:
        :class:`~fastrwa.serve.rows.PiecewiseRows`; ``None``: each prompt whole)."""
        if max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, got {max_queue}")
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
        self.rows, self.bos_token, self.max_queue = rows, bos_token, max_queue
        self.prefill_chunk = prefill_chunk if isinstance(rows, PiecewiseRows) else None
        self._prefilling: list = []         # (job, its rows.begin handle), first first
        self.capacity = rows.capacity
        self.device = torch.device(getattr(rows, "device", "cpu"))
        self.notify = notify
        self.stats = Stats()
        self._pending: collections.deque[Job] = collections.deque()
        self._admitting: list[Job] = []     # popped from _pending, not yet in a row or ended
        self._purged: list[Job] = []        # cancelled while waiting, dropped from _pending
        self._active: list[Job] = []        # job in row i
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._loop, name="fastrwa-serve-engine",
                                        daemon=True)
        self._thread.start()

    # -- consumers ------------------------------------------------------------------------
    def submit(self, request: Completion) -> Job:
        """A new job for ``request`` (``QueueFull``, ``Closed``). ``max_tokens`` 0 is done at
        once (no row)."""
        job = Job(request, self.bos_token, self.device)
        if request.max_tokens == 0:
            if self._closing:
                raise Closed("the server is shutting down")
            job._end("length")
            return job
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down")
            if self._in_engine() >= self.capacity + self.max_queue:
                self._purge()
                if self._in_engine() >= self.capacity + self.max_queue:
                    raise QueueFull(f"{len(self._pending)} requests are waiting for a row "
                                    f"(--max-queue {self.max_queue})")
            self._pending.append(job)
            self._cond.notify()
        return job

    def _in_engine(self) -> int:        # (under _cond)
        return len(self._pending) + len(self._admitting) + len(self._active)

    def _purge(self) -> None:           # (under _cond)
        """Drop the waiting jobs whose client left (the engine's thread ends them)."""
        if any(job.cancelled for job in self._pending):
            self._purged += [job for job in self._pending if job.cancelled]
            self._pending = collections.deque(job for job in self._pending if not job.cancelled)
            self._cond.notify()

    @property
    def active(self) -> int:
        """Jobs in a row or being admitted into one (their prompt prefilled)."""
        with self._cond:
            return len(self._active) + len(self._admitting)

    @property
    def queued(self) -> int:
        """Jobs waiting for a row."""
        with self._cond:
            return len(self._pending)

    @property
    def closing(self) -> bool:
        """True once :meth:`close` was called: :meth:`submit` raises ``Closed``."""
        return self._closing

    def close(self, drain: bool = True, timeout: Optional[float] = None) -> bool:
        """Take no more jobs; with ``drain`` finish those in flight and waiting, else cancel
        them. True when the engine's thread has ended within ``timeout``."""
        with self._cond:
            self._closing = True
            if not drain:
                for job in (*self._pending, *self._admitting, *self._active):
                    job.cancel()
            self._cond.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the engine's thread -----------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._active or self._purged or self._closing
                           or self._prefilling):
                    self._cond.wait()
                if self._closing and not self._pending and not self._active \
                        and not self._purged and not self._prefilling:
                    return
                free = self.capacity - len(self._active) - len(self._prefilling)
                joiners = [self._pending.popleft()
                           for _ in range(min(free, len(self._pending)))]
                self._admitting = [*(job for job, _ in self._prefilling), *joiners]
                purged, self._purged = self._purged, []
            began = time.perf_counter()
            updated: list[Job] = []
            for job in purged:
                job._end("cancelled")
                updated.append(job)
            try:
                for job in joiners:
                    if not self._begin(job):
                        self._admit_one(job, updated)
                        if self.notify is not None and len(joiners) > 1:
                            self.notify([job])      # (its first byte, before the others' prefill)
                if self._prefilling:
                    self._advance(updated)
                self._retire(updated)
                if self._active:
                    self._step(updated)
                    self._retire(updated)
            except Exception as exc:            # (a defect: fail the jobs, keep serving)
                log.exception("engine step failed")
                with self._cond:
                    failed, self._active, self._admitting = (
                        [*self._admitting, *self._active], [], [])
                    self._prefilling = []
                for job in failed:
                    if job.finish is None:
                        job._end("error", f"{type(exc).__name__}: {exc}")
                        updated.append(job)
            self.stats.busy_s += time.perf_counter() - began
            if updated and self.notify is not None:
                t = time.perf_counter()
                self.notify(updated)
                self.stats.notify_s += time.perf_counter() - t

    def _begin(self, job: Job) -> bool:
        """Start prefilling ``job``'s prompt in pieces if more than ``prefill_chunk`` of
        its ids are to be prefilled (past its longest prefix in the prefix cache now; True:
        it waits in ``_prefilling``, :meth:`_advance`)."""
        if self.prefill_chunk is None or job.cancelled \
                or job.context.shape[1] <= self.prefill_chunk:
            return False
        t = time.perf_counter()
        try:
            uncached = getattr(self.rows, "uncached", None)     # (optional: PiecewiseRows)
            if uncached is not None and uncached(job.context) <= self.prefill_chunk:
                return False
            self._prefilling.append((job, self.rows.begin(job.context)))
        except Exception:                   # (a defect: the prompt whole instead)
            log.exception("starting a prompt's prefill in pieces failed")
            return False
        finally:
            self.stats.prefill_s += time.perf_counter() - t
        return True

    def _advance(self, updated: list) -> None:
        """Prefill ``prefill_chunk`` more ids of the first prompt being prefilled in pieces;
        admit it once it is all in (its state and logits are its whole prefill's)."""
        job, pending = self._prefilling[0]
        done, t = job.cancelled, time.perf_counter()
        try:
            done = done or self.rows.advance(pending, self.prefill_chunk)
        except Exception as exc:            # (a defect: this job's)
            log.exception("prefilling a prompt failed")
            self._prefilling.pop(0)
            job._end("error", f"{type(exc).__name__}: {exc}")
            updated.append(job)
            with self._cond:
                self._admitting.remove(job)
            return
        finally:
            self.stats.prefill_s += time.perf_counter() - t
        if done:
            self._prefilling.pop(0)
            self._admit_one(job, updated, staged=True)

    def _admit_one(self, job: Job, updated: list, staged: bool = False) -> None:
        """Admit ``job`` (:meth:`_admit`); any error there fails this job only (logged)."""
        try:
            placed = self._admit(job, updated, staged)
        except Exception as exc:            # (a defect, or a device error: this job's)
            log.exception("admitting a job failed")
            job._end("error", f"{type(exc).__name__}: {exc}")
            placed = False
        with self._cond:                    # (from admitting to active at once: /stats)
            self._admitting.remove(job)
            if placed:
                self._active.append(job)

    def _admit(self, job: Job, updated: list, staged: bool = False) -> bool:
        """Prefill ``job``'s prompt (``staged``: it is, the rows' staged prompt) and draw
        its first byte; True when it goes on in row ``len(self._active)`` (placed there),
        False when it has ended."""
        updated.append(job)
        if job.cancelled:
            job._end("cancelled")
            return False
        rows, t = self.rows, time.perf_counter()
        try:
            if not staged:
                rows.prefill(job.context)
            token = rows.draw_staged(job.sampling)
            if job.scores is not None:
                job.score(rows.logits(), token)
        except ValueError as exc:               # (NaN logits: the model's fault, this job's)
            job._end("error", str(exc))
            return False
        finally:
            self.stats.prefill_s += time.perf_counter() - t
        self.stats.admitted += 1
        if job.accept(token):
            self.stats.finished += 1
            return False
        row = len(self._active)
        rows.place(row)
        rows.tokens[row] = token
        return True

    def _retire(self, updated: list) -> None:
        """Drop finished and cancelled jobs' rows, keeping rows ``[0, n)`` compact."""
        active, i = self._active, 0
        while i < len(active):
            job = active[i]
            if job.finish is None and not job.cancelled:
                i += 1
                continue
            last = len(active) - 1
            if i != last:
                self.rows.move(last, i)
            with self._cond:
                active[i] = active[last]
                active.pop()
            if job.finish is None:              # (ended once out: done, it counts no more)
                job._end("cancelled")
                updated.append(job)

    def _step(self, updated: list) -> None:
        rows, n = self.rows, len(self._active)
        t0 = time.perf_counter()
        rows.step(n)
        t1 = time.perf_counter()
        # every row's draw in one call, each with its job's own settings and generator
        drawn = rows.draw_rows([None if job.cancelled else job.sampling
                                for job in self._active])
        for row, job in enumerate(self._active):
            if job.cancelled:
                continue
            token = drawn[row]
            try:
                if isinstance(token, ValueError):
                    raise token
                if job.scores is not None:
                    job.score(rows.logits(row), token)
            except ValueError as exc:
                job._end("error", str(exc))
                updated.append(job)
                continue
            rows.tokens[row] = token
            if job.accept(token):
                self.stats.finished += 1
            updated.append(job)
        t2 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.rows_stepped += n
        st.step_s += t1 - t0
        st.draw_s += t2 - t1
