"""Local datasets for training: byte corpora (enwik8, any text file) and MNIST from IDX files.

Nothing here downloads at run time; :func:`download_enwik8` is a helper for users who are
online (``python -m fastrwa.train.data download-enwik8 DIR``) and verifies what it fetched.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import math
import struct
import sys
import urllib.request
import zipfile
import zlib
from pathlib import Path

import torch
from torch import Tensor

ENWIK8_URL = "http://mattmahoney.net/dc/enwik8.zip"
ENWIK8_SIZE = 100_000_000
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"   # published with the corpus


def read_corpus(path: str | Path) -> bytes:
    """The bytes of a corpus file: raw, or the single member of a ``.zip`` (enwik8.zip)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file (enwik8: the raw 'enwik8' file or "
                                f"'enwik8.zip'; get it with python -m fastrwa.train.data download-enwik8)")
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as archive:
                names = [n for n in archive.namelist() if not n.endswith("/")]
                if len(names) != 1:
                    raise ValueError(f"--data {path}: expected one file in the zip, got {names}")
                return archive.read(names[0])
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise ValueError(f"--data {path}: the zip is damaged ({exc}); download it again")
    return path.read_bytes()


def split_corpus(data: bytes) -> dict[str, Tensor]:
    """Train / valid / test as the first 90%, next 5% and last 5% of the bytes: for enwik8's
    100,000,000 bytes exactly the standard 90M / 5M / 5M."""
    n = len(data)
    held = n // 20
    if held < 2:
        raise ValueError(f"the corpus has {n} bytes; at least 40 are needed for a 90/5/5 split")
    tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return {"train": tensor[:n - 2 * held], "valid": tensor[n - 2 * held:n - held],
            "test": tensor[n - held:]}


class ByteStreams:
    """A split cut into ``streams`` contiguous rows, read in consecutive segments (TBPTT).

    Segment ``k`` gives inputs ``rows[:, k*L : (k+1)*L]`` and the next bytes as targets, so
    the recurrent state after segment ``k`` is the right initial state for segment ``k+1``.
    After the last segment the reading wraps around (``new_pass`` says when to reset state).
    """

    def __init__(self, data: Tensor, streams: int, segment: int):
        if segment < 1 or streams < 1:
            raise ValueError(f"segment and streams must be >= 1, got {segment}, {streams}")
        per_row = (len(data) - 1) // streams
        self.segments = per_row // segment
        if self.segments < 1:
            raise ValueError(f"{len(data)} bytes cannot give {streams} streams of even one "
                             f"segment of {segment} bytes; use a smaller --batch-size or --bptt")
        usable = self.segments * segment
        self.rows = torch.stack([data[i * per_row:i * per_row + usable + 1]
                                 for i in range(streams)]).long()     # (streams, usable + 1)
        self.segment = segment

    def __len__(self) -> int:
        return self.segments

    def get(self, k: int) -> tuple[Tensor, Tensor, bool]:
        """``(inputs (streams, L), targets (streams, L), new_pass)`` of segment ``k``."""
        j = k % self.segments
        lo = j * self.segment
        return self.rows[:, lo:lo + self.segment], self.rows[:, lo + 1:lo + 1 + self.segment], \
            j == 0


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
    data = read_corpus(partial)
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
