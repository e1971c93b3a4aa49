"""The real server (``python -m fastrwa.serve`` in a subprocess, loopback) with a real HTTP
client: OpenAI-shaped answers equal to generate's bytes, many concurrent clients,
disconnects, bad requests (whatever JSON can carry), limits, a burst, memory over 1,000
requests, a model directory whose name is not UTF-8, an IPv6 address."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import shutil
import socket
import time
import urllib.request

import pytest
import torch

from fastrwa.serve.rows import GREEDY_TEMPERATURE
TIMEOUT = 30.0


def generated(model, prompt: bytes, max_tokens: int, temperature=1.0, top_k=None,
              top_p=None, seed=0) -> str:
    """generate's completion as the server sends it (UTF-8, U+FFFD for what is not)."""
    out = model.generate(torch.tensor(list(prompt), dtype=torch.long), max_tokens,
                         temperature or GREEDY_TEMPERATURE, top_k, top_p,
                         generator=torch.Generator().manual_seed(seed))
    return bytes(out[0, len(prompt):].tolist()).decode("utf-8", "replace")


def stream_text(reply) -> tuple[str, str]:
    events = reply.events()
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    return "".join(c["choices"][0]["text"] for c in chunks), chunks[-1]["choices"][0][
        "finish_reason"]


def test_completion_equals_generate(server, tiny_model):
    c = server.client
    cases = [dict(prompt="Hello", max_tokens=50, temperature=0, seed=1),
             dict(prompt="", max_tokens=30, temperature=0.7, top_k=40, top_p=0.9, seed=12345),
             dict(prompt=[104, 105], max_tokens=25, temperature=1.3, seed=7)]
    for case in cases:
        prompt = case["prompt"].encode() if isinstance(case["prompt"], str) \
            else bytes(case["prompt"])
        want = generated(tiny_model, prompt, case["max_tokens"], case["temperature"],
                         case.get("top_k"), case.get("top_p"), case["seed"])
        r = c.complete(model="mine", **case)
        assert r.status == 200, r.body
        body = r.json()
        assert body["object"] == "text_completion" and body["model"] == "mine"
        assert body["id"].startswith("cmpl-") and isinstance(body["created"], int)
        choice = body["choices"][0]
        assert choice["text"] == want and choice["finish_reason"] == "length"
        assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens":
                                 case["max_tokens"], "total_tokens": len(prompt) +
                                 case["max_tokens"]}
        s = c.complete(stream=True, stream_options={"include_usage": True}, **case)
        assert s.status == 200 and s.headers["content-type"].startswith("text/event-stream")
        assert stream_text(s) == (want, "length")
        assert s.events()[-2]["usage"] == body["usage"]


def test_many_concurrent_clients(server, tiny_model):
    """32 clients at once (16 rows: some wait in the queue), each its own bytes."""
    rng = random.Random(0)
    cases = [dict(prompt="".join(rng.choice("abc xyz") for _ in range(rng.randrange(12))),
                  max_tokens=rng.randrange(1, 80), temperature=rng.choice([0, 0.9]),
                  top_k=rng.choice([None, 10]), seed=i, stream=bool(i % 2))
             for i in range(32)]

    def one(case):
        r = server.client.complete(**case)
        assert r.status == 200, r.body
        return stream_text(r)[0] if case["stream"] else r.json()["choices"][0]["text"]

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        texts = list(pool.map(one, cases))
    for case, text in zip(cases, texts):
        assert text == generated(tiny_model, case["prompt"].encode(), case["max_tokens"],
                                 case["temperature"], case["top_k"], None, case["seed"])


def test_disconnect_mid_stream_frees_the_row(server):
    c = server.client
    conns = []
    for _ in range(3):
        s = socket.create_connection(("127.0.0.1", c.port), timeout=TIMEOUT)
        body = b'{"prompt": "a", "max_tokens": 100000, "stream": true}'
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                  b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        assert s.recv(4096).startswith(b"HTTP/1.1 200")        # streaming
        conns.append(s)
    # (a job is queued, then admitted, after its stream's headers went out: wait for it)
    end = time.monotonic() + TIMEOUT
    while c.request("GET", "/stats").json()["active"] != 3:
        assert time.monotonic() < end, c.request("GET", "/stats").json()
        time.sleep(0.01)
    for s in conns:
        s.close()
    stats = c.wait_idle(10)
    # (a 100,000-byte stream left at once: far fewer steps than its length)
    assert stats["rows_stepped"] < 3 * 100000
    # a non-streaming request whose client leaves is cancelled too
    s = socket.create_connection(("127.0.0.1", c.port), timeout=TIMEOUT)
    body = b'{"prompt": "a", "max_tokens": 100000}'
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s"
              % (len(body), body))
    time.sleep(0.2)
    s.close()
    c.wait_idle(10)


def test_bad_requests_name_the_field(server):
    c = server.client
    for body, param in [
            (b'{"prompt": "a", ', None), (b"[1, 2]", None), (b"\xff\xfe", None),
            ({"max_tokens": 3}, "prompt"), ({"prompt": 5}, "prompt"),
            ({"prompt": ["a", "b"]}, "prompt"), ({"prompt": [1, 257]}, "prompt"),
            ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
            ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
            ({"prompt": "a", "temperature": -0.1}, "temperature"),
            ({"prompt": "a", "top_p": 0}, "top_p"), ({"prompt": "a", "top_k": 0}, "top_k"),
            ({"prompt": "a", "stop": 3}, "stop"), ({"prompt": "a", "stop": [""]}, "stop"),
            ({"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
            ({"prompt": "a", "seed": -1}, "seed"), ({"prompt": "a", "seed": 2 ** 64}, "seed"),
            ({"prompt": "a", "stream": "yes"}, "stream"), ({"prompt": "a", "n": 2}, "n"),
            ({"prompt": "a", "echo": 1}, "echo"), ({"prompt": "a", "logprobs": 21}, "logprobs"),
            ({"prompt": "a", "best_of": 3}, "best_of"), ({"prompt": "a", "suffix": "z"}, "suffix"),
            ({"prompt": "a", "presence_penalty": 1}, "presence_penalty"),
            ({"prompt": "a", "max_token": 3}, "max_token"),
            ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options")]:
        r = c.request("POST", "/v1/completions", body)
        assert r.status == 400, (body, r.status, r.body)
        error = r.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", (body, error)
    assert c.request("GET", "/v1/completions").status == 405
    assert c.request("GET", "/nowhere").status == 404
    # neutral values of the unsupported fields are accepted (clients send them)
    ok = c.complete(prompt="a", max_tokens=2, n=1, echo=False, logprobs=None, best_of=1,
                    presence_penalty=0, frequency_penalty=0.0, logit_bias={}, user="u",
                    top_p=1, top_k=-1, stop=None)
    assert ok.status == 200, ok.body


def test_prompt_and_token_limits(server):
    c = server.client
    r = c.complete(prompt="x" * 1001, max_tokens=1)         # --max-prompt-bytes 1000
    assert r.status == 400 and r.json()["error"]["param"] == "prompt"
    r = c.complete(prompt="\u00e9" * 501, max_tokens=1)     # 1002 bytes in UTF-8
    assert r.status == 400 and r.json()["error"]["param"] == "prompt"
    assert c.complete(prompt="x" * 1000, max_tokens=1).status == 200
    r = c.request("POST", "/v1/completions", b'{"prompt": "' + b"x" * (1 << 21) + b'"}')
    assert r.status == 413
    r = c.complete(prompt="x", max_tokens=100001)            # --max-tokens-limit 100000
    assert r.status == 400 and r.json()["error"]["param"] == "max_tokens"
    for stream in (False, True):
        r = c.complete(prompt="x", max_tokens=0, stream=stream)
        assert r.status == 200
        text, finish = stream_text(r) if stream else (r.json()["choices"][0]["text"],
                                                      r.json()["choices"][0]["finish_reason"])
        assert (text, finish) == ("", "length")
    r = c.complete(prompt="x", max_tokens=20000, temperature=0)     # huge, within the limit
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 20000
    default = c.complete(prompt="x")
    assert default.json()["usage"]["completion_tokens"] == 16      # OpenAI's default


def test_burst_of_200_requests(server):
    def one(i):
        r = server.client.complete(prompt=f"burst {i}", max_tokens=i % 7, seed=i)
        return r.status, r.json()["usage"]["completion_tokens"]

    with concurrent.futures.ThreadPoolExecutor(50) as pool:
        results = list(pool.map(one, range(200)))
    assert results == [(200, i % 7) for i in range(200)]
    server.client.wait_idle()


def test_memory_flat_over_1000_requests(server):
    """The server's RSS after 1,000 more requests (keep-alive connections, streaming and
    not) grows by less than 8 MB (allocator noise; a leak of a job's generator, cache row
    or buffers per request would be tens of MB)."""
    def batch(count, start):
        def worker(k):
            conn = server.client.connect()
            try:
                for i in range(start + k, start + count, 8):
                    r = server.client.complete(conn, prompt=f"m{i}", max_tokens=8, seed=i,
                                               stream=bool(i % 2))
                    assert r.status == 200
            finally:
                conn.close()
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(worker, range(8)))

    batch(200, 0)
    server.client.wait_idle()
    before = server.rss()
    batch(1000, 200)
    server.client.wait_idle()
    growth = server.rss() - before
    print(f"RSS {before / 2 ** 20:.1f} MB, then {growth / 2 ** 20:+.2f} MB over 1,000 requests")
    assert growth < 8 << 20, f"RSS grew by {growth / 2 ** 20:.1f} MB over 1,000 requests"


def test_health_and_models(server):
    h = server.client.health()
    assert h["status"] == "ok" and h["capacity"] == 16 and "fused" in h["decoder"]
    models = server.client.request("GET", "/v1/models").json()
    assert models["data"][0]["id"] == h["model"]


def test_what_json_can_carry_is_a_400_naming_the_field(server):
    """Strings with no UTF-8 (a lone surrogate: it could not be echoed back), integers of
    any length, numbers beyond float64, in any field, streaming or not: a 400 naming it."""
    c = server.client
    huge = b"9" * 5000                          # (over Python's 4,300-digit conversion limit)
    for field, value in [(b"model", rb'"\ud800"'), (b"user", rb'"x\udfff"'),
                         (b"stop", rb'["\ud800"]'), (b"prompt", rb'"\ud800"'),
                         (b"seed", huge), (b"max_tokens", b"-" + huge),
                         (b"prompt", b"[" + huge + b"]"), (b"temperature", b"1e400"),
                         (b"logit_bias", b'{"1": ' + huge + b"}"), (rb"\ud800", b"1")]:
        for stream in (b"false", b"true"):
            body = b'{"prompt": "a", "stream": %s, "%s": %s}' % (stream, field, value)
            r = c.request("POST", "/v1/completions", body)
            assert r.status == 400, (field, value[:20], r.status, r.body[:300])
            error = r.json()["error"]
            want = None if field == rb"\ud800" else field.decode()
            assert error["param"] == want, (field, error)
    assert c.health()["status"] == "ok"


def test_null_is_every_fields_default(server):
    """OpenAI's documented defaults, sent as null (as its clients may), are accepted."""
    c = server.client
    fields = ["model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream",
              "stream_options", "n", "echo", "logprobs", "best_of", "user", "presence_penalty",
              "frequency_penalty", "logit_bias", "suffix"]
    r = c.complete(prompt="a", seed=3, **{name: None for name in fields if name != "seed"})
    assert r.status == 200, r.body
    assert r.json()["choices"][0]["text"] == c.complete(prompt="a", seed=3).json()[
        "choices"][0]["text"]
    for value in (0, 0.0, "false"):                 # (booleans are JSON's booleans only)
        r = c.complete(prompt="a", echo=value)
        assert r.status == 400 and r.json()["error"]["param"] == "echo", (value, r.body)


def test_a_model_directory_whose_name_is_not_utf8(tiny_dir, tmp_path, server_process):
    """The name is served with U+FFFD for its bytes that are not UTF-8: every route answers."""
    directory = tmp_path / os.fsdecode(b"model-\xff")
    shutil.copytree(tiny_dir, directory)
    s = server_process(directory)
    assert "model-\ufffd" in s.line
    for path in ("/health", "/v1/models", "/stats"):
        r = s.client.request("GET", path)
        assert r.status == 200, (path, r.body)
    assert s.client.health()["model"] == "model-\ufffd"
    for stream in (False, True):
        r = s.client.complete(prompt="a", max_tokens=3, stream=stream)
        # (JSON with ASCII escapes: any name encodes)
        assert r.status == 200 and b'"model":"model-\\ufffd"' in r.body, r.body


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_host_is_printed_as_a_url_clients_can_use(tiny_dir, server_process):
    s = server_process(tiny_dir, "--host", "::1")
    assert s.url.startswith("http://[::1]:"), s.line
    with urllib.request.urlopen(s.url + "/health", timeout=TIMEOUT) as r:
        assert r.status == 200 and json.loads(r.read())["status"] == "ok"
