"""Fixtures of the server's tests: a tiny saved ByteLM, the real server as a subprocess
(``python -m fastrwa.serve``) on an ephemeral loopback port, an in-process server over a
scripted decoder (rows that replay the prompt's bytes: full control of the bytes for the
text and stop-sequence cases), and a small stdlib HTTP client with a timeout on every call.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import torch

pytest.importorskip("uvicorn")

from fastrwa.models import ByteLM, LMConfig  # noqa: E402
from fastrwa.serve.app import App  # noqa: E402
from fastrwa.serve.batcher import Engine  # noqa: E402
from fastrwa.serve.schema import Limits  # noqa: E402

TIMEOUT = 30.0          # every client call's (nothing hangs)
ROOT = Path(__file__).resolve().parents[2]


@dataclasses.dataclass
class Reply:
    status: int
    headers: dict
    body: bytes

    def json(self):
        return json.loads(self.body)

    def events(self) -> list:
        """The server-sent events' data, parsed (``[DONE]`` as the string)."""
        out = []
        for block in self.body.decode().split("\n\n"):
            if block.startswith("data: "):
                data = block[len("data: "):]
                out.append(data if data == "[DONE]" else json.loads(data))
        return out


class Client:
    """Requests to one server; a new connection per call unless ``conn`` is given."""

    def __init__(self, port: int, host: str = "127.0.0.1"):
        self.port, self.host = port, host

    def connect(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT)

    def request(self, method: str, path: str, body: object = None,
                conn: Optional[http.client.HTTPConnection] = None) -> Reply:
        own = conn is None
        conn = conn or self.connect()
        try:
            data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
            conn.request(method, path, data, {"content-type": "application/json"})
            r = conn.getresponse()
            return Reply(r.status, {k.lower(): v for k, v in r.getheaders()}, r.read())
        finally:
            if own:
                conn.close()

    def complete(self, conn=None, **fields) -> Reply:
        return self.request("POST", "/v1/completions", fields, conn)

    def health(self) -> dict:
        return self.request("GET", "/health").json()

    def wait_idle(self, timeout: float = TIMEOUT) -> dict:
        end = time.monotonic() + timeout
        while True:
            h = self.request("GET", "/stats").json()
            if h["active"] == 0 and h["queued"] == 0:
                return h
            if time.monotonic() > end:
                raise AssertionError(f"the server did not go idle: {h}")
            time.sleep(0.02)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("tiny")
    ByteLM(LMConfig(d_model=32, n_layers=2)).eval().save_pretrained(directory)
    return directory


@pytest.fixture(scope="session")
def tiny_model(tiny_dir) -> ByteLM:
    return ByteLM.load(tiny_dir)


class ServerProcess:
    """``python -m fastrwa.serve DIR --port 0 ...`` in a subprocess; ``url``: the one its
    ready line prints."""

    def __init__(self, directory: Path, *options: str):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastrwa.serve", directory, "--port", "0", *options],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT, env=env, text=True,
            errors="replace")
        self.line = self._first_line()
        match = re.search(r"(http://(127\.0\.0\.1|\[[0-9a-f:]+\]):(\d+))$", self.line)
        if not match:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {self.line!r} "
                                 f"{self.proc.stderr.read()}")
        self.url = match.group(1)
        self.client = Client(int(match.group(3)), match.group(2).strip("[]"))

    def _first_line(self) -> str:
        found: list = []
        reader = threading.Thread(target=lambda: found.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(60)
        return found[0] if found else ""

    def rss(self) -> int:
        """The server's resident memory in bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise AssertionError("no VmRSS")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdout, self.proc.stderr):
            stream.close()


@pytest.fixture(scope="module")
def server(tiny_dir):
    """The real server on the tiny model, 16 rows."""
    s = ServerProcess(tiny_dir, "--max-batch", "16", "--max-queue", "256",
                      "--max-tokens-limit", "100000", "--max-prompt-bytes", "1000")
    yield s
    s.stop()


class ScriptRows:
    """Rows whose stream replays its prompt's bytes over and over (``step_delay`` seconds a
    step): a decoder for the engine with no model. Faults on demand: ``prefill_error``, a
    prompt whose prefill raises ``RuntimeError``; ``draw_error``, a byte whose draw (after
    the first) raises ``ValueError`` (as NaN logits do); ``prefill_gate``, an event each
    prefill waits for."""

    kind = "script"

    def __init__(self, capacity: int, step_delay: float = 0.0,
                 prefill_error: Optional[bytes] = None, draw_error: Optional[int] = None,
                 prefill_gate: Optional[threading.Event] = None):
        self.capacity, self.step_delay = capacity, step_delay
        self.prefill_error, self.draw_error = prefill_error, draw_error
        self.prefill_gate = prefill_gate
        self.tokens = np.zeros(capacity, dtype=np.int64)
        self.rows: list = [None] * capacity
        self._staged = None

    def prefill(self, context):
        if self.prefill_gate is not None:
            assert self.prefill_gate.wait(TIMEOUT)
        prompt = bytes(context[0].tolist())
        if prompt == self.prefill_error:
            raise RuntimeError(f"scripted prefill failure on {prompt!r}")
        self._staged = [prompt, 0]

    def draw_staged(self, sampling):
        return self._next(self._staged)

    def place(self, row):
        self.rows[row] = self._staged

    def move(self, src, dst):
        self.rows[dst] = self.rows[src]
        self.tokens[dst] = self.tokens[src]

    def step(self, n):
        if self.step_delay:
            time.sleep(self.step_delay)

    def draw(self, row, sampling):
        token = self._next(self.rows[row])
        if token == self.draw_error:
            raise ValueError(f"scripted draw failure on byte {token}")
        return token

    def draw_rows(self, samplings):
        out = [None] * len(samplings)
        for row, sampling in enumerate(samplings):
            if sampling is not None:
                try:
                    out[row] = self.draw(row, sampling)
                except ValueError as exc:
                    out[row] = exc
        return out

    @staticmethod
    def _next(state) -> int:
        script, i = state
        state[1] += 1
        return script[i % len(script)]


class InProcess:
    """An :class:`App` over :class:`ScriptRows` on uvicorn in a thread."""

    def __init__(self, capacity: int = 4, max_queue: int = 8, step_delay: float = 0.0,
                 limits: Limits = Limits(max_prompt_bytes=1000, max_tokens_limit=100000),
                 **faults):
        import socket

        import uvicorn
        self.rows = ScriptRows(capacity, step_delay, **faults)
        self.app = App(lambda notify: Engine(self.rows, 256, max_queue, notify), "script",
                       limits)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(256)
        self.client = Client(sock.getsockname()[1])
        config = uvicorn.Config(self.app, lifespan="on", access_log=False, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[sock]),
                                       daemon=True)
        self.thread.start()
        end = time.monotonic() + TIMEOUT
        while not self.server.started:
            assert time.monotonic() < end, "the in-process server did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(TIMEOUT)


@pytest.fixture(scope="module")
def script_server():
    s = InProcess(capacity=4, max_queue=64)
    yield s
    s.stop()


@pytest.fixture
def in_process():
    """A factory of :class:`InProcess` servers, stopped after the test."""
    made = []

    def make(**options) -> InProcess:
        made.append(InProcess(**options))
        return made[-1]
    yield make
    for s in made:
        s.stop()


@pytest.fixture
def server_process():
    """A factory of :class:`ServerProcess` servers, stopped after the test."""
    made = []

    def make(directory, *options) -> ServerProcess:
        made.append(ServerProcess(directory, *options))
        return made[-1]
    yield make
    for s in made:
        s.stop()


@pytest.fixture
def script_rows():
    """The :class:`ScriptRows` class (for engine tests without HTTP)."""
    return ScriptRows
