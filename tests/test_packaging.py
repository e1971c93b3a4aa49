"""Every package in the source tree is listed in pyproject.toml (else a wheel silently lacks it)."""

import pathlib
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_package_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    mapped = {name: ROOT / path for name, path in config["package-dir"].items()}
    found = set()
    for init in (ROOT / "fastrwa").rglob("__init__.py"):
        parts = init.parent.relative_to(ROOT).parts
        found.add(".".join(parts))
    found |= {name for name, path in mapped.items() if (path / "__init__.py").is_file()}
    assert found <= listed, f"packages missing from pyproject.toml: {sorted(found - listed)}"
    assert listed <= found, f"listed but not found: {sorted(listed - found)}"
