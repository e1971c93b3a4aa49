"""The run configuration: every flag of ``python -m fastrwa.train`` that shapes a run."""

from __future__ import annotations

import dataclasses
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def incompatible_with(self, saved: "RunConfig") -> list[str]:
        """Fields that differ from a saved run's and may not change on ``--resume``."""
        return [f"{name}: saved {getattr(saved, name)!r}, given {getattr(self, name)!r}"
                for name in (f.name for f in dataclasses.fields(self))
                if name not in RESUMABLE_CHANGES and getattr(self, name) != getattr(saved, name)]
