"""The bench scripts' command lines, written once.

* ``type=`` helpers for ``argparse``: a bad value is refused while the flags are parsed, as
  one ``error: argument --FLAG: ...`` line after the usage, exit status 2, before any work.
* Where results go. Every script writes to a scratch folder git ignores by default
  (``bench-results/<name>``, :func:`scratch_dir`); the committed records under
  ``bench/results/`` (:func:`results_dir`) change only with ``--record`` (:func:`add_out`,
  :func:`check_out`), and never from a check run (``--quick``, or sizes smaller than a full
  run's).
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
from typing import Any, Callable, Mapping, Sequence

ROOT = pathlib.Path(__file__).resolve().parents[1]


def results_dir(name: str = "") -> pathlib.Path:
    """The committed record ``bench/results/<name>`` (written only with ``--record``)."""
    return ROOT / "bench" / "results" / name


def scratch_dir(name: str = "") -> pathlib.Path:
    """``--out``'s default: ``bench-results/<name>``, a folder git ignores."""
    return ROOT / "bench-results" / name


def in_records(path: pathlib.Path) -> bool:
    """Whether ``path`` is ``bench/results/`` or lies under it."""
    records, path = results_dir().resolve(), pathlib.Path(path).resolve()
    return path == records or records in path.parents


def _refuse(what: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"must be {what}, got {text!r}")


def int_at_least(low: int) -> Callable[[str], int]:
    """A ``type=``: an integer ``>= low``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise _refuse(f"an integer >= {low}", text) from None
        if value < low:
            raise _refuse(f"an integer >= {low}", text)
        return value
    parse.__name__ = f"int_at_least_{low}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def positive_float(text: str) -> float:
    """A ``type=``: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        raise _refuse("a finite number above 0", text) from None
    if not (math.isfinite(value) and value > 0):
        raise _refuse("a finite number above 0", text)
    return value


def fraction(text: str) -> float:
    """A ``type=``: a number from 0 up to, not including, 1."""
    try:
        value = float(text)
    except ValueError:
        raise _refuse("a number from 0 to below 1", text) from None
    if not 0 <= value < 1:
        raise _refuse("a number from 0 to below 1", text)
    return value


def int_list(low: int = 1, empty: bool = False) -> Callable[[str], list[int]]:
    """A ``type=``: comma-separated integers ``>= low`` (``"1,2"``); ``empty``: ``""`` is
    the empty list."""
    item = int_at_least(low)

    def parse(text: str) -> list[int]:
        if not text and empty:
            return []
        try:
            return [item(part) for part in text.split(",")]
        except argparse.ArgumentTypeError:
            what = f"comma-separated integers >= {low}" + (" (or '' for none)" * empty)
            raise _refuse(what, text) from None
    parse.__name__ = "int_list"
    return parse


def shape(text: str) -> tuple[int, int, int]:
    """A ``type=``: ``B,T,D``, three integers >= 1."""
    try:
        dims = tuple(positive_int(part) for part in text.split(","))
    except argparse.ArgumentTypeError:
        dims = ()
    if len(dims) != 3:
        raise _refuse("B,T,D: three integers >= 1", text)
    return dims


def shapes(count: int) -> Callable[[str], list[tuple[int, int, int]]]:
    """A ``type=``: ``count`` shapes ``B,T,D`` separated by ``;``."""
    def parse(text: str) -> list[tuple[int, int, int]]:
        try:
            dims = [shape(part) for part in text.split(";")]
        except argparse.ArgumentTypeError:
            dims = []
        if len(dims) != count:
            raise _refuse(f"{count} shapes B,T,D of integers >= 1 separated by ';'", text)
        return dims
    parse.__name__ = "shapes"
    return parse


def choices_list(allowed: Sequence[str]) -> Callable[[str], list[str]]:
    """A ``type=``: comma-separated names, each of ``allowed``, each once."""
    def parse(text: str) -> list[str]:
        names = text.split(",")
        unknown = [n for n in names if n not in allowed]
        if unknown or len(set(names)) != len(names):
            raise _refuse(f"comma-separated names of {', '.join(allowed)}, each once", text)
        return names
    parse.__name__ = "choices_list"
    return parse


def out_dir(text: str) -> pathlib.Path:
    """A ``type=``: a folder to write into (it may not exist yet; not an existing file)."""
    path = pathlib.Path(text)
    if not text:
        raise _refuse("a folder", text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a folder")
    return path


def out_file(text: str) -> pathlib.Path:
    """A ``type=``: a file to write (it may not exist yet; not an existing folder)."""
    path = pathlib.Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file" if text
                                         else "must name a file, got ''")
    return path


def existing_file(text: str) -> pathlib.Path:
    """A ``type=``: a file that exists."""
    path = pathlib.Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file {text!r}")
    return path


def existing_dir(text: str) -> pathlib.Path:
    """A ``type=``: a folder that exists."""
    path = pathlib.Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"no such folder {text!r}")
    return path


def add_out(p: argparse.ArgumentParser, name: str, what: str, record: bool = True) -> None:
    """``--out DIR`` (default ``bench-results/<name>``) and ``--record`` (write into the
    committed ``bench/results/<name>``; a script without a record of its own, ``record``
    false, takes ``--record`` only with an ``--out`` under ``bench/results/``)."""
    scratch = f"bench-results/{name}".rstrip("/")
    kept = (f"bench/results/{name}, the committed record, only with --record" if record
            else "a folder under bench/results/ only with --record")
    p.add_argument("--out", type=out_dir, default=None,
                   help=f"the folder for {what} (default {scratch}, which git ignores; {kept})")
    p.add_argument("--record", action="store_true",
                   help=f"write into the committed records under bench/results/"
                        f"{f' (--out then defaults to bench/results/{name})' if record else ''}"
                        f"; refused for a check run (--quick, smaller sizes)")


def smaller(value, full) -> bool:
    """Whether ``value`` makes a run smaller or narrower than one at ``full`` (a full run's
    value; ``None`` on either side: not comparable, not smaller): a number below it; a shape
    (a tuple, or a list of shapes) with fewer dimensions or smaller in any; a list (thread
    counts, batches, seeds, names) with fewer distinct items, names missing one of the full
    run's, or numbers below the full run's rank by rank (both sorted)."""
    if value is None or full is None:
        return False
    if isinstance(full, (list, tuple)):
        value = list(value)
        if isinstance(full, tuple) or (full and all(isinstance(f, (list, tuple)) for f in full)):
            return len(value) < len(full) or any(smaller(v, f) for v, f in zip(value, full))
        if len(set(value)) < len(set(full)):
            return True
        if all(isinstance(f, str) for f in full):
            return not set(full) <= set(value)
        return any(v < f for v, f in zip(sorted(set(value)), sorted(set(full))))
    return value < full


def below_defaults(p: argparse.ArgumentParser, args: argparse.Namespace,
                   names: Sequence[str] | Mapping[str, object]) -> list[str]:
    """The flags among ``names`` (dests) set below a full run's value (:func:`smaller`): the
    flag's default, or where ``names`` maps a dest to a value other than ``None``, that value
    (the smallest a full run takes)."""
    floors = dict(names) if isinstance(names, Mapping) else dict.fromkeys(names)
    return [f"--{n.replace('_', '-')}" for n, floor in floors.items()
            if smaller(getattr(args, n), p.get_default(n) if floor is None else floor)]


def check_record(p: argparse.ArgumentParser, flag: str, path: pathlib.Path, record: bool,
                 small: Sequence[str] = ()) -> None:
    """Refuse (``p.error``: one line, exit 2) a write under ``bench/results/`` without
    ``--record``, ``--record`` elsewhere, and ``--record`` of a check run: ``small`` names
    the flags that make this run one (``--quick``, a size below the full run's)."""
    inside = in_records(path)
    if inside and not record:
        p.error(f"{flag} {path} is under bench/results/, the committed records: add --record "
                f"to write there")
    if record and not inside:
        p.error(f"--record writes under bench/results/, the committed records; {flag} points "
                f"at {path}")
    if record and small:
        p.error(f"--record takes full-size runs only (a check run never replaces a record): "
                f"drop {', '.join(small)}")


def check_out(p: argparse.ArgumentParser, args: argparse.Namespace, name: str,
              record: bool = True, sizes: Sequence[str] | Mapping[str, object] = (),
              small: Sequence[str] = (),
              make: bool = True) -> pathlib.Path:
    """Settle ``args.out`` (``bench/results/<name>`` with ``--record`` where the script keeps a
    record there, ``record``; else ``bench-results/<name>``), refuse what :func:`check_record`
    refuses and, with ``make``, make the folder (:func:`make_dir`). A check run is
    ``--quick``, a flag of ``sizes`` (dests; or dests mapped to a full run's smallest value,
    :func:`below_defaults`) below its default or a flag named in ``small``.
    Returns ``args.out``."""
    if args.out is None:
        if args.record and not record:
            p.error("--record needs --out, a folder under bench/results/ (this script keeps "
                    "no record of its own)")
        args.out = (results_dir if args.record else scratch_dir)(name)
    small = ["--quick"] * bool(getattr(args, "quick", False)) + [
        *below_defaults(p, args, sizes), *small]
    check_record(p, "--out", args.out, args.record, small)
    if make:
        make_dir(p, "--out", args.out)
    return args.out


def make_dir(p: argparse.ArgumentParser, flag: str, path: pathlib.Path) -> None:
    """``mkdir -p path``, or one ``error:`` line naming ``flag`` (exit 2)."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        p.error(f"{flag} {path}: cannot create the folder ({exc.strerror or exc})")


def save_json(path: pathlib.Path, record: Any) -> None:
    """``record`` as indented JSON in ``path``, written whole or not at all (through
    ``path.tmp`` and a rename: a run stopped or a disk full while it is written leaves
    the earlier file, or none)."""
    from fastrwa.models.files import write_atomically

    text = (json.dumps(record, indent=1) + "\n").encode()
    write_atomically(pathlib.Path(path), lambda f: f.write(text))


def save_figure(fig, path: pathlib.Path, **kwargs) -> None:
    """``fig.savefig(path, **kwargs)``, written whole or not at all (as :func:`save_json`;
    the format from ``path``'s suffix)."""
    from fastrwa.models.files import write_atomically

    path = pathlib.Path(path)
    write_atomically(path, lambda f: fig.savefig(f, format=path.suffix.lstrip("."), **kwargs))
