"""``metrics.jsonl``: one JSON object per logged train step or evaluation (``step``,
``split``, ``loss``, the task's metric). One reader, for the trainer's resume and the plots."""

from __future__ import annotations

import json
from pathlib import Path


def read_records(path: Path) -> tuple[list[str], list[dict]]:
    """The file's non-empty lines and their records, aligned. A last line cut short (a run
    killed mid-write) is dropped; any other line that is not a record raises ``ValueError``
    naming the file and the line."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    records = []
    for k, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if k == len(lines) - 1:
                return lines[:k], records
            raise ValueError(f"{path}: line {k + 1} is not JSON; the metrics file is corrupt")
        if not (isinstance(record, dict) and isinstance(record.get("step"), int)
                and isinstance(record.get("split"), str)):
            raise ValueError(f"{path}: line {k + 1} is not a metrics record (a JSON object with "
                             f"an integer 'step' and a 'split'); the metrics file is corrupt")
        records.append(record)
    return lines, records
