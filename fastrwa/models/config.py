"""Configuration of the byte-level language model."""

from __future__ import annotations

import dataclasses
from typing import Any

from ..nn.checks import check_groups
from ..nn.functional import ACTIVATIONS, RDA_PRESETS
from ..kernels.codes import ATTENTIONS

BYTE_VOCAB = 256
# The layers of a ByteLM (its blocks' scan layer); the others are the baselines'.
SCAN_LAYERS = ("rda", "rwa")
LAYERS = SCAN_LAYERS + ("lstm", "gru", "transformer", "mingru")
DISCOUNT_INITS = ("paper", "spread")
# The fields each layer reads beyond those every model reads (vocab_size, d_model, n_layers,
# layer, tie_embeddings, and context, which a training run sets to its BPTT for every model).
# A layer ignores the others; the training CLI refuses them (fastrwa.train.models.check_lm_flags).
LAYER_FIELDS = {
    "rda": ("attention", "f_h", "f_o", "preset", "token_shift", "discount_init",
            "discount_groups", "output_gate", "learn_initial_state", "mlp_ratio"),
    "rwa": ("token_shift", "output_gate", "learn_initial_state", "mlp_ratio"),
    "lstm": (),
    "gru": (),
    "mingru": ("mlp_ratio",),
    "transformer": ("mlp_ratio", "n_heads"),
}
OPTIONAL_FIELDS = frozenset(name for fields in LAYER_FIELDS.values() for name in fields)


def heads_split_evenly(d_model: int, n_heads: int) -> bool:
    """Whether ``n_heads`` heads split ``d_model`` channels into heads of an even width (the
    Transformer's rotary positions turn pairs of channels)."""
    return n_heads >= 1 and d_model % n_heads == 0 and (d_model // n_heads) % 2 == 0


@dataclasses.dataclass
class LMConfig:
    """Hyper-parameters of :class:`fastrwa.models.ByteLM`.

    Attributes:
        vocab_size: 256 byte values plus a beginning-of-sequence token (id 256), which
            starts generation from an empty prompt. enwik8 and any byte file need no more.
        d_model: width of the residual stream and of every scan layer.
        n_layers: number of blocks (pre-norm -> scan layer -> residual -> MLP -> residual).
        layer: "rda" or "rwa" (:class:`ByteLM`), or the baselines "lstm", "gru"
            (:class:`RecurrentLM`: the same embedding, norm and head around PyTorch's RNN),
            "transformer" (:class:`TransformerLM`) and "mingru" (:class:`MinGRULM`).
        attention, f_h, f_o: the RDA layer's ``f_a`` and output functions (ignored for "rwa").
        preset: an RDA preset ("exp-tanh", "sigmoid-id") that overrides the three above.
        token_shift: scan-layer gates also see the previous token's input.
        discount_init: "paper" (the RDA paper's discount bias of 1 in every channel: a memory
            of about 3.7 tokens) or "spread" (per channel, memory lengths log-uniform from 2
            tokens to a longest one that grows with depth: 16 in the first block, 1024 in the
            last; :meth:`fastrwa.nn.RDA.set_discount_timescales`; with ``discount_groups``,
            the groups'). RDA only.
        discount_groups: ``None`` (a discount per channel, the paper's) or an int dividing
            ``d_model``: one discount per group of ``d_model / discount_groups`` channels
            (:class:`fastrwa.nn.RDA`'s ``discount_groups``). RDA only.
        output_gate: each block multiplies its scan layer's output by ``sigmoid(W x)`` of
            the block's normalised input before the residual add (a ``d_model x d_model``
            projection more per block, as gated linear RNNs gate their outputs). A saved
            ``config.json`` without this field was written by a model without the gate and
            loads as ``False`` through every loader (:data:`FIELDS_BEFORE_THEY_EXISTED`:
            :func:`fastrwa.models.load_pretrained`, ``ByteLM.load``, ``AutoConfig`` and
            ``AutoModelForCausalLM``).
        learn_initial_state: each scan layer learns its prior pseudo-step ``(s_0, a_0)``, the
            RWA paper's learned initial state (:class:`fastrwa.nn.RDA`); ``False`` starts every
            sequence from an empty state. Scan layers only. A saved ``config.json`` without
            this field loads as ``True``, what every earlier model had.
        mlp_ratio: hidden width of each MLP over ``d_model``.
        tie_embeddings: the output head reuses the input embedding matrix.
        n_heads: attention heads of "transformer" (``d_model / n_heads`` even).
        context: "transformer"'s window in bytes (even; a training run sets it to its
            BPTT); other layers ignore it.

    Each layer reads only its own fields (:data:`LAYER_FIELDS`) and ignores the rest; the
    training CLI refuses ``--lm`` fields the model does not read.
    """

    vocab_size: int = BYTE_VOCAB + 1
    d_model: int = 256
    n_layers: int = 4
    layer: str = "rda"
    attention: str = "sigmoid"
    f_h: str = "identity"
    f_o: str = "identity"
    preset: str | None = None
    token_shift: bool = True
    discount_init: str = "paper"
    discount_groups: int | None = None
    output_gate: bool = True
    learn_initial_state: bool = True
    mlp_ratio: int = 4
    tie_embeddings: bool = True
    n_heads: int = 4
    context: int = 128

    @property
    def bos_token(self) -> int:
        return BYTE_VOCAB

    @property
    def eos_token(self) -> int:
        """The id that ends a text: BOS's (one id both ends a document and starts the next,
        as GPT-2's ``<|endoftext|>``). The model never generates it (generation suppresses
        the ids past the bytes), so generation still ends at its length or a stop string;
        it is there for the tokenizers and harnesses that need an EOS (lm-eval's
        ``generate_until`` adds its text to the stop strings)."""
        return self.bos_token

    def __post_init__(self) -> None:
        positive = ("vocab_size", "d_model", "n_layers", "mlp_ratio", "n_heads", "context")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"LMConfig.{name} must be a positive int, got {value!r}")
        for name in ("token_shift", "output_gate", "learn_initial_state", "tie_embeddings"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"LMConfig.{name} must be True or False, got "
                                f"{getattr(self, name)!r}")
        if self.vocab_size <= BYTE_VOCAB:
            raise ValueError(f"LMConfig.vocab_size must be > {BYTE_VOCAB} (bytes plus BOS), "
                             f"got {self.vocab_size}")
        if self.layer not in LAYERS:
            raise ValueError(f"LMConfig.layer must be one of {LAYERS}, got {self.layer!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"LMConfig.attention must be one of {ATTENTIONS}, "
                             f"got {self.attention!r}")
        for name in ("f_h", "f_o"):
            if getattr(self, name) not in ACTIVATIONS:
                raise ValueError(f"LMConfig.{name} must be one of {sorted(ACTIVATIONS)}, "
                                 f"got {getattr(self, name)!r}")
        if self.discount_init not in DISCOUNT_INITS:
            raise ValueError(f"LMConfig.discount_init must be one of {DISCOUNT_INITS}, "
                             f"got {self.discount_init!r}")
        check_groups(self.discount_groups, "LMConfig.discount_groups",
                     self.d_model if self.layer == "rda" else None, "d_model")
        if self.layer == "transformer":
            if not heads_split_evenly(self.d_model, self.n_heads):
                raise ValueError(f"LMConfig.n_heads ({self.n_heads}) must divide d_model "
                                 f"({self.d_model}) into even head widths (rotary positions "
                                 f"turn pairs of channels)")
            if self.context % 2:
                raise ValueError(f"LMConfig.context must be even for a transformer (sliding "
                                 f"windows start every context / 2 bytes), got {self.context}")
        if self.preset is not None and self.preset not in RDA_PRESETS:
            raise ValueError(f"LMConfig.preset must be one of {sorted(RDA_PRESETS)} or None, "
                             f"got {self.preset!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "LMConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown LMConfig fields {unknown}; known: {sorted(known)}")
        return cls(**data)


# A saved model (load_pretrained) or run (--resume) whose configuration lacks one of these
# fields was written before the field existed, by a model built without it: it loads as it
# was built, whatever the field's default is now.
FIELDS_BEFORE_THEY_EXISTED = {"output_gate": False, "learn_initial_state": True}
