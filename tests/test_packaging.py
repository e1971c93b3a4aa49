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


# -- install lines ----------------------------------------------------------------------
# fastrwa is installed from its source tree, not from PyPI: an install line that names
# 'fastrwa[extra]' fetches nothing of ours. Every doc page and every message names an extra
# as it installs from a clone (`pip install -e '.[hf]'`), or the packages it brings.
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
    "optional-dependencies"]
_SOURCES = ["README.md", ".ci/run", "docs/*.md", "fastrwa/**/*.py", "kernels/**/*.py",
            "bench/**/*.py", "bench/*.md"]


def _install_lines():
    import re
    for pattern in _SOURCES:
        for path in sorted(ROOT.glob(pattern)):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                for match in re.finditer(r"pip install[^`\n]*", line):
                    yield f"{path.relative_to(ROOT)}:{number}", match.group(0)


def test_no_install_line_asks_pypi_for_fastrwa():
    import re
    found = list(_install_lines())
    assert len(found) > 10, found            # (the scan reads the files it should)
    wrong = [(where, text) for where, text in found
             if re.search(r"""(?<![\w.-])fastrwa\[""", text)]
    assert not wrong, f"install lines that ask PyPI for fastrwa: {wrong}"


def test_every_extra_an_install_line_names_exists():
    import re
    named = [(where, extra) for where, text in _install_lines()
             for extra in re.findall(r"""\.\[([\w,]+)\]""", text)]
    assert named
    unknown = [(where, extra) for where, extras in named for extra in extras.split(",")
               if extra not in EXTRAS]
    assert not unknown, f"install lines that name no extra of pyproject.toml: {unknown}"


def test_the_missing_extra_hint_names_the_extras_packages():
    from fastrwa.extras import install_hint
    for extra, requirements in EXTRAS.items():
        hint = install_hint(extra)
        assert f"pip install -e '.[{extra}]'" in hint, hint
        for requirement in requirements:
            name = requirement.split(";")[0].split(">")[0].split("<")[0].split("=")[0].strip()
            assert f"'{name}" in hint, (extra, name, hint)


def test_the_license_pyproject_names_is_in_the_tree():
    license = (ROOT / "LICENSE").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "MIT"} and "MIT License" in license
    assert "Permission is hereby granted, free of charge" in license
