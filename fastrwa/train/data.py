"""Local datasets for training: byte corpora (enwik8, any text file) and MNIST from IDX files.

Nothing here downloads at run time; :func:`download_enwik8` is a helper for users who are
online (``python -m fastrwa.train.data download-enwik8 DIR``) and verifies what it fetched.
"""

from __future__ import annotations

import argparse
import glob
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
from typing import Iterator, NamedTuple

import torch
from torch import Tensor

ENWIK8_URL = "https://mattmahoney.net/dc/enwik8.zip"
ENWIK8_SIZE = 100_000_000
ENWIK8_MD5 = "a1fa5ffddb56f4953e226637dabbb36a"   # published with the corpus
_CHUNK = 1 << 22


def _cache_dir() -> Path:
    return Path(os.environ.get("FASTRWA_CACHE", Path.home() / ".cache" / "fastrwa"))


def _digest(path: Path) -> tuple[int, int, str]:
    """``(size, CRC-32, sha256 hex)`` of a file's bytes, read in chunks."""
    size, crc, sha = 0, 0, hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            size, crc = size + len(chunk), zlib.crc32(chunk, crc)
            sha.update(chunk)
    return size, crc, sha.hexdigest()


def _copy(src, path: Path, tmp: Path, source: Path) -> tuple[int, int, str]:
    """Copy the stream ``src`` (read from ``source``) into ``tmp`` (``path``'s temporary
    name), flushed to disk; ``(size, CRC-32, sha256)`` of what was copied. A failure removes
    ``tmp`` and raises ``OSError`` saying which side failed: reading ``source`` or writing
    the cache."""
    size, crc, sha = 0, 0, hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            while True:
                try:
                    chunk = src.read(_CHUNK)
                except OSError as exc:
                    cause = exc.strerror or exc
                    raise OSError(exc.errno, f"cannot read --data {source} ({cause}) while "
                                             f"copying it into the corpus cache; the cache is "
                                             f"left as it was", str(source)) from exc
                if not chunk:
                    break
                size, crc = size + len(chunk), zlib.crc32(chunk, crc)
                sha.update(chunk)
                try:
                    out.write(chunk)
                except OSError as exc:
                    raise _cache_write_error(exc, path) from exc
            try:
                out.flush()
                os.fsync(out.fileno())
            except OSError as exc:
                raise _cache_write_error(exc, path) from exc
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename in (str(source), str(path)):
            raise
        raise _cache_write_error(exc, path) from exc      # (opening tmp)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size, crc, sha.hexdigest()


def _cache_write_error(exc: OSError, path: Path) -> OSError:
    return OSError(exc.errno, f"cannot write the corpus cache {path} ({exc.strerror}); "
                              f"free space there or point $FASTRWA_CACHE elsewhere", str(path))


def _looks_like_zip(path: Path) -> bool:
    """A ``.zip`` name or a zip's first bytes: what an interrupted download of one still has
    (the directory a zip needs is at its end, so ``zipfile.is_zipfile`` says no)."""
    with open(path, "rb") as f:
        return path.suffix.lower() == ".zip" or f.read(4) == b"PK\x03\x04"


def _zip_member(path: Path) -> zipfile.ZipInfo:
    try:
        with zipfile.ZipFile(path) as archive:
            members = [m for m in archive.infolist() if not m.is_dir()]
    except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
        raise ValueError(f"--data {path}: the zip is truncated or damaged ({exc}; an "
                         f"interrupted download?); download it again")
    if len(members) != 1:
        raise ValueError(f"--data {path}: expected one file in the zip, "
                         f"got {[m.filename for m in members]}")
    return members[0]


def _cached(target: Path, size: int, crc: int | None, sha: str | None, source: Path) -> str | None:
    """The sha256 of the cache file ``target`` if it holds the bytes expected (its size and
    CRC-32 or sha256, checked in full on every use), else ``None``: missing, or damaged (said
    on stderr; the caller writes it again)."""
    if not target.is_file():
        return None
    got_size, got_crc, got_sha = _digest(target)
    if got_size == size and crc in (None, got_crc) and sha in (None, got_sha):
        return got_sha
    expected = f"{size:,} bytes, " + (f"CRC-32 {crc:08x}" if crc is not None else
                                       f"sha256 {sha[:16]}...")
    print(f"warning: the cached copy {target} of {source} is damaged ({got_size:,} bytes, "
          f"CRC-32 {got_crc:08x}, sha256 {got_sha[:16]}...; expected {expected}); "
          f"{'extracting' if crc is not None else 'copying'} it again", file=sys.stderr)
    return None


def _remove_stale_tmps(target: Path) -> None:
    """Remove the temporary copies of ``target`` (``<name>.<pid>.tmp``) left by processes
    that died while writing them: those whose pid no longer runs."""
    for tmp in target.parent.glob(f"{glob.escape(target.name)}.*.tmp"):
        pid = tmp.name[len(target.name) + 1:-len(".tmp")]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except PermissionError:         # (alive, another user's)
            pass


def _extract_once(path: Path) -> tuple[Path, str]:
    """The zip's single member as a file in the cache (``$FASTRWA_CACHE``, default
    ``~/.cache/fastrwa``) and its sha256, extracted on first use through a temporary file
    and ``os.replace`` (processes that race write the same bytes). The CRC-32 the zip
    records is checked while extracting and again, on the cached file, at every later use:
    a damaged cache is extracted again."""
    member = _zip_member(path)
    target = _cache_dir() / f"{Path(member.filename).name}-{member.file_size}-{member.CRC:08x}"
    sha = _cached(target, member.file_size, member.CRC, None, path)
    if sha is not None:
        return target, sha
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmps(target)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(path) as archive, archive.open(member) as src:
            size, crc, sha = _copy(src, target, tmp, path)   # (zipfile checks the CRC at the end)
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError) as exc:
        tmp.unlink(missing_ok=True)
        raise ValueError(f"--data {path}: the zip is damaged ({exc}); download it again")
    if (size, crc) != (member.file_size, member.CRC):
        tmp.unlink(missing_ok=True)
        raise ValueError(f"--data {path}: the zip is damaged ({path.name}'s member gave "
                         f"{size:,} bytes, CRC-32 {crc:08x}; its directory says "
                         f"{member.file_size:,}, {member.CRC:08x}); download it again")
    os.replace(tmp, target)
    return target, sha


def _snapshot(path: Path) -> tuple[Path, str]:
    """A private copy of the raw corpus ``path`` in the cache, named by its size and sha256,
    and that sha256. Training maps the copy, not ``path``: a corpus rewritten or truncated
    while a run reads it cannot change what the run reads, nor kill it with SIGBUS (a read
    of a mapped page that a truncation removed)."""
    size, _, sha = _digest(path)
    target = _cache_dir() / f"{path.name}-{size}-{sha[:16]}"
    if _cached(target, size, None, sha, path) is not None:
        return target, sha
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmps(target)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    with open(path, "rb") as src:
        copied = _copy(src, target, tmp, path)
    if (copied[0], copied[2]) != (size, sha):
        tmp.unlink(missing_ok=True)
        raise ValueError(f"--data {path} changed while it was being read ({size:,} bytes, "
                         f"then {copied[0]:,}); start the run when nothing writes to it")
    os.replace(tmp, target)
    return target, sha


class Corpus(NamedTuple):
    """A byte corpus as training reads it: ``data``, a ``uint8`` tensor mapped from a
    verified private copy in the cache, and the ``size`` and ``sha256`` of its bytes (what a
    checkpoint records, so that ``--resume`` can tell a changed corpus)."""

    data: Tensor
    size: int
    sha256: str


def check_corpus_path(path: str | Path) -> None:
    """``FileNotFoundError`` naming ``--data`` unless ``path`` is a file (the hint: how to get
    enwik8 for a path named so, else what a corpus is)."""
    path = Path(path)
    if not path.is_file():
        hint = (" (enwik8: the raw 'enwik8' file or 'enwik8.zip'; get it with python -m "
                "fastrwa.train.data download-enwik8)") if "enwik8" in path.name.lower() else \
            " (a byte corpus: any file, read as bytes)"
        raise FileNotFoundError(f"--data {path}: no such file{hint}")


def open_corpus(path: str | Path) -> Corpus:
    """The bytes of a corpus file, mapped from disk (not read into each process's memory):
    a raw file, or the single member of a ``.zip`` (enwik8.zip). Either is first copied into
    the cache directory (a zip extracted, a raw file copied, each checked against its CRC-32
    or sha256 at every use) and mapped from there, so that nothing done to ``path`` during a
    run reaches it. A zip cut short (an interrupted download) is refused."""
    path = Path(path)
    check_corpus_path(path)
    if _looks_like_zip(path):
        if not zipfile.is_zipfile(path):
            raise ValueError(f"--data {path}: the zip is truncated or damaged (no zip "
                             f"directory at its end; an interrupted download?); download it "
                             f"again")
        path, sha = _extract_once(path)
    elif path.stat().st_size == 0:
        return Corpus(torch.empty(0, dtype=torch.uint8), 0, hashlib.sha256().hexdigest())
    else:
        path, sha = _snapshot(path)
    size = path.stat().st_size
    if size == 0:
        return Corpus(torch.empty(0, dtype=torch.uint8), 0, sha)
    return Corpus(torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8),
                  size, sha)


def read_corpus(path: str | Path) -> Tensor:
    """The bytes of a corpus file as a ``uint8`` tensor mapped from a private copy in the
    cache (:func:`open_corpus`)."""
    return open_corpus(path).data


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
        self.starts = torch.arange(streams, device=data.device)[:, None] * per_row  # (streams, 1)

    def __len__(self) -> int:
        return self.segments

    def index(self, k: int) -> Tensor:
        """The positions in ``data`` of segment ``k``'s inputs and last target
        ``(streams, L + 1)``."""
        j = k % self.segments
        return self.starts + j * self.segment + torch.arange(self.segment + 1,
                                                              device=self.data.device)

    def get(self, k: int) -> tuple[Tensor, Tensor, bool]:
        """``(inputs (streams, L), targets (streams, L), new_pass)`` of segment ``k``."""
        rows = self.data[self.index(k)].long()
        return rows[:, :-1], rows[:, 1:], k % self.segments == 0


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
    on = dict(device=data.device)
    padded = torch.zeros(streams * per_row + 1, dtype=torch.long, **on)
    padded[:n + 1] = data
    valid = torch.arange(streams * per_row, **on) < n
    starts = torch.arange(streams, **on)[shard[0]::shard[1], None] * per_row
    if not len(starts):
        return
    for lo in range(0, per_row, segment):
        index = starts + lo + torch.arange(min(segment, per_row - lo), **on)   # (streams, L)
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
    try:
        with urllib.request.urlopen(ENWIK8_URL) as response, partial.open("wb") as out:
            while chunk := response.read(1 << 20):
                out.write(chunk)
        with zipfile.ZipFile(partial) as archive:
            data = archive.read(_zip_member(partial))
        if len(data) != ENWIK8_SIZE or _md5(data) != ENWIK8_MD5:
            raise ValueError(f"downloaded enwik8 has {len(data)} bytes and md5 "
                             f"{_md5(data)}; expected {ENWIK8_SIZE} and {ENWIK8_MD5}")
    except BaseException:   # (offline, a reset, not a zip, Ctrl-C: no partial file is left)
        partial.unlink(missing_ok=True)
        raise
    partial.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    """``python -m fastrwa.train.data download-enwik8 DIR``: the path of the verified zip on
    stdout (status 0); an error that stops it (offline, a full disk, a bad download) in one
    line (status 1), Ctrl-C in one line (status 130), neither leaving a partial file."""
    p = argparse.ArgumentParser(prog="python -m fastrwa.train.data")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("download-enwik8", help="fetch enwik8.zip and verify size and md5")
    d.add_argument("directory")
    args = p.parse_args(argv)
    try:
        print(download_enwik8(args.directory))
    except KeyboardInterrupt:
        print(f"download-enwik8: stopped by Ctrl-C; nothing was kept in {args.directory}",
              file=sys.stderr)
        return 130
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        reason = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
        print(f"error: cannot download {ENWIK8_URL} into {args.directory}: "
              f"{' '.join(str(reason).split())}; fetch it by hand and give its path as "
              f"--data", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
