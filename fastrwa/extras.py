"""What to install for an optional part of fastrwa: one spelling for every message.

fastrwa is installed from its source tree, not from PyPI: an install line naming the
package with an extra would fetch nothing (or someone else's package). A message about a missing extra names the
packages the extra brings, read from the installed package's metadata (pyproject.toml's
``[project.optional-dependencies]``, so the versions are the tested ones), which installs
the same from anywhere, and the extra itself as it installs from a clone:

>>> from fastrwa.extras import install_hint
>>> install_hint("serve")
"pip install 'uvicorn>=0.30' 'httptools>=0.6' (the [serve] extra: pip install -e '.[serve]' in a fastrwa clone)"
"""

from __future__ import annotations

import importlib.metadata
import re

_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def requirements(extra: str) -> tuple[str, ...]:
    """The requirements ``extra`` brings (markers dropped), from the installed metadata;
    empty when fastrwa's metadata cannot be read or names no such extra."""
    try:
        listed = importlib.metadata.requires("fastrwa") or []
    except importlib.metadata.PackageNotFoundError:
        listed = []
    return tuple(line.split(";")[0].strip() for line in listed
                 if (m := _EXTRA.search(line)) and m.group(1) == extra)


def install_hint(extra: str) -> str:
    """One clause that says how to install ``extra`` (``"hf"``, ``"onnx"``, ``"serve"``,
    ``"dev"``): its packages, then the extra as installed from a fastrwa clone (only that
    where the metadata is not there: a source tree run without an install)."""
    clone = f"pip install -e '.[{extra}]' in a fastrwa clone"
    packages = " ".join(f"'{r}'" for r in requirements(extra))
    return f"pip install {packages} (the [{extra}] extra: {clone})" if packages else clone
