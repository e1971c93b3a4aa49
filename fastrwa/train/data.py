"""Local datasets for training: byte corpora (enwik8, any text file) and MNIST from IDX files.

Nothing here downloads at run time; :func:`download_enwik8` is a helper for users who are
online (``python -m fastrwa.train.data download-enwik8 DIR``) and verifies what it fetched.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import math
import os
import struct
import sys
import urllib.request
import zipfile
import zlib
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_SIZE = 100_000_000
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"   # published with the corpus


def _cache_dir() -> Path:
    return Path(os.environ.get("FASTRWA_CACHE", Path.home() / ".cache" / "fastrwa"))


def _zip_member(path: Path) -> zipfile.ZipInfo:
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ValueError(f"--data {path}: the zip is damaged ({exc}); download it again")
    if len(members) != 1:
        raise ValueError(f"--data {path}: expected one file in the zip, "
                         f"got {[m.filename for m in members]}")
    return members[0]


def _extract_once(path: Path) -> Path:
    """The zip's single member as a file in the cache (``$FASTRWA_CACHE``, default
    ``~/.cache/fastrwa``), extracted on first use through a temporary file and ``os.replace``
    (processes that race write the same bytes); its CRC-32 is checked while extracting."""
    member = _zip_member(path)
    target = _cache_dir() / f"{Path(member.filename).name}-{member.file_size}-{member.CRC:08x}"
    if target.is_file() and target.stat().st_size == member.file_size:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(path) as archive, archive.open(member) as src, open(tmp, "wb") as out:
            while chunk := src.read(1 << 22):
                out.write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"--data {path}: the zip is damaged ({exc}); download it again")
    os.replace(tmp, target)
    return target


def read_corpus(path: str | Path) -> Tensor:
    """The bytes of a corpus file as a ``uint8`` tensor mapped from disk (not read into each
    process's memory): a raw file, or the single member of a ``.zip`` (enwik8.zip), extracted
    once into the cache directory and mapped from there."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file (enwik8: the raw 'enwik8' file or "
                                f"'enwik8.zip'; get it with python -m fastrwa.train.data download-enwik8)")
    if zipfile.is_zipfile(path):
        path = _extract_once(path)
    size = path.stat().st_size
    if size == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)


def split_corpus(data: Tensor | bytes) -> dict[str, Tensor]:
    """Train / valid / test as the first 90%, next 5% and last 5% of the bytes (views, no
    copy): for enwik8's 100,000,000 bytes exactly the standard 90M / 5M / 5M."""
    if isinstance(data, (bytes, bytearray)):
        data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    n = len(data)
    held = n // 20
    if held < 2:
        raise ValueError(f"the corpus has {n} bytes; at least 40 are needed for a 90/5/5 split")
    return {"train": data[:n - 2 * held], "valid": data[n - 2 * held:n - held],
            "test": data[n - held:]}


class ByteStreams:
    """A split cut into ``streams`` contiguous rows, read in consecutive segments (TBPTT).

    Segment ``k`` gives inputs ``rows[:, k*L : (k+1)*L]`` and the next bytes as targets, so
    the recurrent state after segment ``k`` is the right initial state for segment ``k+1``.
    After the last segment the reading wraps around (``new_pass`` says when to reset state).
    Each segment is gathered from ``data`` when asked for (a memory-mapped corpus stays on disk).
    """

    def __init__(self, data: Tensor, streams: int, segment: int):
        if segment < 1 or streams < 1:
            raise ValueError(f"segment and streams must be >= 1, got {segment}, {streams}")
        per_row = (len(data) - 1) // streams
        self.segments = per_row // segment
        if self.segments < 1:
            raise ValueError(f"{len(data)} bytes cannot give {streams} streams of even one "
                             f"segment of {segment} bytes; use a smaller --batch-size or --bptt")
        self.data, self.segment = data, segment
        self.starts = torch.arange(streams)[:, None] * per_row                 # (streams, 1)

    def __len__(self) -> int:
        return self.segments

    def get(self, k: int) -> tuple[Tensor, Tensor, bool]:
        """``(inputs (streams, L), targets (streams, L), new_pass)`` of segment ``k``."""
        j = k % self.segments
        rows = self.data[self.starts + j * self.segment + torch.arange(self.segment + 1)].long()
        return rows[:, :-1], rows[:, 1:], j == 0


def whole_split(data: Tensor, streams: int, segment: int,
                shard: tuple[int, int] = (0, 1)) -> Iterator[tuple[Tensor, Tensor]]:
    """Every next-byte prediction of ``data`` (``len(data) - 1`` targets), batched: the split
    is cut into ``streams`` contiguous rows read in segments of up to ``segment`` bytes, the
    state to be carried from one segment to the next. Yields ``(inputs, targets)``
    ``(rows, L)``; targets past the end of the split are ``-100`` (ignored by
    ``cross_entropy``), so the sum of losses covers each byte exactly once. ``shard=(k, n)``
    keeps rows ``k, k + n, ...`` (process ``k`` of ``n``): the shards' sums add up to the
    whole split's; a shard with no rows yields nothing."""
    n = len(data) - 1
    if n < 1:
        raise ValueError(f"a split of {len(data)} bytes has nothing to predict")
    streams = min(streams, n)
    per_row = -(-n // streams)                                                 # ceil
    padded = torch.zeros(streams * per_row + 1, dtype=torch.long)
    padded[:n + 1] = data
    valid = torch.arange(streams * per_row) < n
    starts = torch.arange(streams)[shard[0]::shard[1], None] * per_row
    if not len(starts):
        return
    for lo in range(0, per_row, segment):
        index = starts + lo + torch.arange(min(segment, per_row - lo))          # (streams, L)
        yield padded[index], torch.where(valid[index], padded[index + 1], -100)


def bits_per_byte(loss_nats: float) -> float:
    return loss_nats / math.log(2)


# -- MNIST (IDX files) ---------------------------------------------------------------------------
_MNIST_FILES = {"train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
                "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")}


def read_idx(path: str | Path) -> Tensor:
    """An IDX file (optionally ``.gz``) as a uint8 tensor of its declared shape."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, zlib.error) as exc:     # a damaged .gz
        raise ValueError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0:
        raise ValueError(f"{path}: not an IDX file (bad magic number)")
    if raw[2] != 0x08:
        raise ValueError(f"{path}: IDX element type {raw[2]:#x} is not unsigned bytes (0x08)")
    dims = raw[3]
    if len(raw) < 4 + 4 * dims:
        raise ValueError(f"{path}: cut short inside its header")
    shape = struct.unpack(f">{dims}I", raw[4:4 + 4 * dims])
    body = raw[4 + 4 * dims:]
    if len(body) != math.prod(shape):
        raise ValueError(f"{path}: {len(body)} data bytes for declared shape {shape}")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8).view(*shape)


def load_mnist(directory: str | Path, split: str) -> tuple[Tensor, Tensor]:
    """``(images (N, 28, 28) uint8, labels (N,) int64)`` from the standard IDX files in
    ``directory`` (plain or ``.gz``)."""
    directory = Path(directory)
    found = []
    for name in _MNIST_FILES[split]:
        candidates = [directory / name, directory / f"{name}.gz"]
        path = next((c for c in candidates if c.is_file()), None)
        if path is None:
            raise FileNotFoundError(f"--data {directory}: missing {name}[.gz] (the MNIST IDX files)")
        found.append(read_idx(path))
    images, labels = found
    if images.shape[0] != labels.shape[0]:
        raise ValueError(f"{directory}: {images.shape[0]} images but {labels.shape[0]} labels")
    return images, labels.long()


# -- the download helper ------------------------------------------------------------------------
def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def download_enwik8(directory: str | Path) -> Path:
    """Fetch enwik8.zip into ``directory``, check the corpus's size and published md5, and
    return the path of the zip. For users who are online; nothing calls it implicitly."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    target = directory / "enwik8.zip"
    partial = target.with_suffix(".zip.part")
    with urllib.request.urlopen(ENWIK8_URL) as response, partial.open("wb") as out:
        while chunk := response.read(1 << 20):
            out.write(chunk)
    with zipfile.ZipFile(partial) as archive:
        data = archive.read(_zip_member(partial))
    if len(data) != ENWIK8_SIZE or _md5(data) != ENWIK8_MD5:
        partial.unlink()
        raise ValueError(f"downloaded enwik8 has {len(data)} bytes and md5 {_md5(data)}; "
                         f"expected {ENWIK8_SIZE} and {ENWIK8_MD5}")
    partial.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fastrwa.train.data")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download-enwik8", help="fetch enwik8.zip and verify size and md5")
    d.add_argument("directory")
    args = p.parse_args(argv)
    print(download_enwik8(args.directory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
