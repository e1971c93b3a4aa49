"""The networks ``--model`` names for vector inputs (the synthetic tasks, pixels): one class
for every recurrent core. Byte corpora train the language models of :mod:`fastrwa.models`
(:data:`LM_LAYERS`), configured by :func:`lm_config`."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from ..models import LMConfig, build
from ..models.config import LAYER_FIELDS, OPTIONAL_FIELDS
from ..nn import RDA, RWA, RDACell, Recurrent, RRACell, RWACell
from .config import LM_FLAG_FIELDS, LM_ONLY_MODELS, RunConfig

MODELS = ("rda-scan", "rwa-scan", "rwa-cell", "rda-cell", "rra-cell", "lstm", "gru", "rnn")
# The byte corpora's language models: --model -> fastrwa.models.LMConfig.layer
LM_LAYERS = {"rda-scan": "rda", "rwa-scan": "rwa", "lstm": "lstm", "gru": "gru",
             **{m: m for m in LM_ONLY_MODELS}}


class SequenceNet(nn.Module):
    """``layers x recurrent core -> linear head``, outputs at every step.

    Args:
        kind: one of :data:`MODELS`.
        input_size: features per step.
        hidden: units per layer (the papers use 250).
        layers: stacked recurrent layers.
        output_size: head outputs per step.
        attention: ``f_a`` of the RDA layers and cells.
        preset: an RDA preset of the scan layers ("exp-tanh", "sigmoid-id": the RDA paper's
            two variants), overriding ``attention``; ``None`` for ``attention`` with the
            layer's default output functions.

    ``out, state = net(x, state=None)``; ``state`` can be carried to the next call (TBPTT).
    """

    def __init__(self, kind: str, input_size: int, hidden: int, layers: int, output_size: int,
                 attention: str = "exp", preset: str | None = None):
        super().__init__()
        if kind not in MODELS:
            raise ValueError(f"--model must be one of {MODELS}, got {kind!r}")
        for name, value in (("--hidden", hidden), ("--layers", layers)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if preset is not None and kind != "rda-scan":
            raise ValueError(f"an RDA preset applies to --model rda-scan, not {kind}")
        self.kind = kind
        features = input_size
        sizes = [features] + [hidden] * layers
        if kind in ("lstm", "gru", "rnn"):
            self.core = getattr(nn, kind.upper())(features, hidden, layers, batch_first=True)
        elif kind == "rwa-scan":
            self.core = nn.ModuleList(RWA(i, hidden) for i in sizes[:-1])
        elif kind == "rda-scan":
            self.core = nn.ModuleList(RDA(i, hidden, attention=attention, preset=preset)
                                      for i in sizes[:-1])
        else:
            make = {"rwa-cell": lambda i: RWACell(i, hidden),
                    "rda-cell": lambda i: RDACell(i, hidden, attention=attention),
                    "rra-cell": lambda i: RRACell(i, hidden)}[kind]
            self.core = nn.ModuleList(Recurrent(make(i)) for i in sizes[:-1])
        self.head = nn.Linear(hidden, output_size)

    def forward(self, x: Tensor, state=None) -> tuple[Tensor, object]:
        if isinstance(self.core, nn.RNNBase):
            h, state = self.core(x, state)
            return self.head(h), state
        states = state if state is not None else (None,) * len(self.core)
        new = []
        for layer, layer_state in zip(self.core, states):
            x, layer_state = layer(x, layer_state)
            new.append(layer_state)
        return self.head(x), tuple(new)


def detach_state(state):
    """The state with every tensor detached (truncated backpropagation through time)."""
    return torch.utils._pytree.tree_map(
        lambda t: t.detach() if isinstance(t, Tensor) else t, state)


def lm_config(cfg: RunConfig) -> LMConfig:
    """The :class:`LMConfig` of a language-model run: ``--model``, ``--hidden``, ``--layers``,
    ``--attention``, the context (``--bptt``: a Transformer's window), then the ``--lm``
    fields over the defaults."""
    known = {f.name for f in dataclasses.fields(LMConfig)}
    unknown = sorted(set(cfg.lm) - known)
    if unknown:
        raise ValueError(f"--lm {unknown[0]}=...: LMConfig has no field {unknown[0]!r}; its "
                         f"fields: {', '.join(sorted(known - set(LM_FLAG_FIELDS)))}")
    try:
        return LMConfig(layer=LM_LAYERS[cfg.model], d_model=cfg.hidden, n_layers=cfg.layers,
                        attention=cfg.attention, context=cfg.bptt, **cfg.lm)
    except TypeError as exc:           # a bool given a number
        raise ValueError(f"--lm: {exc}") from exc


def check_lm_flags(model: str, lm: dict, attention_given: bool) -> None:
    """Refuse the ``--lm`` fields, and ``--attention``, that ``--model``'s language model does
    not read (:data:`fastrwa.models.config.LAYER_FIELDS`), and RDA's attention and output
    functions next to a ``preset`` (which sets them): the run would ignore them, and look like
    an ablation that changed nothing. Fields no model has are left to :class:`LMConfig`.
    """
    layer = LM_LAYERS.get(model)
    if layer is None:
        return
    read = LAYER_FIELDS[layer]
    flag = {"attention": "--attention"}             # set by its own flag, not --lm
    unread = [f"--lm {name}" for name in lm if name in OPTIONAL_FIELDS and name not in read]
    if attention_given and "attention" not in read:
        unread.insert(0, "--attention")
    if unread:
        reads = ", ".join(flag.get(name, name) for name in read) or "none of the optional fields"
        it = "it" if len(unread) == 1 else "them"
        raise ValueError(f"{', '.join(unread)}: --model {model} does not read {it} (it reads "
                         f"{reads}); the run would ignore {it}")
    if lm.get("preset") is not None:
        overridden = (["--attention"] if attention_given else []) + \
            [f"--lm {name}" for name in ("f_h", "f_o") if name in lm]
        if overridden:
            it = "it" if len(overridden) == 1 else "them"
            raise ValueError(f"{', '.join(overridden)}: --lm preset={lm['preset']} sets RDA's "
                             f"attention and output functions; the run would ignore {it}")


def with_every_lm_field(cfg: RunConfig) -> RunConfig:
    """A new language-model run records every ``LMConfig`` field in ``lm``, not only those
    given, so that a resume builds the same model whatever the defaults are by then."""
    if not cfg.is_lm or cfg.model not in LM_LAYERS:
        return cfg
    fields = lm_config(cfg).to_dict()
    for reserved in LM_FLAG_FIELDS:
        del fields[reserved]
    return dataclasses.replace(cfg, lm=fields)


def build_model(cfg: RunConfig, problem) -> torch.nn.Module:
    """The network ``--model`` names: for a byte corpus a language model (``ByteLM`` for the
    scan models, ``RecurrentLM`` for the LSTM/GRU baselines, ``TransformerLM``, ``MinGRULM``;
    :func:`fastrwa.models.build`) configured by ``--hidden``,
    ``--layers``, ``--attention`` and ``--lm``; otherwise a :class:`SequenceNet`."""
    if not cfg.is_lm:
        return SequenceNet(cfg.model, problem.input_size, cfg.hidden, cfg.layers,
                           problem.output_size, attention=cfg.attention)
    if cfg.model not in LM_LAYERS:
        raise ValueError(f"--model {cfg.model} is not a language model; --task {cfg.task} "
                         f"trains one of {sorted(LM_LAYERS)}")
    return build(lm_config(cfg))
