"""Running an ONNX export of a ``ByteLM`` with onnxruntime and NumPy only (no PyTorch in
the loop): :class:`OnnxLM`, what the tests and ``bench/generation.py`` run, and what a
deployment's own loop does (docs/onnx.md has the same loop in 20 lines)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import numpy as np
from numpy.typing import ArrayLike

from ..extras import install_hint
from .names import CONFIG, FILES_KEY, GRAPHS, PROPS, PROPS_KEY, file_record

try:
    import onnxruntime as ort
except ImportError as exc:             # pragma: no cover (CI installs the extra)
    raise ImportError(f"fastrwa.export.runtime needs onnxruntime: "
                      f"{install_hint('onnx')}") from exc


def session(model: "str | os.PathLike | bytes", threads: Optional[int] = None
            ) -> "ort.InferenceSession":
    """An onnxruntime CPU session for ``model`` (a path, or a file's bytes; ``threads``:
    its intra-op threads; ``None`` lets onnxruntime choose)."""
    options = ort.SessionOptions()
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


MIXED = "the directory mixes files of different exports: export it again (--overwrite)"


def read_graph(directory: Path, name: str, config: dict) -> bytes:
    """The bytes of the graph file ``name`` of an export ``directory``, refused
    (``ValueError``, one line naming the file) if its size or SHA-256 is not what
    ``config`` (its ``onnx_config.json``) records; a config of version 1 records none."""
    path = directory / name
    content = path.read_bytes()
    want = (config.get(FILES_KEY) or {}).get(name)
    if want is not None:
        got = file_record(content)
        for key in ("bytes", "sha256"):
            if got[key] != want.get(key):
                raise ValueError(f"{path} is not the file {CONFIG} beside it records (its "
                                 f"{key} is {got[key]}, the config records {want.get(key)}): "
                                 f"{MIXED}")
    return content


def check_props(path: Path, session: "ort.InferenceSession", config: dict) -> None:
    """Refuse (``ValueError``, one line) a graph file ``path`` whose own record of its
    export (its metadata, :data:`~fastrwa.export.names.PROPS`) says otherwise than
    ``config``: what catches a mix of files that ``config`` records no hashes of."""
    raw = session.get_modelmeta().custom_metadata_map.get(PROPS_KEY)
    try:
        props = json.loads(raw) if raw else {}
    except ValueError:
        props = {}
    for key in PROPS:
        if key in props and key in config and props[key] != config[key]:
            raise ValueError(f"{path} says {key} {props[key]!r}, {path.parent / CONFIG} says "
                             f"{config[key]!r}: {MIXED}")


class OnnxLM:
    """The two sessions of an export directory (:func:`fastrwa.export.export_onnx`).

    ``logits, state = lm.prompt(ids)`` (``ids`` ``(B, T)``, ``T >= 1``), ``logits, state =
    lm.step(ids, state)`` (``ids`` ``(B,)``); ``state`` is the list of arrays in the order
    of ``lm.state_names``. ``lm.generate(prompt, n)`` continues greedily (the most likely
    byte, as ``ByteLM.generate(..., top_k=1)``).

    ``prompt`` and ``step`` check what the raw graphs do not (``ValueError``): ``ids``'s
    shape and range ``[0, vocab_size)``, a prompt of one position or more, and each state
    tensor's shape ``(B, width)``.

    A directory whose files do not belong together (a ``.onnx`` file of another export: its
    size and SHA-256 are not those ``onnx_config.json`` records, or what it records of its
    weights is not the config's) is refused (``ValueError`` naming the file)."""

    def __init__(self, directory: "str | os.PathLike", threads: Optional[int] = None):
        directory = Path(directory)
        self.config = json.loads((directory / CONFIG).read_text())
        self.prompt_session, self.step_session = (
            session(read_graph(directory, name, self.config), threads) for name in GRAPHS)
        for name, graph in zip(GRAPHS, (self.prompt_session, self.step_session)):
            check_props(directory / name, graph, self.config)
        self.state_names = [i.name for i in self.step_session.get_inputs()][1:]
        self.bos_token = int(self.config["bos_token"])
        self.vocab_size = int(self.config["vocab_size"])
        # (each state tensor's width: the step's inputs are (batch, width))
        self.state_widths = [int(i.shape[1]) for i in self.step_session.get_inputs()[1:]]

    def _ids(self, ids: ArrayLike, ndim: int, shape: str) -> np.ndarray:
        """``ids`` as int64, refused (``ValueError``) unless of ``ndim`` dimensions and in
        ``[0, vocab_size)`` (``Gather`` would read a negative id from the end)."""
        array = np.asarray(ids)
        if array.ndim != ndim or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"ids must be {shape} integers, got shape {array.shape} of "
                             f"{array.dtype}")
        array = array.astype(np.int64, copy=False)
        if array.size and (array.min() < 0 or array.max() >= self.vocab_size):
            bad = array[(array < 0) | (array >= self.vocab_size)]
            raise ValueError(f"ids must be in [0, {self.vocab_size}) (bytes 0-255, BOS "
                             f"{self.bos_token}), got {int(bad.flat[0])}")
        return array

    def prompt(self, ids: ArrayLike) -> tuple[np.ndarray, list[np.ndarray]]:
        """Read ``ids`` ``(B, T)`` (``T >= 1``: bytes, or the BOS id to start from nothing)
        from the model's initial state: ``(logits, state)``, ``logits`` ``(B, vocab_size)``
        of the last position, ``state`` the arrays of :attr:`state_names` after it.

        ``T == 0`` is refused (``ValueError``; fed to ``prompt.onnx`` directly, an empty
        ``Scan`` crashes onnxruntime's process): start from ``[[bos_token]]``, as
        :meth:`generate` does for an empty prompt."""
        ids = self._ids(ids, 2, "(batch, length)")
        if ids.shape[1] == 0:
            raise ValueError(f"ids has no positions (shape {ids.shape}): a prompt reads one "
                             f"or more; to start from nothing pass the BOS id, "
                             f"[[{self.bos_token}]] per row, as generate does")
        logits, *state = self.prompt_session.run(None, {"ids": ids})
        return logits, state

    def step(self, ids: ArrayLike, state: list[np.ndarray]
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        """One token per row: ``ids`` ``(B,)`` and ``state`` (the arrays of
        :attr:`state_names`, each ``(B, width)``, as :meth:`prompt` or :meth:`step`
        returned them, or rows of several stacked) -> ``(logits, next_state)``, ``logits``
        ``(B, vocab_size)``. A state of the wrong count or shape is refused
        (``ValueError`` naming the input), not broadcast."""
        ids = self._ids(ids, 1, "(batch,)")
        if len(state) != len(self.state_names):
            raise ValueError(f"state must be {len(self.state_names)} arrays "
                             f"({', '.join(self.state_names)}), got {len(state)}")
        for name, width, tensor in zip(self.state_names, self.state_widths, state):
            shape = np.shape(tensor)
            if shape != (len(ids), width):
                raise ValueError(f"state input {name} must have shape (batch, {width}) = "
                                 f"({len(ids)}, {width}) for ids of batch {len(ids)}, got "
                                 f"{shape}")
        feed = {"ids": ids, **dict(zip(self.state_names, state))}
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
