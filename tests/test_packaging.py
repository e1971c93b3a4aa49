"""The installed package: pyproject.toml names every package folder of the tree (fastrwa/ and
the top-level kernels/, which installs as fastrwa.kernels), and a wheel built from the tree
holds every kernel file inside the package (as ``fastrwa.kernels``) and nothing named
kernels at its top."""

import pathlib
import subprocess
import sys
import tomllib
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def _python_folders(top: str, package: str) -> dict[str, pathlib.Path]:
    """``{dotted package name: folder}`` for every folder of ``*.py`` files under ``top``."""
    folders = {}
    for p in (ROOT / top).rglob("*.py"):
        if "__pycache__" not in p.parts:
            rel = p.parent.relative_to(ROOT / top).parts
            folders[".".join((package, *rel))] = p.parent
    return folders


def test_every_folder_of_python_files_is_a_listed_package():
    folders = {**_python_folders("fastrwa", "fastrwa"),
               **_python_folders("kernels", "fastrwa.kernels")}
    assert set(folders) == set(CONFIG["packages"]), (
        f"pyproject.toml's packages differ from the tree: missing "
        f"{sorted(set(folders) - set(CONFIG['packages']))}, extra "
        f"{sorted(set(CONFIG['packages']) - set(folders))}")
    assert all((folder / "__init__.py").exists() for folder in folders.values())
    assert CONFIG["package-dir"] == {"fastrwa.kernels": "kernels"}


def test_the_wheel_holds_every_kernel_file(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True, cwd=tmp_path)
    (wheel,) = tmp_path.glob("fastrwa-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    kernel_files = {f"fastrwa/kernels/{p.relative_to(ROOT / 'kernels').as_posix()}"
                    for p in (ROOT / "kernels").rglob("*.py") if "__pycache__" not in p.parts}
    assert {"fastrwa/kernels/cpu/scan_fwd.py", "fastrwa/kernels/triton/scan_fwd.py"} <= kernel_files
    assert kernel_files <= names, f"kernel files the wheel lacks: {sorted(kernel_files - names)}"
    assert not any(name.startswith("kernels/") for name in names)
