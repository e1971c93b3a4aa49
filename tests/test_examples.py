"""Every ``Example:`` in the package's docstrings runs and prints what it shows."""

import doctest
import importlib
import pkgutil

import pytest

import fastrwa

# (a package's __main__ runs its command when imported)
MODULES = sorted(m.name for m in pkgutil.walk_packages(fastrwa.__path__, "fastrwa.")
                 if not m.name.endswith(".__main__"))


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(verbose=False)
    for test in finder.find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {name}"
