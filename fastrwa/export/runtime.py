"""Running an ONNX export of a ``ByteLM`` with onnxruntime and NumPy only (no PyTorch in
the loop): :class:`OnnxLM`, what the tests and ``bench/generation.py`` run, and what a
deployment's own loop does (docs/onnx.md has the same loop in 20 lines)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np

try:
    import onnxruntime as ort
except ImportError as exc:             # pragma: no cover (CI installs the extra)
    raise ImportError("fastrwa.export.runtime needs onnxruntime: "
                      "pip install 'fastrwa[onnx]'") from exc

PROMPT, STEP, CONFIG = "prompt.onnx", "step.onnx", "onnx_config.json"


def session(path: "str | os.PathLike", threads: Optional[int] = None
            ) -> "ort.InferenceSession":
    """An onnxruntime CPU session for ``path`` (``threads``: its intra-op threads; ``None``
    lets onnxruntime choose)."""
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


class OnnxLM:
    """The two sessions of an export directory (:func:`fastrwa.export.export_onnx`).

    ``logits, state = lm.prompt(ids)`` (``ids`` ``(B, T)``, ``T >= 1``), ``logits, state =
    lm.step(ids, state)`` (``ids`` ``(B,)``); ``state`` is the list of arrays in the order
    of ``lm.state_names``. ``lm.generate(prompt, n)`` continues greedily (the most likely
    byte, as ``ByteLM.generate(..., top_k=1)``)."""

    def __init__(self, directory: "str | os.PathLike", threads: Optional[int] = None):
        directory = Path(directory)
        self.config = json.loads((directory / CONFIG).read_text())
        self.prompt_session = session(directory / PROMPT, threads)
        self.step_session = session(directory / STEP, threads)
        self.state_names = [i.name for i in self.step_session.get_inputs()][1:]
        self.bos_token = int(self.config["bos_token"])

    def prompt(self, ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        logits, *state = self.prompt_session.run(None, {"ids": np.asarray(ids, np.int64)})
        return logits, state

    def step(self, ids: np.ndarray, state: list[np.ndarray]
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        feed = {"ids": np.asarray(ids, np.int64), **dict(zip(self.state_names, state))}
        logits, *state = self.step_session.run(None, feed)
        return logits, state

    def greedy(self, logits: np.ndarray) -> np.ndarray:
        """The most likely byte of each row (BOS and any id past the bytes excluded, as
        ``ByteLM.generate`` excludes them; ties: the lowest id)."""
        return logits[:, :self.bos_token].argmax(axis=-1).astype(np.int64)

    def generate(self, prompt: np.ndarray, max_new_tokens: int) -> np.ndarray:
        """``(B, P + max_new_tokens)``: ``prompt`` ``(B, P)`` (or ``(P,)``) and its greedy
        continuation; an empty prompt starts from the BOS id."""
        prompt = np.asarray(prompt, np.int64)
        prompt = prompt[None] if prompt.ndim == 1 else prompt
        context = prompt if prompt.shape[1] else np.full((prompt.shape[0], 1), self.bos_token,
                                                          np.int64)
        out = [prompt]
        if max_new_tokens:
            logits, state = self.prompt(context)
            for i in range(max_new_tokens):
                token = self.greedy(logits)
                out.append(token[:, None])
                if i + 1 < max_new_tokens:
                    logits, state = self.step(token, state)
        return np.concatenate(out, axis=1)


def cross_entropy_bits(logits: np.ndarray, targets: np.ndarray) -> float:
    """Summed ``-log2 softmax(logits)[target]`` over the rows of ``logits`` ``(B, V)``."""
    logits = logits.astype(np.float64)
    top = logits.max(axis=-1, keepdims=True)
    lse = np.log(np.exp(logits - top).sum(axis=-1)) + top[:, 0]
    picked = logits[np.arange(len(targets)), targets]
    return float((lse - picked).sum() / np.log(2.0))


def text_rows(data: bytes, rows: int) -> np.ndarray:
    """``data``'s bytes as ``(rows, length)`` int64 (the tail that does not fill a row
    dropped)."""
    array = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    length = len(array) // rows
    if length < 2:
        raise ValueError(f"{len(array)} bytes are too few for {rows} rows of 2 bytes or more")
    return array[:rows * length].reshape(rows, length)


def bits_per_byte(lm: OnnxLM, data: bytes, rows: int = 8) -> float:
    """The export's bits per byte on ``data``, cut into ``rows`` rows read in parallel,
    each predicted from its first byte on (the prompt reads the first byte, the step each
    next one): what ``python -m fastrwa.export onnx ... --eval FILE`` prints."""
    ids = text_rows(data, rows)
    logits, state = lm.prompt(ids[:, :1])
    bits = 0.0
    for t in range(1, ids.shape[1]):
        bits += cross_entropy_bits(logits, ids[:, t])
        if t + 1 < ids.shape[1]:
            logits, state = lm.step(ids[:, t], state)
    return bits / (rows * (ids.shape[1] - 1))
