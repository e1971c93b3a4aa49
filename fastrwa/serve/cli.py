"""``python -m fastrwa.serve RUN_OR_MODEL_DIR [--port 8000]``: serve a byte LM over HTTP with
an OpenAI-compatible ``/v1/completions`` (docs/serve.md), continuous batching on one
decode step for every stream in flight. Needs the ``[serve]`` extra (uvicorn).

SIGTERM (or Ctrl-C) stops accepting connections, finishes the streams in flight and exits
0; requests that arrive meanwhile on open connections get 503. Streams still running
``--shutdown-timeout`` seconds after the signal (default 30: a client that stops reading
would hold the server forever) are cut and cancelled. A signal while the model loads stops
the command once it is loaded, with one line and exit status 0; none is lost
(:mod:`.signals`).
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import socket
import sys
from typing import Optional

import torch

from ..extras import install_hint
from ..models import load_bytelm
from ..options import (add_device, add_model_directory, add_threads, add_weights,
                       check_options, device_of)
from .app import App
from .batcher import Engine
from .prefix_cache import megabytes
from .rows import make_rows
from .schema import Limits
from .signals import STOPS

SWITCH_INTERVAL_S = 5e-4
SHUTDOWN_TIMEOUT_S = 30.0
PREFIX_CACHE_MB = 256.0
PREFILL_CHUNK = 256         # (ids: the fused prefill's calls at batch 1 are of 256 positions)


def parser() -> argparse.ArgumentParser:
    """The command line's parser (the options: docs/serve.md)."""
    p = argparse.ArgumentParser(prog="python -m fastrwa.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_directory(p)
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1 (this machine only)")
    p.add_argument("--port", type=int, default=8000, help="default 8000; 0: any free port")
    p.add_argument("--model-name", default=None,
                   help="the model's id in responses and /v1/models (default: the directory's "
                        "name)")
    add_device(p)
    add_weights(p)
    p.add_argument("--max-batch", type=int, default=64,
                   help="streams decoded at once (rows of the batch; default 64)")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests that may wait for a row when every row is busy; one more "
                        "gets 503 (default 256; 0: no waiting, a request is taken only "
                        "while a row is free)")
    p.add_argument("--max-prompt-bytes", type=int, default=16384,
                   help="longest prompt in UTF-8 bytes (default 16384; longer: 400)")
    p.add_argument("--max-tokens-limit", type=int, default=4096,
                   help="largest max_tokens a request may ask for (default 4096; more: 400)")
    p.add_argument("--prefix-cache-mb", type=float, default=PREFIX_CACHE_MB,
                   help="memory for the decoder states after prompts seen, reused by a "
                        "prompt that starts with one (only its rest is prefilled; the "
                        "same bytes): MiB, least recently used evicted (default "
                        f"{PREFIX_CACHE_MB:g}; 0: none). Used with the fused CPU decoder "
                        "only (the others' prefill depends on where a prompt is cut)")
    p.add_argument("--prefill-chunk", type=int, default=PREFILL_CHUNK,
                   help="a prompt with more than this many ids to prefill (past its "
                        "longest prefix in the prefix cache) is prefilled this many a step, "
                        "between the running streams' steps, so they do not wait for its "
                        "whole prefill (other prompts are prefilled whole at admission) "
                        f"(default {PREFILL_CHUNK}; 0: each prompt whole; with the fused CPU "
                        "decoder, the same bytes)")
    add_threads(p)
    p.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's and the server's log level (default warning)")
    p.add_argument("--shutdown-timeout", type=float, default=SHUTDOWN_TIMEOUT_S,
                   help="seconds SIGTERM waits for the streams in flight before it cuts "
                        f"them (default {SHUTDOWN_TIMEOUT_S:g})")
    return p


def check_args(args: argparse.Namespace) -> None:
    """Raise ``ValueError`` naming the first option of ``args`` that is out of range."""
    for name in ("max_batch", "max_prompt_bytes", "max_tokens_limit"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got "
                             f"{getattr(args, name)}")
    if not 0 <= args.prefix_cache_mb < math.inf:    # (NaN and inf too)
        raise ValueError(f"--prefix-cache-mb must be a number 0 or more, got "
                         f"{args.prefix_cache_mb}")
    if args.prefill_chunk < 0:
        raise ValueError(f"--prefill-chunk must be 0 or more, got {args.prefill_chunk}")
    if args.max_queue < 0:
        raise ValueError(f"--max-queue must be 0 or more, got {args.max_queue}")
    if not args.shutdown_timeout >= 0:          # (NaN too)
        raise ValueError(f"--shutdown-timeout must be 0 or more seconds, got "
                         f"{args.shutdown_timeout}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    check_options(args)


def served_name(args: argparse.Namespace) -> str:
    """The model's id in answers: ``--model-name`` or the directory's name, as valid
    Unicode (the bytes of a name that are not UTF-8, which Python keeps as lone
    surrogates that no answer could encode, become U+FFFD)."""
    name = args.model_name or args.run_dir.resolve().name or "fastrwa"
    return os.fsencode(name).decode("utf-8", "replace")


def address(host: str, port: int) -> str:
    """``HOST:PORT`` as URLs and clients take it (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def stopped() -> bool:
    """True when a stop signal came before the server serves (its line was said when it
    came: :class:`~fastrwa.serve.signals.Signals`)."""
    return STOPS.first() is not None


def main(argv: Optional[list[str]] = None) -> int:
    """Serve until SIGTERM or Ctrl-C; the exit status: 0 (a stop signal, whenever it
    came), or 2 for a bad option, a model that cannot be loaded or an address that cannot
    be listened on (the reason on stderr)."""
    STOPS.install()                 # (python -m fastrwa.serve: done before its imports)
    args = parser().parse_args(argv)
    try:
        check_args(args)
        from .server import Server
    except ImportError:
        print(f"error: the server needs uvicorn: {install_hint('serve')}", file=sys.stderr)
        return 2
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if stopped():
        return 0
    logging.getLogger("fastrwa.serve").setLevel(args.log_level.upper())
    if args.threads:
        torch.set_num_threads(args.threads)
    # The engine's thread takes the GIL back after each decode step (which runs without it)
    # and the event loop's between its writes: a shorter switch interval than Python's 5 ms
    # keeps either from waiting long for the other.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        model = load_bytelm(args.run_dir, args.best, "the server").to(device_of(args.device))
        rows = make_rows(model, args.weights, args.max_batch, megabytes(args.prefix_cache_mb))
    except (FileNotFoundError, ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if stopped():
        return 0
    name = served_name(args)
    bos = model.config.bos_token
    app = App(lambda notify: Engine(rows, bos, args.max_queue, notify,
                                    args.prefill_chunk or None), name,
              Limits(args.max_prompt_bytes, args.max_tokens_limit), model=model)
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as exc:
        print(f"error: cannot listen on {address(args.host, args.port)}: {exc}",
              file=sys.stderr)
        return 2
    sock.listen(2048)
    host, port = sock.getsockname()[:2]
    server = Server(uvicorn_config(app, host, port, args), app, STOPS, args.shutdown_timeout)
    # (a signal from here on is replayed into uvicorn's handlers: the server drains at once)
    STOPS.serving()
    print(f"fastrwa.serve: {name} ({rows.kind}, {args.max_batch} rows) on "
          f"http://{address(host, port)}", flush=True)
    server.run(sockets=[sock])
    if app.engine is not None:      # (a second Ctrl-C skips the engine's drain: cancelled)
        app.engine.close(drain=False, timeout=SHUTDOWN_TIMEOUT_S)
    return 0


def uvicorn_config(app: App, host: str, port: int, args: argparse.Namespace):
    """uvicorn's ``Config`` for ``app`` on the socket bound to ``host``:``port``."""
    import uvicorn

    return uvicorn.Config(app, host=host, port=port, lifespan="on", access_log=False,
                          log_level=args.log_level, backlog=2048,
                          timeout_graceful_shutdown=args.shutdown_timeout)
