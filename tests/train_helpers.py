"""What the training tests share: tiny runs of the trainer in this process
(``python -m fastrwa.train``'s ``main``), their flags and a corpus."""

import os
from pathlib import Path

from fastrwa.train.cli import main as train_main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
SYNTHETIC = ["--seq-len", 10, "--hidden", 4, "--batch-size", 2, "--log-every", 1]


def _run(tmp_path: Path, name: str, *flags) -> tuple[int, Path]:
    args = ["--run-dir", str(tmp_path / name), "--no-progress", *map(str, flags)]
    return train_main(args), tmp_path / name


def _resume(run: Path, *flags) -> int:
    return train_main(["--resume", str(run), "--no-progress", *map(str, flags)])


def _corpus(tmp_path: Path, name: str = "corpus.txt", n: int = 6_000) -> Path:
    path = tmp_path / name
    path.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(n)))
    return path


def _lm_flags(corpus: Path) -> list:
    return ["--task", "text", "--data", corpus, "--hidden", 8, "--layers", 1, "--bptt", 16,
            "--batch-size", 2, "--warmup", 0, "--log-every", 1, "--eval-every", 2,
            "--checkpoint-every", 2, "--eval-bytes", 100]
