"""Docs that stay true: every repository path cited in README.md, docs/*.md and the
docstrings of the code exists, every relative link in them resolves, and every dotted
``fastrwa.*`` name they cite imports (CHANGELOG.md is history and may cite what is gone)."""

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CODE = sorted(p for top in ("fastrwa", "kernels", "bench", "tests")
              for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)

# A path into the repository: a top-level folder, then path characters. Trailing sentence
# punctuation is not part of it.
PATH = re.compile(r"(?<![\w./-])((?:fastrwa|kernels|tests|bench|docs|\.ci)/[\w./-]*)")
TOP_FILES = re.compile(r"(?<![\w./-])(pyproject\.toml|README\.md|CHANGELOG\.md)(?![\w.-])")
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")
DOTTED = re.compile(r"(?<![\w.])(fastrwa(?:\.\w+)+)")
# Paths a run makes (ignored by git), cited as where output goes.
# (records that a run writes with --record: the GPU one has not run yet)
MADE_BY_RUNS = ("bench/results/lm/runs", "bench/results/lm-gpu")


def _docstrings(path: pathlib.Path) -> str:
    tree = ast.parse(path.read_text())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(
        n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return "\n".join(doc for doc in (ast.get_docstring(n) for n in nodes) if doc)


def _texts():
    for path in DOCS:
        yield path, path.read_text()
    for path in CODE:
        yield path, _docstrings(path)


def cited_paths(text: str) -> set[str]:
    found = {m.rstrip(".,:;") for m in PATH.findall(text)} | set(TOP_FILES.findall(text))
    return {p for p in found if p.count("/") or "." in p}


def _exists(cited: str) -> bool:
    if cited.startswith(MADE_BY_RUNS):
        return True
    return (ROOT / cited).exists()


def _imports(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("path", [p for p, _ in _texts()],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_paths_links_and_names_exist(path):
    text = path.read_text() if path.suffix == ".md" else _docstrings(path)
    missing = sorted(p for p in cited_paths(text) if not _exists(p))
    if path.suffix == ".md":
        missing += sorted(link for link in LINK.findall(text)
                          if not re.match(r"[a-z]+:", link) and not (path.parent / link).exists())
    missing += sorted(name for name in set(DOTTED.findall(text)) if not _imports(name))
    assert not missing, f"{path.relative_to(ROOT)} cites what does not exist: {missing}"


def test_the_check_finds_a_missing_file():
    """The check can fail: a removed file, a moved module and a broken link are found."""
    text = "see fastrwa/ops/registry.py and kernels/cpu/team.py, or docs/math.md."
    assert sorted(p for p in cited_paths(text) if not _exists(p)) == [
        "fastrwa/ops/registry.py", "kernels/cpu/team.py"]
    assert not _imports("fastrwa.ops.registry") and _imports("fastrwa.ops.contract.ScanArgs")
    assert LINK.findall("[math](math.md#sec) [x](https://x.org)") == ["math.md", "https://x.org"]
