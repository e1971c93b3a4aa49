"""The run configuration: every flag of ``python -m fastrwa.train`` that shapes a run."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

# Flags that may change when a run is resumed (they do not change what has been computed).
RESUMABLE_CHANGES = ("steps", "eval_every", "log_every", "checkpoint_every", "progress")


@dataclasses.dataclass
class RunConfig:
    """Defaults follow the RWA/RDA papers where they say (250 units, batch 100, Adam 1e-3,
    gradient clipping at norm 1) and keep the default run (adding, T=100) to minutes on a CPU."""

    task: str = "adding"
    model: str = "rwa-scan"
    seq_len: int = 100
    hidden: int = 250
    layers: int = 1
    attention: str = "exp"
    batch_size: int = 100
    lr: float = 1e-3
    clip: float = 1.0
    steps: int = 1000
    seed: int = 0
    bptt: int = 128
    data: Optional[str] = None
    eval_every: int = 100
    eval_batches: int = 4
    eval_bytes: int = 200_000
    log_every: int = 10
    checkpoint_every: int = 100
    compile: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        """Refuse values no run can use, naming the flag (``ValueError``)."""
        flag = lambda name: "--" + name.replace("_", "-")          # noqa: E731
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), field.type
            if kind in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{flag(field.name)} must be an integer, got {value!r}")
            if kind in ("float", float) and (isinstance(value, bool)
                                              or not isinstance(value, (int, float))):
                raise ValueError(f"{flag(field.name)} must be a number, got {value!r}")
            if kind in ("bool", bool) and not isinstance(value, bool):
                raise ValueError(f"{field.name} must be true or false, got {value!r}")
            if kind in ("str", str) and not isinstance(value, str):
                raise ValueError(f"{flag(field.name)} must be a string, got {value!r}")
        for name in ("seq_len", "hidden", "layers", "batch_size", "steps", "bptt", "eval_every",
                     "eval_batches", "log_every", "checkpoint_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)} must be at least 1, got {getattr(self, name)}")
        if self.eval_bytes < 0:
            raise ValueError(f"--eval-bytes must be 0 (all) or more, got {self.eval_bytes}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a finite number above 0, got {self.lr}")
        if not (math.isfinite(self.clip) and self.clip >= 0):
            raise ValueError(f"--clip must be a finite number, 0 (off) or more, got {self.clip}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a run configuration must be a JSON object, got "
                             f"{type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def incompatible_with(self, saved: "RunConfig") -> list[str]:
        """Fields that differ from a saved run's and may not change on ``--resume``."""
        return [f"{name}: saved {getattr(saved, name)!r}, given {getattr(self, name)!r}"
                for name in (f.name for f in dataclasses.fields(self))
                if name not in RESUMABLE_CHANGES and getattr(self, name) != getattr(saved, name)]
