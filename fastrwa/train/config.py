"""The run configuration: every flag of ``python -m fastrwa.train`` that shapes a run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any, Optional

from ..models.config import BYTE_VOCAB, LMConfig, heads_split_evenly
from ..models.sampling import FLOAT32_MAX   # the largest float32: the largest usable --lr
from ..options import DEVICES               # --device, as every command takes it

# Flags that may change when a run is resumed (they do not change what has been computed).
RESUMABLE_CHANGES = ("steps", "eval_every", "log_every", "checkpoint_every", "progress",
                     "device")
# Of those, the ones that define the run's schedule: a resume that changes them records them
# in config.json (a later plain --resume keeps them); --device and --no-progress apply to one
# invocation only.
RECORDED_ON_RESUME = ("steps", "eval_every", "log_every", "checkpoint_every")
# Flags a resume may give another value that names the same thing: --data, the corpus by
# another path (the checkpoint's size and sha256 of the bytes decide; recorded in
# config.json, so that a later plain --resume finds it there).
RELOCATABLE = ("data",)
LM_TASKS = ("enwik8", "text")
LM_ONLY_MODELS = ("transformer", "mingru")    # --model values for byte corpora only
# LMConfig fields that a run sets by its own flags (--model, --hidden, --layers, --attention,
# --bptt), never through --lm.
LM_FLAG_FIELDS = ("layer", "d_model", "n_layers", "attention", "context")
SCHEDULES = ("constant", "cosine")
AUTOCASTS = ("none", "bf16")
MAX_TRAIN_SEED = 2 ** 32 - 1          # seeds derived from --seed must fit torch's 64 bits

# Defaults per kind of task, for the fields left as None. The synthetic and image tasks
# follow the RWA/RDA papers (250 units, batch 100, Adam 1e-3, clipping at norm 1); the byte
# language models follow current LM practice (docs/lm.md): a 4-block ByteLM of width 256,
# AdamW with weight decay, linear warmup then cosine decay, BPTT 128.
DEFAULTS = {
    "sequence": dict(model="rwa-scan", attention="exp", hidden=250, layers=1, batch_size=100,
                     lr=1e-3, weight_decay=0.0, warmup=0, schedule="constant", steps=1000,
                     eval_every=100, checkpoint_every=100),
    "lm": dict(model="rda-scan", attention="sigmoid", hidden=256, layers=4, batch_size=32,
               lr=2e-3, weight_decay=0.1, warmup=200, schedule="cosine", steps=5000,
               eval_every=500, checkpoint_every=500),
}


def flag_name(field: str) -> str:
    """The command-line flag of a :class:`RunConfig` field: ``eval_every`` -> ``--eval-every``."""
    return "--" + field.replace("_", "-")


@dataclasses.dataclass
class RunConfig:
    """Every flag that shapes a run. Fields left ``None`` take the defaults of the task's
    kind (:data:`DEFAULTS`): the papers' settings for the synthetic and image tasks, an LM
    recipe for the byte corpora. ``lm`` holds :class:`fastrwa.models.LMConfig` fields for
    the byte tasks (``--lm KEY=VALUE``)."""

    task: str = "adding"
    model: Optional[str] = None
    seq_len: int = 100
    hidden: Optional[int] = None
    layers: Optional[int] = None
    attention: Optional[str] = None
    batch_size: Optional[int] = None
    lr: Optional[float] = None
    weight_decay: Optional[float] = None
    warmup: Optional[int] = None
    schedule: Optional[str] = None
    decay_steps: Optional[int] = None
    accum: int = 1
    context_parallel: int = 1
    clip: float = 1.0
    steps: Optional[int] = None
    seed: int = 0
    bptt: int = 128
    data: Optional[str] = None
    pack: Optional[str] = None        # --pack: the documents' separator (None: not packed)
    device: str = "auto"
    autocast: str = "none"
    lm: dict = dataclasses.field(default_factory=dict)
    eval_every: Optional[int] = None
    eval_batches: int = 4
    eval_bytes: int = 0
    log_every: int = 10
    checkpoint_every: Optional[int] = None
    compile: bool = False
    progress: bool = True

    @property
    def is_lm(self) -> bool:
        return self.task in LM_TASKS

    def __post_init__(self) -> None:
        """Refuse values no run can use, naming the flag (``ValueError``)."""
        flag = flag_name
        for name, value in DEFAULTS["lm" if self.is_lm else "sequence"].items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        if self.decay_steps is None:        # the schedule's length, fixed when a run starts
            self.decay_steps = self.steps
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), field.type
            kind = {"Optional[int]": "int", "Optional[float]": "float",
                    "Optional[str]": "str"}.get(kind, kind)
            if field.name in ("data", "pack") and value is None:
                continue
            if kind in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{flag(field.name)} must be an integer, got {value!r}")
            if kind in ("float", float) and (isinstance(value, bool)
                                              or not isinstance(value, (int, float))):
                raise ValueError(f"{flag(field.name)} must be a number, got {value!r}")
            if kind in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{field.name} must be true or false, got {value!r}")
            if kind in ("str", str) and not isinstance(value, str):
                raise ValueError(f"{flag(field.name)} must be a string, got {value!r}")
            if kind in ("dict", dict) and not isinstance(value, dict):
                raise ValueError(f"{field.name} must be a mapping, got {value!r}")
        for name in ("seq_len", "hidden", "layers", "batch_size", "steps", "bptt", "eval_every",
                     "eval_batches", "log_every", "checkpoint_every", "accum", "decay_steps",
                     "context_parallel"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.eval_bytes < 0:
            raise ValueError(f"--eval-bytes must be 0 (all) or more, got {self.eval_bytes}")
        if not (math.isfinite(self.lr) and 0 < self.lr <= FLOAT32_MAX):
            raise ValueError(f"--lr must be a finite number above 0 and at most "
                             f"{FLOAT32_MAX!r} (the parameters are float32), got {self.lr}")
        if not (math.isfinite(self.clip) and self.clip >= 0):
            raise ValueError(f"--clip must be a finite number, 0 (off) or more, got {self.clip}")
        # AdamW multiplies the weights by 1 - lr * weight_decay every step: from a product
        # of 1 on, that zeroes or flips them (and past float32's range it overflows).
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0
                and self.lr * self.weight_decay < 1):
            raise ValueError(f"--weight-decay must be a finite number >= 0 with --lr times "
                             f"--weight-decay below 1 (AdamW multiplies the weights by "
                             f"1 - lr * weight_decay), got {self.weight_decay} with --lr "
                             f"{self.lr}")
        if not 0 <= self.seed <= MAX_TRAIN_SEED:
            raise ValueError(f"--seed must be an integer from 0 to {MAX_TRAIN_SEED} (2**32 - 1), "
                             f"got {self.seed}")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be 0 (none) or more steps, got {self.warmup}")
        for name, allowed in (("device", DEVICES), ("schedule", SCHEDULES),
                              ("autocast", AUTOCASTS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{flag(name)} must be one of {allowed}, "
                                 f"got {getattr(self, name)!r}")
        reserved = sorted(set(self.lm) & set(LM_FLAG_FIELDS))
        if reserved:
            raise ValueError(f"--lm {reserved[0]}=... is set by --hidden, --layers, --model, "
                             f"--attention and --bptt; use those flags")
        if "vocab_size" in self.lm and self.lm["vocab_size"] != BYTE_VOCAB + 1:
            raise ValueError(f"--lm vocab_size must be {BYTE_VOCAB + 1} (the {BYTE_VOCAB} byte "
                             f"values and the beginning-of-sequence id) for a byte corpus, got "
                             f"{self.lm['vocab_size']!r}")
        if self.context_parallel > 1:
            if not self.is_lm or self.model not in ("rda-scan", "rwa-scan"):
                raise ValueError(f"--context-parallel splits a language model's BPTT segments "
                                 f"along time: it needs --task {' or '.join(LM_TASKS)} and "
                                 f"--model rda-scan or rwa-scan, got --task {self.task} "
                                 f"--model {self.model}")
            if self.bptt < self.context_parallel:
                raise ValueError(f"--bptt ({self.bptt}) must be at least --context-parallel "
                                 f"({self.context_parallel}): every process holds a slice of "
                                 f"at least one byte")
            if self.compile:
                raise ValueError("--compile and --context-parallel cannot be combined (the "
                                 "context-parallel layers' collectives run eagerly)")
        if self.pack is not None:
            if not self.is_lm or self.model not in ("rda-scan", "rwa-scan"):
                raise ValueError(f"--pack reads a byte corpus as documents run from the "
                                 f"initial state (cu_seqlens): it needs --task "
                                 f"{' or '.join(LM_TASKS)} and --model rda-scan or rwa-scan, "
                                 f"got --task {self.task} --model {self.model}")
            if not self.pack:
                raise ValueError("--pack SEP: the separator must not be empty (--pack alone "
                                 "separates documents at blank lines, '\\n\\n')")
        if self.model in LM_ONLY_MODELS and not self.is_lm:
            raise ValueError(f"--model {self.model} is a language model: it trains on a byte "
                             f"corpus (--task {' or '.join(LM_TASKS)}), not --task {self.task}")
        if self.lm and not self.is_lm:
            raise ValueError(f"--lm sets language-model fields; --task {self.task} is not a "
                             f"byte corpus ({LM_TASKS})")
        if self.model == "transformer":
            heads = self.lm.get("n_heads", LMConfig.n_heads)
            if self.bptt % 2:
                raise ValueError(f"--bptt is the transformer's context and must be even (its "
                                 f"sliding windows start every --bptt / 2 bytes), got {self.bptt}")
            if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1:
                raise ValueError(f"--lm n_heads must be a positive int, got {heads!r}")
            if not heads_split_evenly(self.hidden, heads):
                raise ValueError(f"--hidden ({self.hidden}) must split into --lm n_heads={heads} "
                                 f"heads of an even width (rotary positions rotate pairs)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a run configuration must be a JSON object, got "
                             f"{type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def parse_lm_field(text: str) -> tuple[str, object]:
    """``--lm KEY=VALUE``: the value read as JSON (numbers, true/false, null), else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (an LMConfig field), got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value
