"""An ONNX export directory is written whole or not at all (staged beside OUT_DIR, then
renamed into place), whatever stops it (a full disk, Ctrl-C, a kill); what a killed run
left never blocks a later one; ``OnnxLM`` refuses a directory whose files do not belong
together; the CLI's stops and missing extra are one line (issue 59)."""

from __future__ import annotations

import errno
import json
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from fastrwa.export import OnnxLM  # noqa: E402
from fastrwa.export.__main__ import main  # noqa: E402
from fastrwa.models import ByteLM, LMConfig, save_pretrained  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
FILES = ["onnx_config.json", "prompt.onnx", "step.onnx"]


@pytest.fixture
def run(tmp_path) -> pathlib.Path:
    """A run directory of a small model."""
    torch.manual_seed(5)
    save_pretrained(ByteLM(LMConfig(d_model=16, n_layers=1)), tmp_path / "run" / "model")
    return tmp_path / "run"


def contents(directory: pathlib.Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def one_line(err: str) -> str:
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def stop_at(monkeypatch, name: str, error: BaseException) -> None:
    """Every ``Path.write_bytes`` of a file named ``name`` (or its temporary) writes half
    its bytes, then raises ``error``."""
    write_bytes = pathlib.Path.write_bytes

    def half_then_raise(self, data):
        if name in self.name:
            write_bytes(self, data[:len(data) // 2])
            raise error
        return write_bytes(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", half_then_raise)


def test_a_full_disk_under_overwrite_keeps_the_earlier_export_whole(run, tmp_path, capsys,
                                                                    monkeypatch):
    """It left a float32 prompt.onnx beside the earlier int8 step.onnx and config, which
    OnnxLM ran, and a .step.onnx.tmp; the error named no path."""
    out = tmp_path / "onnx"
    assert main(["onnx", str(run), str(out), "--weights", "int8"]) == 0
    before = contents(out)
    capsys.readouterr()
    stop_at(monkeypatch, "step.onnx", OSError(errno.ENOSPC, "No space left on device"))
    assert main(["onnx", str(run), str(out), "--overwrite"]) == 2
    err = one_line(capsys.readouterr().err)
    assert contents(out) == before                       # the int8 export, whole
    assert err.startswith(f"error: cannot write {out}: No space left on device (writing "
                          f"step.onnx)"), err
    assert OnnxLM(out).config["weights"] == "int8"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]   # no leftovers
    # and to a new directory: nothing created
    assert main(["onnx", str(run), str(tmp_path / "new")]) == 2
    assert f"{tmp_path / 'new'} was not created" in one_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]


def test_ctrl_c_is_one_line_exit_130_and_nothing_half_written(run, tmp_path, capsys,
                                                              monkeypatch):
    """It was a KeyboardInterrupt traceback, and a half-written directory."""
    out = tmp_path / "onnx"
    assert main(["onnx", str(run), str(out)]) == 0
    before = contents(out)
    capsys.readouterr()
    stop_at(monkeypatch, "step.onnx", KeyboardInterrupt())
    assert main(["onnx", str(run), str(out), "--overwrite", "--weights", "float16"]) == 130
    err = one_line(capsys.readouterr().err)
    assert err.startswith("stopped") and str(out) in err, err
    assert contents(out) == before
    assert main(["onnx", str(run), str(tmp_path / "new")]) == 130
    one_line(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]


def killed_run(run: pathlib.Path, out: pathlib.Path, patch: str) -> None:
    """``python -m fastrwa.export onnx RUN OUT --overwrite --weights float16`` in a child
    process that SIGKILLs itself where ``patch`` (code run first) says."""
    script = "import os, pathlib, signal, sys, runpy\n" + textwrap.dedent(patch) + (
        f"sys.argv = ['fastrwa.export', 'onnx', {str(run)!r}, {str(out)!r}, '--overwrite', "
        f"'--weights', 'float16']\nrunpy.run_module('fastrwa.export', run_name='__main__')\n")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr


KILL_WRITING_STEP = """
write_bytes = pathlib.Path.write_bytes
def write(self, data):
    if "step.onnx" in self.name:
        write_bytes(self, data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
    return write_bytes(self, data)
pathlib.Path.write_bytes = write
"""

KILL_BETWEEN_RENAMES = """
rename = os.rename
def stop(src, dst, *args, **kwargs):
    rename(src, dst, *args, **kwargs)
    if pathlib.Path(dst).name.startswith(".onnx."):    # (the earlier export, moved aside)
        os.kill(os.getpid(), signal.SIGKILL)
os.rename = stop
"""


@pytest.mark.slow
def test_what_a_killed_export_left_never_blocks_a_later_one(run, tmp_path, capsys):
    """A killed run left its .NAME.tmp files, which then blocked --overwrite (and a
    killed run's files replaced the earlier export's one by one)."""
    out = tmp_path / "onnx"
    assert main(["onnx", str(run), str(out)]) == 0
    before = contents(out)
    # killed while writing: the earlier export is whole, the later run is not blocked
    killed_run(run, out, KILL_WRITING_STEP)
    assert contents(out) == before
    OnnxLM(out)
    assert main(["onnx", str(run), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]
    assert contents(out) == before                        # (the same export, written again)
    # killed between moving the earlier export aside and renaming the new one in: the next
    # run puts the earlier one back (then refuses, without --overwrite)
    killed_run(run, out, KILL_BETWEEN_RENAMES)
    capsys.readouterr()
    assert main(["onnx", str(run), str(out)]) == 2
    assert "pass --overwrite" in one_line(capsys.readouterr().err)
    assert contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]
    # an older version's leftover temporary files (.NAME.tmp) do not block --overwrite
    (out / ".step.onnx.tmp").write_bytes(b"half")
    assert main(["onnx", str(run), str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == FILES


def test_what_overwrite_refuses_is_named(run, tmp_path, capsys):
    """One policy: a non-empty directory needs --overwrite, and then only an earlier
    export is replaced; every message names the path."""
    out = tmp_path / "onnx"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    assert main(["onnx", str(run), str(out)]) == 2
    assert f"{out} exists and is not empty; pass --overwrite" in one_line(
        capsys.readouterr().err)
    assert main(["onnx", str(run), str(out), "--overwrite"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{out} exists and is not a fastrwa ONNX export" in err and "notes.txt" in err
    assert (out / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    assert main(["onnx", str(run), str(tmp_path / "file"), "--overwrite"]) == 2
    assert f"{tmp_path / 'file'} exists and is not a directory" in one_line(
        capsys.readouterr().err)
    (tmp_path / "link").symlink_to(out)
    assert main(["onnx", str(run), str(tmp_path / "link"), "--overwrite"]) == 2
    assert f"{tmp_path / 'link'} is a symbolic link" in one_line(capsys.readouterr().err)


def test_onnxlm_refuses_files_of_different_exports(run, tmp_path):
    """A step.onnx of another export beside this one's prompt.onnx and config ran as it
    was; by the file sizes and hashes the config records, or (an older version's config,
    which records none) by what each file says of its weights."""
    for weights in ("float32", "int8"):
        assert main(["onnx", str(run), str(tmp_path / weights), "--weights", weights]) == 0
    shutil.copyfile(tmp_path / "int8" / "step.onnx", tmp_path / "float32" / "step.onnx")
    with pytest.raises(ValueError, match=r"step\.onnx") as refused:
        OnnxLM(tmp_path / "float32")
    assert str(tmp_path / "float32") in str(refused.value) and "\n" not in str(refused.value)
    config = tmp_path / "float32" / "onnx_config.json"
    older = json.loads(config.read_text())
    del older["files"]
    config.write_text(json.dumps(older))
    with pytest.raises(ValueError, match=r"step\.onnx .*int8.*float32"):
        OnnxLM(tmp_path / "float32")
    shutil.copyfile(tmp_path / "int8" / "prompt.onnx", tmp_path / "float32" / "prompt.onnx")
    older["weights"] = "int8"                  # (now all three int8, as written: loads)
    config.write_text(json.dumps(older))
    OnnxLM(tmp_path / "float32")


def test_without_the_extra_the_cli_is_one_line_naming_an_install_that_works(run, tmp_path):
    """It was an ImportError traceback (and the message named a package not on PyPI)."""
    script = ("import sys, runpy; sys.modules['onnx'] = None; "
              f"sys.argv = ['fastrwa.export', 'onnx', {str(run)!r}, {str(tmp_path / 'o')!r}]; "
              "runpy.run_module('fastrwa.export', run_name='__main__')")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert child.returncode == 2, child.stderr
    err = one_line(child.stderr)
    assert err.startswith("error: ") and "pip install -e '.[onnx]'" in err, err
    assert "fastrwa[onnx]" not in err
    assert not (tmp_path / "o").exists()


KILL_WRITING_TOKENIZER = """
from fastrwa.hf import FastRWAByteTokenizer
def kill(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)
FastRWAByteTokenizer.save_pretrained = kill
"""


@pytest.mark.slow
def test_the_hugging_face_export_writes_its_directory_the_same_way(tmp_path, capsys,
                                                                   monkeypatch):
    """One policy for both exporters: a full disk under --overwrite names the path and
    keeps the earlier export (its error named no path); a killed export's staging
    directory is removed by the next one (it stayed beside OUT_DIR for good)."""
    pytest.importorskip("transformers")
    from fastrwa.hf import FastRWAByteTokenizer
    from fastrwa.hf.export import main as hf_main

    torch.manual_seed(0)
    save_pretrained(ByteLM(LMConfig(d_model=8, n_layers=1)), tmp_path / "m")
    out = tmp_path / "hf"
    assert hf_main([str(tmp_path / "m"), str(out)]) == 0
    before = contents(out)
    script = ("import os, signal, sys, runpy\n" + KILL_WRITING_TOKENIZER +
              f"sys.argv = ['x', {str(tmp_path / 'm')!r}, {str(out)!r}, '--overwrite']\n"
              "runpy.run_module('fastrwa.hf.export', run_name='__main__')\n")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert child.returncode == -signal.SIGKILL, child.stderr
    assert contents(out) == before
    capsys.readouterr()

    def full(self, directory, *args, **kwargs):
        (pathlib.Path(directory) / "tokenizer_config.json").write_text("{")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FastRWAByteTokenizer, "save_pretrained", full)
    assert hf_main([str(tmp_path / "m"), str(out), "--overwrite"]) == 2
    err = one_line(capsys.readouterr().err)
    assert err.startswith(f"error: cannot write {out}: No space left on device"), err
    assert contents(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "m"]    # no leftovers


SIGNAL_WRITING_STEP = """
write_bytes = pathlib.Path.write_bytes
def write(self, data):
    if "step.onnx" in self.name:
        write_bytes(self, data[:len(data) // 2])
        os.kill(os.getpid(), signal.SIG{name})
    return write_bytes(self, data)
pathlib.Path.write_bytes = write
"""


@pytest.mark.slow
@pytest.mark.parametrize("name, status", [("INT", 130), ("TERM", 143)])
def test_a_signal_during_the_export_is_one_line(run, tmp_path, name, status):
    """A real SIGINT (Ctrl-C) or SIGTERM while the files are written: one line, exit
    130 / 143, OUT_DIR as it was (Ctrl-C was a KeyboardInterrupt traceback; SIGTERM left
    the files written so far)."""
    out = tmp_path / "onnx"
    # (Ctrl-C's handler set again: a child inherits an ignored SIGINT, which Python then
    # leaves ignored, from a test process where another test left it so)
    script = ("import os, pathlib, signal, sys, runpy\n"
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              + SIGNAL_WRITING_STEP.format(name=name)
              + f"sys.argv = ['x', 'onnx', {str(run)!r}, {str(out)!r}]\n"
              "runpy.run_module('fastrwa.export', run_name='__main__')\n")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)
    assert child.returncode == status, child.stderr
    assert one_line(child.stderr) == f"stopped ({'Ctrl-C' if name == 'INT' else 'SIGTERM'}): " \
                                     f"{out} was not created\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_out_dir_may_be_the_current_directory(run, tmp_path, monkeypatch):
    """``OUT_DIR`` "." (an empty current directory): staged beside it, not inside it."""
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["onnx", str(run), "."]) == 0
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here", "run"]


@pytest.mark.parametrize("make", ["graph_alone", "graph_is_a_directory"])
def test_overwrite_replaces_only_a_directory_that_is_an_export(run, tmp_path, capsys, make):
    """A directory holding a graph's name but no onnx_config.json, or an entry of that name
    that is a directory, is not an earlier export: --overwrite refuses it, naming why."""
    out = tmp_path / "onnx"
    out.mkdir()
    if make == "graph_alone":
        (out / "step.onnx").write_bytes(b"mine")
    else:
        (out / "step.onnx").mkdir()
        (out / "step.onnx" / "data.bin").write_bytes(b"mine")
    assert main(["onnx", str(run), str(out), "--overwrite"]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{out} exists and is not a fastrwa ONNX export" in err, err
    assert (out / "step.onnx").exists()


def test_out_dir_dot_with_eval_reads_the_new_export(run, tmp_path, monkeypatch, capsys):
    here = tmp_path / "here"
    here.mkdir()
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(range(32, 127)) * 400)
    monkeypatch.chdir(here)
    assert main(["onnx", str(run), ".", "--eval", str(corpus)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "bits per byte on" in out and "onnxruntime" in out, out


def test_a_signal_during_the_swap_waits_for_it_and_the_line_says_so(run, tmp_path, capsys,
                                                                    monkeypatch):
    """A Ctrl-C between the two renames of the swap is held back until the swap (and the
    removal of the earlier export) is complete; the line then says the export is written."""
    import os

    from fastrwa.models import files

    out = tmp_path / "onnx"
    assert main(["onnx", str(run), str(out)]) == 0
    rename = os.rename
    # (Python's own Ctrl-C handler, as in the command: a test runner's worker may have
    # another, under which the signal would end the worker)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    def interrupted(src, dst):
        rename(src, dst)
        if ".fastrwa-old-" in str(dst):           # the first rename: the old moved aside
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(files.os, "rename", interrupted)
    capsys.readouterr()
    try:
        assert main(["onnx", str(run), str(out), "--overwrite"]) == 130
    finally:
        signal.signal(signal.SIGINT, previous)
    assert f"stopped (Ctrl-C): {out} is written whole" in one_line(capsys.readouterr().err)
    assert sorted(p.name for p in out.iterdir()) == FILES
    assert sorted(p.name for p in tmp_path.iterdir()) == ["onnx", "run"]
    OnnxLM(out)


def test_a_mount_point_is_refused_in_one_line_naming_a_directory_inside_it(run, tmp_path,
                                                                          capsys, monkeypatch):
    """The export is staged beside OUT_DIR and renamed in: no rename crosses into a mount
    point (a container's volume), so one is refused up front, with what to give instead."""
    import os

    from fastrwa.models import files

    out = tmp_path / "volume"
    out.mkdir()
    real = os.path.ismount
    monkeypatch.setattr(files.os.path, "ismount", lambda p: str(p) == str(out) or real(p))
    assert main(["onnx", str(run), str(out)]) == 2
    err = one_line(capsys.readouterr().err)
    assert f"{out} is a mount point" in err and str(out / "export") in err, err
    assert list(out.iterdir()) == []
