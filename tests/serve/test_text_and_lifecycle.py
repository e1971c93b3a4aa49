"""Text over HTTP with a scripted decoder (each stream replays its prompt's bytes): UTF-8
characters never sent in halves, stop sequences cut across steps and characters; a full
queue answers 503 with Retry-After; SIGTERM finishes the streams in flight (a request on an
idle connection meanwhile: 503) and exits 0, or cancels them after --shutdown-timeout (one
line); a signal at any moment of the start is never lost; errors keep OpenAI's shape."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

TIMEOUT = 30.0


def events(reply) -> list:
    return [e for e in reply.events() if e != "[DONE]" and e["choices"]]


def test_utf8_characters_are_sent_whole(script_server):
    """Each step makes one byte: a 4-byte character spans 4 steps, and comes in one event."""
    text = "a\u00e9\U0001F600\u4e2d"           # 1 + 2 + 4 + 3 bytes
    r = script_server.client.complete(prompt=text, max_tokens=20, stream=True)
    chunks = [e["choices"][0]["text"] for e in events(r)]
    assert "".join(chunks) == (text * 2)[:len(text * 2)] and all(
        "\ufffd" not in c for c in chunks)
    r = script_server.client.complete(prompt=text, max_tokens=5)      # cut inside the emoji
    assert r.json()["choices"][0]["text"] == "a\u00e9\ufffd"
    assert r.json()["usage"]["completion_tokens"] == 5
    r = script_server.client.complete(prompt=[0xff, 0x41], max_tokens=4)    # not UTF-8
    assert r.json()["choices"][0]["text"] == "\ufffdA\ufffdA"


def test_stop_sequences_across_steps_and_characters(script_server):
    c = script_server.client
    cases = [("abcdef", ["cd"], "ab"),
             ("xaaab", ["aab"], "xa"),                       # a prefix of the stop first
             ("h\u00e9llo w\u00f6rld", ["\u00f6r"], "h\u00e9llo w"),   # a 2-byte character
             ("h\u00e9llo", ["\u00e9", "h"], ""),             # the first byte stops
             ("12345", ["9", "34"], "12"),
             ("ab", ["ba"], "a")]                            # across the script's wrap
    for prompt, stop, want in cases:
        for stream in (False, True):
            r = c.complete(prompt=prompt, max_tokens=100, stop=stop, stream=stream)
            if stream:
                chunks = events(r)
                text = "".join(e["choices"][0]["text"] for e in chunks)
                finish = chunks[-1]["choices"][0]["finish_reason"]
            else:
                text, finish = (r.json()["choices"][0][k] for k in ("text", "finish_reason"))
            assert (text, finish) == (want, "stop"), (prompt, stop, stream)
    r = c.complete(prompt="abc", max_tokens=5, stop="zz")
    assert r.json()["choices"][0] == {"text": "abcab", "index": 0, "logprobs": None,
                                      "finish_reason": "length"}


def test_stop_sequences_that_end_together_cut_before_the_earliest(script_server):
    """Two stop sequences ending at the same byte: the completion ends before the one that
    starts first (the first match in the text), whatever their order in the list."""
    c = script_server.client
    cases = [("in to", ["t", " t"], "in"), ("in to", [" t", "t"], "in"),
             ("abcd", ["d", "bcd", "cd"], "a"), ("abcd", ["cd", "d", "bcd"], "a"),
             ("xyz", ["z", "xyz", "yz"], "")]
    for prompt, stop, want in cases:
        for stream in (False, True):
            r = c.complete(prompt=prompt, max_tokens=100, stop=stop, stream=stream)
            text = ("".join(e["choices"][0]["text"] for e in events(r)) if stream
                    else r.json()["choices"][0]["text"])
            assert text == want, (prompt, stop, stream, text)


def test_full_queue_answers_503_with_retry_after(in_process):
    s = in_process(capacity=1, max_queue=1, step_delay=0.01)
    c = s.client
    results = {}

    def call(name, **kw):
        results[name] = c.complete(**kw)
    first = threading.Thread(target=call, args=("first",),
                             kwargs=dict(prompt="a", max_tokens=60))
    first.start()
    _until(lambda: c.request("GET", "/stats").json()["active"] == 1)
    second = threading.Thread(target=call, args=("second",),
                              kwargs=dict(prompt="b", max_tokens=3))
    second.start()
    _until(lambda: c.request("GET", "/stats").json()["queued"] == 1)
    third = c.complete(prompt="c", max_tokens=3)
    assert third.status == 503 and third.headers["retry-after"] == "1"
    assert third.json()["error"]["code"] == "queue_full"
    first.join(TIMEOUT)
    second.join(TIMEOUT)
    assert results["first"].status == results["second"].status == 200
    assert results["second"].json()["choices"][0]["text"] == "bbb"


def _until(condition, timeout=TIMEOUT):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_sigterm_finishes_streams_refuses_new_ones_and_exits_0(tiny_dir, server_process):
    s = server_process(tiny_dir, "--max-batch", "4", "--max-tokens-limit", "1000000")
    c = s.client
    # streams in flight: long enough to be running when the signal comes
    socks = []
    for i in range(3):
        sock = socket.create_connection(("127.0.0.1", c.port), timeout=TIMEOUT)
        body = json.dumps({"prompt": "s", "max_tokens": 15000, "stream": True,
                           "seed": i}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                     b"%d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        socks.append(sock)
    idle = c.connect()                      # a keep-alive connection, idle
    assert c.request("GET", "/health", conn=idle).status == 200
    s.proc.send_signal(signal.SIGTERM)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        reading = [pool.submit(_read_all, sock) for sock in socks]
        time.sleep(0.5)             # (the streams run on: the idle connection is answered)
        assert not any(r.done() for r in reading)
        r = c.complete(conn=idle, prompt="late", max_tokens=1)
        assert r.status == 503 and r.json()["error"]["code"] == "shutting_down", r
        assert r.headers["connection"] == "close" and r.headers["retry-after"] == "1"
        tails = [r.result() for r in reading]
    for tail in tails:              # every stream ran to its end
        assert tail.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"), tail[-200:]
        assert b'"finish_reason":"length"' in tail
    try:        # new connections: refused (or 503 while the listener closes)
        r = c.complete(prompt="late", max_tokens=1)
        assert r.status == 503
    except OSError:
        pass
    assert s.proc.wait(TIMEOUT) == 0
    assert s.proc.stderr.read() == ""


def _read_all(sock) -> bytes:
    data = b""
    while True:
        chunk = sock.recv(1 << 16)
        if not chunk:
            return data
        data += chunk
        if data.endswith(b"0\r\n\r\n"):
            return data


def test_a_stream_that_fails_sends_its_text_first(in_process):
    """The bytes released in the step before the error are sent, then the error event."""
    s = in_process(capacity=2, draw_error=ord("!"))
    r = s.client.complete(prompt="a!", max_tokens=10, stream=True)
    got = r.events()
    assert got[0]["choices"][0]["text"] == "a", got
    assert got[1]["error"]["code"] == "generation_failed" and got[2] == "[DONE]"
    r = s.client.complete(prompt="a!", max_tokens=10)
    assert r.status == 500 and r.json()["error"]["type"] == "server_error"
    assert s.client.wait_idle(10)["active"] == 0


def test_deeply_nested_json_is_a_400(script_server):
    body = b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    r = script_server.client.request("POST", "/v1/completions", body)
    assert r.status == 400, r.body[:200]
    assert r.json()["error"]["code"] == "invalid_json"


def test_an_unexpected_error_is_an_openai_shaped_500(in_process):
    s = in_process(capacity=1)

    def broken(request):
        raise RuntimeError("a defect")
    s.app.engine.submit = broken
    r = s.client.complete(prompt="a", max_tokens=1)
    assert r.status == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "server_error"
    assert s.client.request("GET", "/health").status == 200       # still serving


def test_sigterm_with_a_client_that_never_reads_exits_after_the_timeout(tiny_dir,
                                                                          server_process):
    """--shutdown-timeout 1: a stream whose client stops reading is cancelled a second
    after SIGTERM (uvicorn alone would wait for it forever); the server exits 0."""
    s = server_process(tiny_dir, "--max-batch", "2", "--max-tokens-limit", "1000000",
                       "--shutdown-timeout", "1")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(TIMEOUT)
    sock.connect(("127.0.0.1", s.client.port))
    body = json.dumps({"prompt": "s", "max_tokens": 1000000, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                 b"%d\r\n\r\n%s" % (len(body), body))
    assert sock.recv(64).startswith(b"HTTP/1.1 200")        # then never read again
    time.sleep(0.5)                 # (the socket's buffers fill: the server's writes wait)
    began = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(TIMEOUT) == 0
    assert time.monotonic() - began < 1 + 10
    sock.close()
    log = s.proc.stderr.read()          # (the cut: one line, no traceback)
    assert len(log.splitlines()) == 1 and "Traceback" not in log, log


def test_a_second_ctrl_c_exits_at_once_without_a_traceback(tiny_dir, server_process):
    """The first Ctrl-C drains; a second one cuts the streams in flight and exits 0 at
    once, quietly (no traceback of the cut responses or of the engine's thread)."""
    s = server_process(tiny_dir, "--max-batch", "2", "--max-tokens-limit", "1000000")
    socks = []
    for _ in range(2):
        sock = socket.create_connection(("127.0.0.1", s.client.port), timeout=TIMEOUT)
        body = json.dumps({"prompt": "s", "max_tokens": 1000000, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: "
                     b"%d\r\n\r\n%s" % (len(body), body))
        assert sock.recv(64).startswith(b"HTTP/1.1 200")
        socks.append(sock)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        reading = [pool.submit(_read_all, sock) for sock in socks]
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        s.proc.send_signal(signal.SIGINT)
        assert s.proc.wait(TIMEOUT) == 0
        for r in reading:
            r.result(TIMEOUT)
    assert s.proc.stderr.read() == ""


# -- signals at every moment of the start: a stop is never lost ---------------------------

# Runs ``python -m fastrwa.serve ARGS`` (as runpy runs it) and sends itself SIGNAL at MODE:
# "import" (as torch is first imported), "load" (as the model is loaded) or "ready" (as the
# ready line is printed): each a moment before uvicorn's own handlers are in place.
SIGNAL_AT = """
import builtins, functools, os, runpy, sys
mode, signum = sys.argv[1], int(sys.argv[2])
sys.argv = ["fastrwa.serve", *sys.argv[3:]]
def stop():
    os.kill(os.getpid(), signum)
if mode == "import":
    class Hook:
        def find_spec(self, name, path=None, target=None):
            if name == "torch":
                sys.meta_path.remove(self)
                stop()
    sys.meta_path.insert(0, Hook())
elif mode in ("load", "load-twice"):
    import fastrwa.models as models
    import time
    load = models.load_bytelm           # (what the server loads with)
    def loading(*args, **kwargs):
        stop()
        if mode == "load-twice":        # (a long load: the second Ctrl-C must not wait)
            stop()
            time.sleep(60)
        return load(*args, **kwargs)
    models.load_bytelm = loading
else:
    say = builtins.print
    @functools.wraps(say)           # (torch's import checks the builtins' names)
    def saying(*args, **kwargs):
        say(*args, **kwargs)
        if args and "http://" in str(args[0]):
            stop()
    builtins.print = saying
runpy.run_module("fastrwa.serve", run_name="__main__", alter_sys=True)
"""


def _run(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.parametrize("mode", ["import", "load", "ready"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_before_the_server_serves_stops_it(tiny_dir, mode, signum):
    """Exit 0 at once with one line: the ready line (the signal came as it was printed) or
    one saying the server stopped before it served; no traceback, no server serving on."""
    done = _run("-c", SIGNAL_AT, mode, str(int(signum)), str(tiny_dir), "--port", "0")
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 0 and len(lines) == 1, (done.returncode, lines)
    if mode == "ready":
        assert "http://127.0.0.1:" in lines[0], lines
    else:
        assert f"{signum.name}: stopping before it serves" in lines[0], lines
        assert "http" not in lines[0], lines


def test_a_second_ctrl_c_during_a_long_load_exits_at_once(tiny_dir):
    """The first Ctrl-C says that the command stops before it serves; a second does not
    wait for the model's load: exit 130 at once, one line more."""
    began = time.monotonic()
    done = _run("-c", SIGNAL_AT, "load-twice", str(int(signal.SIGINT)), str(tiny_dir),
                "--port", "0")
    lines = (done.stdout + done.stderr).splitlines()
    assert done.returncode == 130 and time.monotonic() - began < 50, (done.returncode, lines)
    assert lines == ["fastrwa.serve: SIGINT: stopping before it serves (Ctrl-C again to exit "
                     "at once)", "fastrwa.serve: SIGINT again: exiting at once"], lines


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_as_the_ready_line_is_read_stops_the_server(tiny_dir, server_process, signum):
    """The signal sent the moment the ready line is read (what a supervisor does): exit 0,
    promptly, each of two times."""
    for _ in range(2):
        s = server_process(tiny_dir)
        s.proc.send_signal(signum)
        assert s.proc.wait(10) == 0
        assert s.proc.stderr.read() == ""


def test_the_missing_extra_says_how_to_install_it_from_a_clone(tiny_dir):
    blocked = "import runpy, sys; sys.modules['uvicorn'] = None; " \
              "runpy.run_module('fastrwa.serve', run_name='__main__', alter_sys=True)"
    done = _run("-c", blocked, str(tiny_dir))
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "pip install -e '.[serve]'" in done.stderr and "fastrwa[" not in done.stderr


def test_a_server_whose_start_fails_exits_non_zero(tiny_dir):
    """uvicorn's start failing (here the engine cannot be built) is not a clean exit:
    uvicorn's status 3, its reason on stderr."""
    script = ("import sys\nimport fastrwa.serve.cli as cli\n"
              "def broken(*args, **kwargs):\n    raise RuntimeError('no engine here')\n"
              "cli.Engine = broken\n"
              "sys.exit(cli.main(sys.argv[1:]))\n")
    done = _run("-c", script, str(tiny_dir), "--port", "0")
    assert done.returncode == 3, (done.returncode, done.stdout, done.stderr)
    assert "no engine here" in done.stderr and "Traceback" not in done.stderr
