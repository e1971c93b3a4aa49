"""The layers of docs/architecture.md hold: each imports only the layers below it, the
reference shares no code with the fast paths, the kernels import nothing of the host side,
and no package's modules import each other in a circle (the contracts in pyproject.toml,
checked by import-linter)."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_import_contracts_are_kept():
    pytest.importorskip("importlinter")
    lint = shutil.which("lint-imports")
    assert lint, "import-linter is installed but its lint-imports command is not on PATH"
    done = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "0 broken" in done.stdout
