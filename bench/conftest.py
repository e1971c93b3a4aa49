"""pytest-benchmark cases live here (``pytest bench/ --benchmark-only``); this makes
``bench/common.py`` importable from them."""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
