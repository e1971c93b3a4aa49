"""Every folder of Python files under fastrwa/ is a package that pyproject.toml's package
discovery finds (a folder without ``__init__.py`` would be silently left out of a wheel)."""

import pathlib
import tomllib

from setuptools import find_packages

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_folder_of_python_files_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = set(find_packages(str(ROOT), include=config["packages"]["find"]["include"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for p in (ROOT / "fastrwa").rglob("*.py") if "__pycache__" not in p.parts}
    assert folders <= found, f"folders a wheel would lack: {sorted(folders - found)}"
    assert "fastrwa.ops.backends.numba" in found and "fastrwa.ops.backends.triton" in found
