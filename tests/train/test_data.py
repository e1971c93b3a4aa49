"""The training data's integrity: a truncated enwik8.zip is refused (not trained on as
compressed bytes), a damaged cached extraction is extracted again, a corpus truncated or
unreadable while in use is a clear error (never a crash, never called a cache write error),
and the partial copies of killed processes are removed."""

import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

from fastrwa.train import data as fdata
from fastrwa.train.cli import main as train_main

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _run(tmp_path: Path, name: str, *flags) -> tuple[int, Path]:
    args = ["--run-dir", str(tmp_path / name), "--no-progress", *map(str, flags)]
    return train_main(args), tmp_path / name


def _corpus(tmp_path: Path, name: str = "corpus.txt", n: int = 6_000) -> Path:
    path = tmp_path / name
    path.write_bytes(bytes((i * 7 + i // 13) % 251 for i in range(n)))
    return path


# -- enwik8.zip and its cached extraction --------------------------------------------------
def _zip(path: Path, raw: bytes) -> Path:
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("enwik8", raw)
    return path


def test_a_truncated_zip_is_refused_not_trained_on_as_compressed_bytes(tmp_path, capsys):
    raw = bytes((i * 7 + i // 13) % 251 for i in range(20_000))
    whole = _zip(tmp_path / "whole.zip", raw).read_bytes()
    cut = tmp_path / "enwik8.zip"
    cut.write_bytes(whole[: len(whole) // 2])            # an interrupted download
    with pytest.raises(ValueError, match="truncated or damaged.*download it again"):
        fdata.read_corpus(cut)
    code, run = _run(tmp_path, "run", "--task", "enwik8", "--data", cut, "--hidden", 8,
                     "--layers", 1, "--batch-size", 2, "--bptt", 16, "--steps", 1)
    err = capsys.readouterr().err
    assert code == 2 and "enwik8.zip" in err and "truncated" in err
    assert not run.exists() or not any(run.iterdir())   # a rerun is not blocked


def test_a_damaged_cached_extraction_is_extracted_again(tmp_path, capsys):
    raw = bytes((i * 7 + i // 13) % 251 for i in range(20_000))
    archive = _zip(tmp_path / "enwik8.zip", raw)
    assert bytes(fdata.read_corpus(archive).tolist()) == raw
    (cached,) = [p for p in (tmp_path / "cache").iterdir() if p.name.startswith("enwik8")]
    damaged = bytearray(cached.read_bytes())
    damaged[1234] ^= 0x01                               # same size, one bit off
    cached.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert bytes(fdata.read_corpus(archive).tolist()) == raw
    assert "extracting" in capsys.readouterr().err
    assert cached.read_bytes() == raw


# -- a corpus rewritten or unreadable during a run -----------------------------------------
def test_a_corpus_truncated_while_in_use_cannot_crash_the_reader(tmp_path):
    """The corpus is memory-mapped; reading a page of a file truncated since killed the
    process with SIGBUS. The map is of a private copy now."""
    corpus = _corpus(tmp_path, n=1 << 20)
    script = textwrap.dedent(f"""
        from fastrwa.train.data import read_corpus
        data = read_corpus({str(corpus)!r})
        open({str(corpus)!r}, "wb").close()                # truncated in place
        print(int(data[-1]), int(data[len(data) // 2]))
    """)
    env = {**ENV, "FASTRWA_CACHE": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120)
    n = 1 << 20
    expected = f"{((n - 1) * 7 + (n - 1) // 13) % 251} {((n // 2) * 7 + (n // 2) // 13) % 251}"
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.strip() == expected


def test_a_corpus_that_cannot_be_read_is_not_called_a_cache_write_error(tmp_path):
    import errno as errno_

    class Failing:
        def read(self, n):
            raise OSError(errno_.EIO, "Input/output error")

    with pytest.raises(OSError) as info:
        fdata._copy(Failing(), tmp_path / "cached", tmp_path / "cached.tmp",
                    tmp_path / "corpus.txt")
    message = str(info.value)
    assert "cannot read" in message and "corpus.txt" in message and "cannot write" not in message
    assert not (tmp_path / "cached.tmp").exists()


def test_copies_left_by_killed_processes_are_removed(tmp_path, monkeypatch):
    """A process killed while copying a corpus into the cache leaves ``<name>.<pid>.tmp``;
    the next copy of that corpus removes those whose process is gone (they piled up, each the
    corpus's size), and leaves a live process's alone."""
    monkeypatch.setenv("FASTRWA_CACHE", str(tmp_path / "cache"))
    corpus = _corpus(tmp_path)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(gone.stdout)
    size = corpus.stat().st_size
    sha = fdata.hashlib.sha256(corpus.read_bytes()).hexdigest()
    name = f"{corpus.name}-{size}-{sha[:16]}"
    cache = tmp_path / "cache"
    cache.mkdir()
    dead, live = cache / f"{name}.{dead_pid}.tmp", cache / f"{name}.1.tmp"   # (pid 1 runs)
    dead.write_bytes(b"partial")
    live.write_bytes(b"partial")
    path, got_sha = fdata._snapshot(corpus)
    assert path.read_bytes() == corpus.read_bytes() and got_sha == sha
    assert not dead.exists() and live.exists()


def test_download_enwik8_offline_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    import urllib.error
    import urllib.request

    from fastrwa.train import data

    assert data.ENWIK8_URL.startswith("https://")

    def offline(url, *args, **kwargs):
        raise urllib.error.URLError(OSError(-3, "Temporary failure in name resolution"))
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    assert data.main(["download-enwik8", str(tmp_path / "d")]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "name resolution" in err, err
    assert data.ENWIK8_URL in err and "--data" in err
    assert list((tmp_path / "d").iterdir()) == []


def test_download_enwik8_cut_by_ctrl_c_is_one_line_and_leaves_nothing(tmp_path, monkeypatch,
                                                                      capsys):
    import io
    import urllib.request

    from fastrwa.train import data

    class Cut(io.BytesIO):
        def read(self, n=-1):
            raise KeyboardInterrupt
    monkeypatch.setattr(urllib.request, "urlopen", lambda url: Cut())
    assert data.main(["download-enwik8", str(tmp_path / "d")]) == 130
    assert "stopped by Ctrl-C" in capsys.readouterr().err
    assert list((tmp_path / "d").iterdir()) == []


def test_download_enwik8_of_a_page_that_is_not_a_zip_leaves_nothing(tmp_path, monkeypatch,
                                                                     capsys):
    import io
    import urllib.request

    from fastrwa.train import data

    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda url: io.BytesIO(b"<html>captive portal</html>"))
    assert data.main(["download-enwik8", str(tmp_path / "d")]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1
    assert list((tmp_path / "d").iterdir()) == []
