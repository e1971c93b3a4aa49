"""ONNX export of a :class:`fastrwa.models.ByteLM` (``prompt.onnx`` and ``step.onnx``) and of
a scan layer's step, in standard ONNX operators only (no custom op): docs/onnx.md.

The step is :class:`fastrwa.export.steps.ByteLMStep` (the recurrence of
:mod:`fastrwa.reference` in plain PyTorch operations) exported with ``torch.onnx.export``;
the prompt is that same step graph as the body of an ONNX ``Scan`` over the prompt's
positions, started from the model's learned initial state. Both files therefore compute
every token the same way, and a state carried from one to the other is exact.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch import nn

from ..extras import install_hint
from .names import (CONFIG, EXPORT_FILES, FILES_KEY, FORMAT, OLD_LEFTOVERS, PROMPT, PROPS,
                    PROPS_KEY, STEP, VERSION, WHAT, file_record)

try:
    import onnx
    from onnx import TensorProto, helper, numpy_helper
except ImportError as exc:             # pragma: no cover (CI installs the extra)
    raise ImportError(f"fastrwa.export.onnx needs onnx and onnxruntime: "
                      f"{install_hint('onnx')}") from exc

from ..models import ByteLM, load_bytelm
from ..models.files import (ExportDirectory, check_output_directory, staged_directory,
                            write_atomically, write_file)
from .steps import ByteLMStep, LayerStep, check_exportable, layer_state_names, state_names

# What --overwrite may replace: an earlier export (its files, an older version's leftover
# temporary files, and an onnx_config.json of this format beside any graph).
OUTPUT = ExportDirectory(WHAT, EXPORT_FILES, CONFIG, ("format", FORMAT), OLD_LEFTOVERS)
USE = "the ONNX export"         # (what refuses a baseline: load_bytelm)
WEIGHTS = ("float32", "int8", "float16")
EXPORTERS = ("torchscript", "dynamo")
OPSET = 17
BATCH = "batch"


def _export_module(module: nn.Module, args: tuple, input_names: Sequence[str],
                   output_names: Sequence[str], exporter: str, opset: int) -> onnx.ModelProto:
    """``module`` traced on ``args`` by ``torch.onnx.export`` (every input and output's
    first axis dynamic, named ``batch``), as an in-memory ONNX model.

    ``exporter="torchscript"``: PyTorch's TorchScript-based exporter (``dynamo=False``;
    deprecated since PyTorch 2.9, its warning silenced here; fast and needs nothing more).
    ``"dynamo"``: the ``torch.export``-based one (PyTorch's default; needs ``onnxscript``).
    Both give the same operators for these modules."""
    if exporter not in EXPORTERS:
        raise ValueError(f"exporter must be one of {EXPORTERS}, got {exporter!r}")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad(), warnings.catch_warnings():
        path = os.path.join(tmp, "model.onnx")
        warnings.simplefilter("ignore")          # (the legacy exporter's deprecation, tracer)
        if exporter == "torchscript":
            torch.onnx.export(module, args, path, dynamo=False, input_names=list(input_names),
                              output_names=list(output_names), opset_version=opset,
                              dynamic_axes={n: {0: BATCH} for n in (*input_names,
                                                                     *output_names)})
        else:
            batch = torch.export.Dim(BATCH, min=1)
            shapes = ({0: batch}, tuple({0: batch} for _ in args[1:]))
            program = torch.onnx.export(module, args, None, dynamo=True, verbose=False,
                                        input_names=list(input_names),
                                        output_names=list(output_names),
                                        opset_version=max(opset, 18), dynamic_shapes=shapes)
            program.save(path)
        return onnx.load(path)


# -- the prompt: the step as the body of a Scan -------------------------------------------
def _local_names(graph: onnx.GraphProto) -> set[str]:
    names = {i.name for i in graph.input}
    for node in graph.node:
        names.update(node.output)
    return names


def prompt_from_step(step: onnx.ModelProto, initial: Sequence[np.ndarray],
                     output_width: int, input_name: str = "ids",
                     input_type: int = TensorProto.INT64) -> onnx.ModelProto:
    """The prompt model of a step model: ``ids`` ``(B, T)`` -> the last position's output
    and the state after it, the step graph run over ``T`` by an ONNX ``Scan`` from the
    state ``initial`` (one ``(1, width)`` float32 row per state tensor, broadcast over the
    batch).

    ``step``'s inputs are ``[token (B,), *state]`` and its outputs ``[output (B,
    output_width), *next_state]``, in the same order; the prompt's outputs keep the step's
    output names. The step's initializers move to the outer graph (the body reads them
    from there); every name local to the body is prefixed ``step/``."""
    g = step.graph
    body = onnx.GraphProto()
    body.CopyFrom(g)
    body.name = "step"
    del body.initializer[:]
    del body.value_info[:]
    local = _local_names(g)
    rename = {n: f"step/{n}" for n in local}
    for node in body.node:
        node.name = f"step/{node.name}"
        for k, name in enumerate(node.input):
            node.input[k] = rename.get(name, name)
        for k, name in enumerate(node.output):
            node.output[k] = rename[name]
    token, states = g.input[0], list(g.input[1:])
    if len(states) != len(g.output) - 1 or len(initial) != len(states):
        raise ValueError(f"a step model has inputs [token, *state] and outputs [output, "
                         f"*state] (got {len(g.input)} inputs, {len(g.output)} outputs, "
                         f"{len(initial)} initial tensors)")
    previous_output = helper.make_tensor_value_info(
        "step/previous_output", TensorProto.FLOAT, [BATCH, output_width])
    del body.input[:]
    body.input.extend([previous_output])
    for value in (*states, token):
        copy = onnx.ValueInfoProto()
        copy.CopyFrom(value)
        copy.name = rename[value.name]
        body.input.append(copy)
    for value in body.output:
        value.name = rename[value.name]

    const = lambda name, values: numpy_helper.from_array(  # noqa: E731
        np.asarray(values, dtype=np.int64), name)
    nodes = [helper.make_node("Shape", [input_name], ["prompt/shape"]),
             helper.make_node("Gather", ["prompt/shape", "prompt/zero"], ["prompt/batch"],
                              axis=0)]
    inits = [const("prompt/zero", [0])]
    widths = {}

    def batch_shape(width: int) -> str:
        if width not in widths:
            widths[width] = f"prompt/shape_{width}"
            inits.append(const(f"prompt/width_{width}", [width]))
            nodes.append(helper.make_node("Concat", ["prompt/batch", f"prompt/width_{width}"],
                                          [widths[width]], axis=0))
        return widths[width]

    nodes.append(helper.make_node("ConstantOfShape", [batch_shape(output_width)],
                                  ["prompt/output0"],
                                  value=numpy_helper.from_array(np.zeros(1, np.float32))))
    starts = []
    for value, row in zip(states, initial):
        row = np.asarray(row, dtype=np.float32).reshape(1, -1)
        name = f"initial_{value.name}"
        inits.append(numpy_helper.from_array(row, name))
        nodes.append(helper.make_node("Expand", [name, batch_shape(row.shape[1])],
                                      [f"prompt/{name}"]))
        starts.append(f"prompt/{name}")
    outputs = [o.name for o in g.output]
    nodes.append(helper.make_node("Scan", ["prompt/output0", *starts, input_name], outputs,
                                  name="prompt/scan", body=body, num_scan_inputs=1,
                                  scan_input_axes=[1]))
    ids = helper.make_tensor_value_info(input_name, input_type, [BATCH, "length"])
    graph = helper.make_graph(nodes, "prompt", [ids], [_copy(o) for o in g.output],
                              initializer=[*g.initializer, *inits])
    model = helper.make_model(graph, opset_imports=list(step.opset_import),
                              producer_name=step.producer_name or "fastrwa")
    model.ir_version = step.ir_version
    return model


def _copy(value: onnx.ValueInfoProto) -> onnx.ValueInfoProto:
    out = onnx.ValueInfoProto()
    out.CopyFrom(value)
    return out


# -- weights: int8 and float16 -----------------------------------------------------------
def quantize_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxruntime's dynamic quantisation (``quantize_dynamic``): the weights of every
    ``MatMul`` and the embedding's ``Gather`` stored as int8 (per output channel), the
    activations quantised to uint8 at run time (standard ``DynamicQuantizeLinear`` /
    ``MatMulInteger``). The recurrence stays float32."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    root, quiet = logging.getLogger(), logging.NullHandler()
    before = logging.root.manager.disable
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.onnx"), os.path.join(tmp, "out.onnx")
        onnx.save(model, src)
        # (the quantiser's advice to pre-process, logged to the root logger: a handler of
        # our own keeps logging.warning from configuring the root logger, and it is muted)
        root.addHandler(quiet)
        logging.disable(logging.WARNING)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_dynamic(src, dst, weight_type=QuantType.QInt8, per_channel=True,
                                 op_types_to_quantize=["MatMul", "Gather"])
        finally:
            logging.disable(before)
            root.removeHandler(quiet)
        return onnx.load(dst)


def float16_weights(model: onnx.ModelProto, keep: Sequence[str] = ()) -> onnx.ModelProto:
    """The model with its weight matrices (float32 initializers of 2 or more dimensions,
    but those named in ``keep``) stored as float16, each widened back by a ``Cast`` to
    float32 in the graph: half the file, and every operation still float32 (onnxruntime's
    CPU kernels for float16 arithmetic are few; the recurrence needs float32)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    casts, kept = [], []
    for init in graph.initializer:
        array = numpy_helper.to_array(init)
        if init.data_type != TensorProto.FLOAT or array.ndim < 2 or init.name in keep:
            kept.append(init)
            continue
        half = numpy_helper.from_array(array.astype(np.float16), f"{init.name}.float16")
        kept.append(half)
        casts.append(helper.make_node("Cast", [half.name], [init.name], to=TensorProto.FLOAT,
                                      name=f"{init.name}.to_float32"))
    del graph.initializer[:]
    graph.initializer.extend(kept)
    nodes = list(graph.node)
    del graph.node[:]
    graph.node.extend(casts + nodes)
    return out


def _convert(model: onnx.ModelProto, weights: str, keep: Sequence[str] = ()) -> onnx.ModelProto:
    if weights == "int8":
        return quantize_int8(model)
    if weights == "float16":
        return float16_weights(model, keep)
    return model


def _check_weights(weights: object) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")


# -- a ByteLM ------------------------------------------------------------------------------
def initial_state_rows(model: ByteLM) -> list[np.ndarray]:
    """The model's initial state as ``(1, d_model)`` float32 arrays in the order of the
    step's state inputs (what ``prompt.onnx`` starts from)."""
    with torch.no_grad():
        state = model.allocate_cache(1).state
    return [t.detach().float().cpu().numpy() for layer in state.layers
            for t in (*layer.scan, *((layer.last_input,) if layer.last_input is not None
                                     else ()))]


def bytelm_onnx(model: ByteLM, weights: str = "float32", exporter: str = "torchscript",
                opset: int = OPSET) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """The ONNX models of ``model`` in memory: ``(prompt, step, config)`` (``config``: what
    :func:`export_onnx` writes to ``onnx_config.json``). See :func:`export_onnx`."""
    if not isinstance(model, ByteLM):
        raise TypeError(f"model must be a fastrwa.models.ByteLM (an rda/rwa model), got "
                        f"{type(model).__name__}: the baselines are not exported to ONNX")
    _check_weights(weights)
    was_training = model.training
    model.eval()
    try:
        step_module = ByteLMStep(model)          # (refuses a layer it cannot express)
        names = state_names(model)
        outputs = ["logits", *state_names(model, "next_state")]
        batch = 2                                # (not 1: no size-1 axis is specialised)
        rows = initial_state_rows(model)
        with torch.no_grad():
            device = model.embed.weight.device
            args = (torch.full((batch,), 65, dtype=torch.long, device=device),
                    *(torch.from_numpy(r).to(device).expand(batch, -1).contiguous()
                      for r in rows))
            step = _export_module(step_module, args, ["ids", *names], outputs, exporter,
                                  opset)
    finally:
        model.train(was_training)
    vocab = model.config.vocab_size
    step = _convert(step, weights)
    prompt = prompt_from_step(step, rows, vocab)
    config = dict(format=FORMAT, version=VERSION, weights=weights, exporter=exporter,
                  opset=max(o.version for o in step.opset_import if o.domain in ("", "ai.onnx")),
                  vocab_size=vocab, bos_token=model.config.bos_token, bytes=256,
                  d_model=model.config.d_model, n_layers=model.config.n_layers,
                  token_shift=model.config.token_shift,
                  inputs=dict(prompt=["ids"], step=["ids", *names]),
                  outputs=dict(prompt=outputs, step=outputs),
                  state=names, next_state=outputs[1:],
                  model=model.config.to_dict())
    for m in (prompt, step):
        helper.set_model_props(m, {PROPS_KEY: json.dumps({k: config[k] for k in PROPS})})
        onnx.checker.check_model(m)
    return prompt, step, config


def export_onnx(model: "ByteLM | str | os.PathLike", out_dir: "str | os.PathLike",
                weights: str = "float32", exporter: str = "torchscript", best: bool = False,
                overwrite: bool = False, opset: int = OPSET) -> Path:
    """Write ``prompt.onnx``, ``step.onnx`` and ``onnx_config.json`` for a ``ByteLM`` (or
    the model of a training run or model directory, as :func:`fastrwa.models.load_pretrained`
    reads it; ``best``: a run's best-validation model) into ``out_dir``; returns it.

    * ``prompt.onnx``: ``ids`` ``(batch, length)`` int64 (``length >= 1``; the model's own
      ids: bytes, or the BOS id 256 to start from nothing) -> ``logits`` ``(batch,
      vocab_size)`` of the last position and the state after it, ``next_state.{i}.m``,
      ``.n``, ``.d`` (and ``.last`` with ``token_shift``), each ``(batch, d_model)``
      float32, for every block ``i``; from the model's learned initial state.
    * ``step.onnx``: ``ids`` ``(batch,)`` and ``state.{i}.*`` (the same tensors) ->
      ``logits`` and ``next_state.{i}.*``.

    ``weights``: "float32" (the model's numbers), "int8" (onnxruntime's dynamic
    quantisation of the matrices, :func:`quantize_int8`) or "float16" (matrices stored as
    float16, computed in float32: :func:`float16_weights`). ``exporter``: see
    :func:`_export_module`. ``onnx_config.json`` records each ``.onnx`` file's size and
    SHA-256 (:class:`~fastrwa.export.OnnxLM` refuses files that do not match).

    The directory is written whole or not at all: staged beside ``out_dir`` and renamed
    into place (:func:`fastrwa.models.files.staged_directory`; a full disk, Ctrl-C or a
    kill leaves ``out_dir`` as it was). An existing non-empty ``out_dir`` is replaced only
    with ``overwrite``, and only if it is an earlier export (:data:`OUTPUT`): else
    ``ValueError`` naming it, before anything is exported; a baseline is refused
    (:func:`fastrwa.models.load_bytelm`); a failed write is a
    :class:`~fastrwa.models.files.WriteError` naming ``out_dir``, the file and the
    cause."""
    out_dir = Path(out_dir)
    check_output_directory(out_dir, overwrite, OUTPUT)   # (before the work)
    if not isinstance(model, nn.Module):
        model = load_bytelm(model, best, USE)
    prompt, step, config = bytelm_onnx(model, weights, exporter, opset)
    graphs = {PROMPT: prompt.SerializeToString(), STEP: step.SerializeToString()}
    config[FILES_KEY] = {name: file_record(content) for name, content in graphs.items()}
    with staged_directory(out_dir, overwrite, OUTPUT) as staging:
        for name, content in (*graphs.items(),
                              (CONFIG, (json.dumps(config, indent=2) + "\n").encode())):
            write_file(staging / name, content)
    return out_dir


# -- a scan layer --------------------------------------------------------------------------
def layer_step_onnx(layer: nn.Module, weights: str = "float32", exporter: str = "torchscript",
                    opset: int = OPSET) -> onnx.ModelProto:
    """The step of an ``RWA``/``RDA`` layer as an ONNX model: ``x`` ``(batch, input_size)``
    float32 and ``state.m``, ``state.n``, ``state.d`` ``(batch, hidden_size)`` (and
    ``state.last`` ``(batch, input_size)`` with ``token_shift``) -> ``y`` ``(batch,
    hidden_size)`` and ``next_state.*``. A bidirectional layer is refused (``ValueError``);
    every other option exports. The layer's initial state is ``layer.initial_state(B)``
    (its rows are the same for every sequence)."""
    check_exportable(layer)
    _check_weights(weights)
    with torch.no_grad():
        initial = layer.initial_state(2)
        dev = layer.proj.weight.device
        state = [t.float() for t in (*initial.scan, *((initial.last_input,)
                                                      if layer.token_shift else ()))]
        x = torch.zeros(2, layer.input_size, device=dev)
    step = _export_module(LayerStep(layer), (x, *state), ["x", *layer_state_names(layer)],
                          ["y", *layer_state_names(layer, "next_state")], exporter, opset)
    step = _convert(step, weights)
    onnx.checker.check_model(step)
    return step


def export_layer_step(layer: nn.Module, path: "str | os.PathLike", weights: str = "float32",
                      exporter: str = "torchscript", opset: int = OPSET) -> Path:
    """Write :func:`layer_step_onnx` to ``path`` (whole or not at all:
    :func:`fastrwa.models.files.write_atomically`); returns it."""
    path = Path(path)
    content = layer_step_onnx(layer, weights, exporter, opset).SerializeToString()
    write_atomically(path, lambda f: f.write(content))
    return path

