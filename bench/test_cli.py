"""The bench scripts' command lines (bench/cli.py): every bad flag value is one ``error:`` line
naming the flag after the usage, exit status 2, no traceback, before any work; results go to
a scratch folder git ignores, and a record under bench/results/ changes only with
``--record``, never from a check run (``--quick``, smaller sizes).

Every script runs here with ``cli.ROOT`` moved into a temporary folder (its bench/results/
holds a record per script, written before), so nothing here can write the repository's
records; kernels.py and traffic.py set Triton's variables when imported (kernels.py is
imported with the environment restored after; traffic.py runs in a subprocess). The scripts
are modules of the ``bench`` package (``bench.experiments`` for the model-quality ones)."""

from __future__ import annotations

import importlib
import os
import pathlib
import subprocess
import sys
from typing import Callable

import pytest
import torch

from bench import cli

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ("lm", "lm_gpu", "ablate", "long_context", "papers", "weights_bpc",
               "steps_to_baseline")
CORPUS = b"the quick brown fox jumps over the lazy dog. " * 50_000     # 2.25 MB: a split of
# 112 KB, more than the defaults read (weights_bpc.py's 100,000 bytes, long_context.py's 16
# stretches of 8192)


def script(name: str):
    """The bench script ``name`` imported, with the environment left as it was."""
    saved = dict(os.environ)
    try:
        return importlib.import_module(
            f"bench.experiments.{name}" if name in EXPERIMENTS else f"bench.{name}")
    finally:
        for key in set(os.environ) | set(saved):
            if key not in saved:
                del os.environ[key]
            elif os.environ.get(key) != saved[key]:
                os.environ[key] = saved[key]


@pytest.fixture
def root(tmp_path, monkeypatch) -> dict[str, str]:
    """``cli.ROOT`` in ``tmp_path``, with a record per script under its bench/results/; the
    names the cases below use for their arguments, and the records' paths."""
    from fastrwa.models import ByteLM, LMConfig, save_pretrained

    monkeypatch.setattr(cli, "ROOT", tmp_path)
    monkeypatch.setenv("FASTRWA_CACHE", str(tmp_path / "cache"))      # (corpora's copies)
    for name in RECORDED:
        record = cli.results_dir(FOLDER.get(name, name)) / "record.json"
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text('{"measured": "before"}')
    (tmp_path / "FILE").write_text("")
    (tmp_path / "EMPTY").mkdir()
    (tmp_path / "corpus.txt").write_bytes(CORPUS)
    torch.manual_seed(0)
    save_pretrained(ByteLM(LMConfig(d_model=16, n_layers=1)), tmp_path / "model")
    for name in ("r1", "r2"):
        (tmp_path / f"{name}.json").write_text(
            f'{{"device": "{name}", "torch": "1", "triton": "1", "rows": [], '
            f'"lstm_ratio": null}}')
    return {"FILE": str(tmp_path / "FILE"), "EMPTY": str(tmp_path / "EMPTY"),
            "MISSING": str(tmp_path / "missing"), "DATA": str(tmp_path / "corpus.txt"),
            "MODEL": str(tmp_path / "model"), "R1": str(tmp_path / "r1.json"),
            "R2": str(tmp_path / "r2.json"), "RECORD": str(cli.results_dir("x"))}


def records(tmp_path: pathlib.Path) -> dict:
    """Every file under ``tmp_path``'s bench/results/: its bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted((tmp_path / "bench" / "results").rglob("*")) if p.is_file()}


def parse(name: str) -> Callable:
    """The function of the bench script ``name`` that reads its command line and refuses
    bad values."""
    module = script(name)
    return getattr(module, "parse_args", None) or module.main


def assert_one_error(err: str, flag: str) -> None:
    lines = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert lines[0].startswith("usage:") and ": error: " in lines[-1], err
    assert flag in lines[-1], err


# (script, arguments, what the error line names); DATA, FILE, ... are root's
BAD = [
    ("busy_core", ["--seconds", "0"], "argument --seconds"),
    ("busy_core", ["--hidden", "-1"], "argument --hidden"),
    ("busy_core", ["--out", "FILE"], "argument --out"),
    ("cpu_fair", ["--rounds", "0"], "argument --rounds"),
    ("cpu_fair", ["--shape", "0,0,0"], "argument --shape"),
    ("cpu_fair", ["--shape", "1,2"], "argument --shape"),
    ("cpu_fair", ["--threads", "-1"], "argument --threads"),
    ("cpu_fair", ["--out", "FILE"], "argument --out"),
    ("cpu_cycles", ["--rounds", "-1"], "argument --rounds"),
    ("cpu_cycles", ["--sizes", "1,2,3"], "argument --sizes"),
    ("cpu_cycles", ["--sizes", "1,1,1;0,1,1"], "argument --sizes"),
    ("cpu_cycles", ["--out", "FILE"], "argument --out"),
    ("serve", ["--server-cpus", "0"], "--client-cpus: give both"),
    ("serve", ["--server-cpus", "0", "--client-cpus", "0"], "argument --client-cpus: shares"),
    ("serve", ["--server-cpus", "0", "--client-cpus", "99999"], "argument --client-cpus: CPUs"),
    ("serve", ["--server-cpus", "0,x", "--client-cpus", "1"], "argument --server-cpus"),
    ("serve", ["--server-cpus", "0", "--client-cpus", "1", "--threads", "2"],
     "argument --threads: 2 threads on 1"),
    ("serve", ["--threads", "0"], "argument --threads"),
    ("generation", ["--bytes", "-5"], "argument --bytes"),
    ("generation", ["--bytes", "1"], "argument --bytes"),
    ("generation", ["--d-model", "0"], "argument --d-model"),
    ("generation", ["--layers", "0"], "argument --layers"),
    ("generation", ["--rss-bytes", "-1"], "argument --rss-bytes"),
    ("generation", ["--threads", "0"], "argument --threads"),
    ("generation", ["--threads", "1,,2"], "argument --threads"),
    ("generation", ["--batches", "0"], "argument --batches"),
    ("generation", ["--weights", "bogus"], "argument --weights"),
    ("generation", ["--lm", "nonsense"], "argument --lm"),
    ("generation", ["--lm", "bogus=1"], "--lm"),
    ("generation", ["--lm", "n_layers=2"], "--lm n_layers"),
    ("generation", ["--cold-runs", "-1"], "argument --cold-runs"),
    ("generation", ["--out", "FILE"], "argument --out"),
    ("context_parallel", ["--T-log2", "0"], "argument --T-log2"),
    ("context_parallel", ["--layer-T-log2", "-1"], "argument --layer-T-log2"),
    ("context_parallel", ["--out", "FILE"], "argument --out"),
    ("long_context", ["--data", "MISSING", "--quick"], "argument --data"),
    ("long_context", ["--data", "DATA", "--models", "FILE"], "argument --models"),
    ("long_context", ["--data", "DATA", "--models", "EMPTY"], "--models"),
    ("long_context", ["--data", "DATA", "--quick", "--length", "0"], "argument --length"),
    ("long_context", ["--data", "DATA", "--quick", "--docs", "-1"], "argument --docs"),
    ("long_context", ["--data", "DATA", "--quick", "--window", "0"], "argument --window"),
    ("long_context", ["--data", "DATA", "--quick", "--length", "16", "--window", "32"],
     "--window"),
    ("long_context", ["--data", "DATA", "--models", "MODEL", "--length", "1000000"], "--length"),
    ("long_context", ["--data", "DATA", "--quick", "--out", "FILE"], "argument --out"),
    ("weights_bpc", ["MISSING", "--data", "DATA"], "argument model_dir"),
    ("weights_bpc", ["EMPTY", "--data", "DATA"], "model_dir"),
    ("weights_bpc", ["MODEL", "--data", "MISSING"], "argument --data"),
    ("weights_bpc", ["MODEL", "--data", "DATA", "--bytes", "1"], "argument --bytes"),
    ("weights_bpc", ["MODEL", "--data", "DATA", "--bytes", "10000000"], "--bytes"),
    ("weights_bpc", ["MODEL", "--data", "DATA", "--streams", "0"], "argument --streams"),
    ("weights_bpc", ["MODEL", "--data", "DATA", "--segment", "0"], "argument --segment"),
    ("weights_bpc", ["MODEL", "--data", "DATA", "--check-steps", "1"], "argument --check-steps"),
    ("weights_bpc", ["MODEL", "--data", "DATA", "--bytes", "100"], "--check-steps"),
    ("weights_bpc", ["MODEL", "--data", "DATA", "--out", "FILE"], "argument --out"),
    ("lm", ["--data", "MISSING"], "argument --data"),
    ("lm", [], "--data"),
    ("lm", ["--table", "MISSING"], "--table"),
    ("lm", ["--table", "FILE"], "--table"),
    ("lm", ["--data", "DATA", "--steps", "0"], "argument --steps"),
    ("lm", ["--data", "DATA", "--d-model", "0"], "argument --d-model"),
    ("lm", ["--data", "DATA", "--layers", "0"], "argument --layers"),
    ("lm", ["--data", "DATA", "--batch-size", "0"], "argument --batch-size"),
    ("lm", ["--data", "DATA", "--bptt", "0"], "argument --bptt"),
    ("lm", ["--data", "DATA", "--evals", "0"], "argument --evals"),
    ("lm", ["--data", "DATA", "--eval-bytes", "0"], "argument --eval-bytes"),
    ("lm", ["--data", "DATA", "--bptt", "31", "--models", "transformer"], "--bptt"),
    ("lm_gpu", ["--data", "MISSING"], "argument --data"),
    ("lm_gpu", [], "--data"),
    ("lm_gpu", ["--table", "FILE"], "--table"),
    ("lm_gpu", ["--data", "DATA", "--device", "cpu", "--minutes", "0"], "argument --minutes"),
    ("lm_gpu", ["--data", "DATA", "--device", "cpu", "--d-model", "0"], "argument --d-model"),
    ("lm_gpu", ["--data", "DATA", "--device", "cpu", "--head-dim", "3"], "--head-dim"),
    ("lm_gpu", ["--data", "DATA", "--device", "cpu", "--bptt", "31"], "--bptt"),
    ("lm_gpu", ["--data", "DATA", "--device", "cpu", "--out", "FILE"], "argument --out"),
    ("lm_gpu", ["--data", "DATA", "--device", "cpu", "--record"], "drop --device cpu"),
    ("ablate", ["--data", "MISSING"], "argument --data"),
    ("ablate", [], "--data"),
    ("ablate", ["--data", "DATA", "--d-model", "0"], "argument --d-model"),
    ("ablate", ["--data", "DATA", "--layers", "0"], "argument --layers"),
    ("ablate", ["--data", "DATA", "--steps", "0"], "argument --steps"),
    ("ablate", ["--data", "DATA", "--warmup", "-1"], "argument --warmup"),
    ("ablate", ["--data", "DATA", "--batch-size", "0"], "argument --batch-size"),
    ("ablate", ["--data", "DATA", "--bptt", "0"], "argument --bptt"),
    ("ablate", ["--data", "DATA", "--eval-bytes", "0"], "argument --eval-bytes"),
    ("ablate", ["--data", "DATA", "--seeds", "-1"], "argument --seeds"),
    ("ablate", ["--data", "DATA", "--seeds", "4294967296"], "--seed"),
    ("ablate", ["--data", "DATA", "--only", "bogus"], "argument --only"),
    ("ablate", ["--retime", "MISSING"], "argument --retime"),
    ("ablate", ["--retime", "FILE"], "--retime"),
    ("ablate", ["--table", "FILE"], "--table"),
    ("ablate", ["--data", "DATA", "--out", "FILE"], "argument --out"),
    ("papers", ["--eval-every", "0"], "argument --eval-every"),
    ("papers", ["--layers", "0"], "argument --layers"),
    ("papers", ["--lr", "0"], "argument --lr"),
    ("papers", ["--join", "MISSING"], "--join"),
    ("ops", ["--device", "cpu", "--out", "FILE"], "argument --out"),
    ("ops", ["--device", "cpu", "--only"], "argument --only"),
    ("ops", ["--device", "cpu", "--paths"], "argument --paths"),
    ("ops", ["--device", "cpu", "--only", "bogus"], "argument --only"),
    ("kernels", ["--workers", "0"], "argument --workers"),
    ("kernels", ["--channels", "0"], "argument --channels"),
    ("kernels", ["--json", "EMPTY"], "argument --json"),
    ("kernels", ["--option", "block_t"], "argument --option"),
    ("kernels", ["--option", "bogus=1"], "--option bogus"),
    ("kernels", ["--option", "block_t=3"], "--option"),
    ("steps_to_baseline", ["--task", "bogus"], "argument --task"),
    ("steps_to_baseline", ["--seq-len", "0"], "argument --seq-len"),
    ("steps_to_baseline", ["--seq-len", "1"], "--seq-len"),
    ("steps_to_baseline", ["--models", "bogus"], "argument --models"),
    ("steps_to_baseline", ["--max-steps", "0"], "argument --max-steps"),
    ("steps_to_baseline", ["--eval-every", "0"], "argument --eval-every"),
    ("steps_to_baseline", ["--eval-every", "2000"], "--eval-every"),
    ("steps_to_baseline", ["--lr", "0"], "argument --lr"),
    ("steps_to_baseline", ["--seed", "-1"], "argument --seed"),
    ("steps_to_baseline", ["--margin", "1"], "argument --margin"),
    ("steps_to_baseline", ["--reuse", "--out", "EMPTY"], "--reuse"),
    ("steps_to_baseline", ["--out", "FILE"], "argument --out"),
    ("ops", ["--device", "cuda", "--only", "bogus"], "argument --only"),
    ("ops", ["--device", "cuda", "--only", ""], "argument --only"),
    ("ops", ["--device", "cuda", "--training", "MISSING"], "argument --training"),
    ("ops", ["--device", "cuda", "--out", "FILE"], "argument --out"),
    ("gpu_sweep", ["--only", "defaults", "--shapes", "9"], "argument --shapes"),
    ("gpu_sweep", ["--only", "defaults", "--candidates", "bogus"], "argument --candidates"),
    ("gpu_sweep", ["--out", "FILE"], "argument --out"),
    ("gpu_sweep", ["--shapes", "0"], "--shapes is for the defaults and streams"),
    ("gpu_sweep", ["--candidates", "carry8"], "--candidates is for the defaults"),
    ("gpu_report", ["merge", "MISSING"], "argument reports"),
    ("gpu_report", ["merge", "FILE"], "report"),
    ("gpu_report", ["merge", "R1", "R2"], "cannot merge"),
    ("gpu_report", ["merge", "R1", "--training", "FILE"], "--training"),
    ("gpu_report", ["merge", "R1", "--out", "FILE"], "argument --out"),
    ("gpu_memcheck", ["--foo"], "unrecognized arguments: --foo"),
    ("gpu_ncu", ["--foo"], "unrecognized arguments: --foo"),
]
if not torch.cuda.is_available():                  # (where there is one, the value is good)
    BAD.append(("lm", ["--data", "DATA", "--device", "cuda"], "--device cuda"))
    BAD.append(("lm_gpu", ["--data", "DATA"], "--device cuda"))


@pytest.mark.parametrize("name,argv,flag", BAD, ids=[f"{n} {' '.join(a)}" for n, a, _ in BAD])
def test_a_bad_value_is_one_error_line_before_any_work(root, tmp_path, capsys, name, argv,
                                                       flag):
    """Each was a traceback or a value accepted silently: one line naming the flag now."""
    if name == "kernels" and "=" in " ".join(argv):
        pytest.importorskip("triton")
    before = records(tmp_path)
    with pytest.raises(SystemExit) as exit_:
        parse(name)([root.get(a, a) for a in argv])
    assert exit_.value.code == 2
    assert_one_error(capsys.readouterr().err, flag)
    assert records(tmp_path) == before and not cli.scratch_dir().exists()


def test_traffic_refuses_a_bad_size():
    """(a subprocess: importing traffic.py turns Triton's interpreter on)"""
    pytest.importorskip("triton")
    done = subprocess.run([sys.executable, "-m", "bench.traffic", "--batch", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert_one_error(done.stderr, "argument --batch")


# The scripts that write results: (name, arguments of a run, its scratch and record folder,
# arguments that make it a check run)
RECORDED = {"busy_core": ([], ["--seconds", "1"]),
            "cpu_fair": ([], ["--shape", "2,64,8"]),
            "cpu_cycles": ([], ["--sizes", "1,16,8;2,32,8"]),
            "generation": ([], ["--bytes", "100"]),
            "generation-large": (["--model", "large"], ["--d-model", "64"]),
            "context_parallel": ([], ["--T-log2", "10"]),
            "long_context": (["--data", "DATA", "--models", "MODEL"], ["--length", "4096"]),
            "lm": (["--data", "DATA"], ["--quick"]),
            "ablate": (["--data", "DATA"], ["--quick"]),
            "papers": ([], ["--quick"]),
            "weights_bpc": (["MODEL", "--data", "DATA"], ["--bytes", "1000"])}
FOLDER = {"weights_bpc": "generation"}           # the others' folders and scripts: their names
SCRIPT = {"generation-large": "generation"}


def run_args(name: str, argv: list[str]):
    """The arguments of the bench script ``name`` read (``papers`` and ``lm`` return more
    than them)."""
    args = parse(SCRIPT.get(name, name))(argv)
    return args[0] if isinstance(args, tuple) else args


@pytest.mark.parametrize("name", RECORDED)
def test_results_go_to_scratch_and_the_record_takes_full_runs_only(root, tmp_path, capsys,
                                                                   name):
    """By default a script writes under bench-results/ (git ignores it); bench/results/
    takes its results only with --record, and never those of a check run (--quick, smaller
    sizes): a run of cpu_fair.py or generation.py once replaced the committed record."""
    before = records(tmp_path)
    argv, small = ([root.get(a, a) for a in flags] for flags in RECORDED[name])
    folder = FOLDER.get(name, name)
    assert run_args(name, argv).out == cli.scratch_dir(folder)
    assert cli.scratch_dir(folder).is_dir()
    assert run_args(name, [*argv, "--record"]).out == cli.results_dir(folder)
    for flags, message in (([*small, "--record"], f"drop {small[0]}"),
                           (["--out", str(cli.results_dir(folder))], "add --record"),
                           (["--record", "--out", str(tmp_path / "elsewhere")],
                            "--record writes under bench/results/")):
        with pytest.raises(SystemExit) as exit_:
            run_args(name, [*argv, *flags])
        assert exit_.value.code == 2
        assert_one_error(capsys.readouterr().err, message)
    assert records(tmp_path) == before


@pytest.mark.parametrize("name,argv", [("ops", ["--device", "cpu"]), ("steps_to_baseline", []),
                                       ("ops", ["--device", "cuda"]),
                                       ("gpu_report", ["merge", "R1"])])
def test_a_script_without_a_record_takes_record_only_with_out_under_it(root, tmp_path, capsys,
                                                                       name, argv):
    argv = [root.get(a, a) for a in argv]
    for flags, message in ((["--record"], "--record needs --out"),
                           (["--out", root["RECORD"]], "add --record"),
                           (["--record", "--out", str(tmp_path / "elsewhere")],
                            "--record writes under bench/results/")):
        with pytest.raises(SystemExit) as exit_:
            parse(name)([*argv, *flags])
        assert exit_.value.code == 2
        assert_one_error(capsys.readouterr().err, message)
    assert not pathlib.Path(root["RECORD"]).exists()


def test_kernels_writes_the_committed_table_only_with_record(root, capsys):
    pytest.importorskip("triton")
    table = cli.results_dir("kernels.json")
    assert parse("kernels")(["--record"]).json == table
    for flags, message in ((["--json", str(table)], "add --record"),
                           (["--record", "--quick"], "drop --quick"),
                           (["--record", "--channels", "512"], "drop --channels"),
                           (["--record", "--option", "block_t=32"], "drop --option")):
        with pytest.raises(SystemExit):
            parse("kernels")(flags)
        assert_one_error(capsys.readouterr().err, message)


def test_a_default_run_leaves_the_record_as_it_was(root, tmp_path, capsys):
    """cpu_fair.py run end to end without --out: its JSON lands in bench-results/cpu_fair,
    and bench/results/cpu_fair (a record there before) is left byte for byte."""
    before = records(tmp_path)
    assert script("cpu_fair").main(["--shape", "2,64,8", "--rounds", "1"]) == 0
    assert records(tmp_path) == before
    assert (cli.scratch_dir("cpu_fair") / "cpu_fair.json").is_file()
    assert str(cli.scratch_dir("cpu_fair") / "cpu_fair.json") in capsys.readouterr().out


# Every flag that makes a run smaller or narrower than a full one, by itself: with --record
# each is a check run, refused (one error line naming the flag) before any work; RECORDED's
# arguments come first ("" is an empty value)
CHECK_RUNS = [
    ("busy_core", ["--hidden", "16"], "--hidden"),
    ("busy_core", ["--layers", "1"], "--layers"),
    ("busy_core", ["--batch-size", "4"], "--batch-size"),
    ("busy_core", ["--bptt", "16"], "--bptt"),
    ("cpu_fair", ["--rounds", "1"], "--rounds"),
    ("cpu_fair", ["--shape", "16,4096,8"], "--shape"),
    ("cpu_cycles", ["--rounds", "1"], "--rounds"),
    ("generation", ["--threads", "1"], "--threads"),
    ("generation", ["--threads", "2,2"], "--threads"),
    ("generation", ["--batches", ""], "--batches"),
    ("generation", ["--batches", "8"], "--batches"),
    ("generation", ["--batches", "8,32"], "--batches"),
    ("generation", ["--weights", "int8"], "--weights"),
    ("generation", ["--weights", "eager,float32,bfloat16"], "--weights"),
    ("generation", ["--cold-runs", "0"], "--cold-runs"),
    ("generation", ["--rss-bytes", "0"], "--rss-bytes"),
    ("generation", ["--layers", "2"], "--layers"),
    ("generation-large", ["--bytes", "30"], "--bytes"),
    ("generation-large", ["--threads", "2"], "--threads"),
    ("generation-large", ["--weights", "int8"], "--weights"),
    ("context_parallel", ["--layer-T-log2", "10"], "--layer-T-log2"),
    ("long_context", ["--docs", "2"], "--docs"),
    ("weights_bpc", ["--check-steps", "100"], "--check-steps"),
    ("lm", ["--minutes", "0.05"], "--minutes"),
    ("lm", ["--equal", "steps", "--steps", "4"], "--steps"),
    ("lm", ["--equal", "steps", "--steps", "599"], "--steps"),
    ("lm", ["--d-model", "16"], "--d-model"),
    ("lm", ["--layers", "2"], "--layers"),
    ("lm", ["--baseline-layers", "1"], "--baseline-layers"),
    ("lm", ["--batch-size", "4"], "--batch-size"),
    ("lm", ["--bptt", "32"], "--bptt"),
    ("lm", ["--evals", "2"], "--evals"),
    ("lm", ["--eval-bytes", "2000"], "--eval-bytes"),
    ("ablate", ["--d-model", "16"], "--d-model"),
    ("ablate", ["--layers", "2"], "--layers"),
    ("ablate", ["--steps", "4"], "--steps"),
    ("ablate", ["--batch-size", "4"], "--batch-size"),
    ("ablate", ["--bptt", "16"], "--bptt"),
    ("ablate", ["--eval-bytes", "2000"], "--eval-bytes"),
    ("ablate", ["--seeds", "0"], "--seeds"),
    ("ablate", ["--seeds", "1", "1"], "--seeds"),
    ("papers", ["--max-steps", "3"], "--max-steps"),
    ("papers", ["--time-limit", "1"], "--time-limit"),
    ("papers", ["--seq-len", "20"], "--seq-len"),
]


@pytest.mark.parametrize("name,flags,flag", CHECK_RUNS,
                         ids=[f"{n} {' '.join(a)}" for n, a, _ in CHECK_RUNS])
def test_record_refuses_every_flag_that_makes_a_check_run(root, tmp_path, capsys, name, flags,
                                                          flag):
    """Each was accepted with --record and its partial results replaced the record (lm.py
    and ablate.py checked no size at all, generation.py not its lists, cpu_fair.py and
    cpu_cycles.py not --rounds, and a shorter list never counted as smaller)."""
    before = records(tmp_path)
    argv = [root.get(a, a) for a in RECORDED[name][0]]
    with pytest.raises(SystemExit) as exit_:
        run_args(name, [*argv, *flags, "--record"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert_one_error(err, "--record takes full-size runs only")
    assert flag in err.strip().splitlines()[-1].split("drop ")[1], err
    assert records(tmp_path) == before


# Runs that are full size though not the defaults: --record takes them (papers.py merges a
# run into its record by configuration, lm.py's records are chosen models and variants that
# docs/lm.md describes: equal steps at 600, 2 blocks of 360 at equal parameters)
FULL_RUNS = [
    ("lm", ["--equal", "steps", "--steps", "600", "--models", "rda-scan,transformer,mingru"]),
    ("lm", ["--equal", "steps", "--steps", "600", "--models", "rda-scan", "--layers", "2",
            "--d-model", "360"]),
    ("lm", ["--equal", "steps", "--minutes", "0.05"]),          # (minutes unused)
    ("lm", ["--minutes", "21", "--models", "lstm", "--steps", "4"]),  # (steps unused)
    ("ablate", ["--seeds", "2", "3"]),
    ("ablate", ["--warmup", "0"]),
    ("papers", ["--tasks", "classify-length", "--models", "rwa-scan", "--max-steps", "600",
                "--time-limit", "600", "--lr", "3e-3"]),
    ("papers", ["--tasks", "multicopy", "--seeds", "0", "--seq-len", "200",
                "--time-limit", "300"]),
    ("generation", ["--threads", "1,2,4"]),
    ("generation", ["--batches", "8,64,128", "--weights", "int8,eager,bfloat16,float32"]),
    ("generation-large", ["--threads", "2,1"]),
    ("cpu_fair", ["--rounds", "30", "--shape", "32,4096,256"]),
]


@pytest.mark.parametrize("name,flags", FULL_RUNS,
                         ids=[f"{n} {' '.join(a)}" for n, a in FULL_RUNS])
def test_record_takes_a_full_run_that_is_not_the_defaults(root, tmp_path, name, flags):
    before = records(tmp_path)
    argv = [root.get(a, a) for a in RECORDED[name][0]]
    folder = FOLDER.get(name, name)
    assert run_args(name, [*argv, *flags, "--record"]).out == cli.results_dir(folder)
    assert records(tmp_path) == before


@pytest.mark.parametrize("value,full,expected", [
    (3, 4, True), (4, 4, False), (None, 4, False), (4, None, False),
    ((16, 64, 8), (16, 64, 256), True), ((32, 64, 256), (16, 64, 256), False),
    ([(1, 2, 3), (4, 5, 6)], [(1, 2, 3), (4, 5, 7)], True),
    ([1], [1, 2], True), ([], [8, 64], True), ([2, 2], [1, 2], True), ([2, 1], [1, 2], False),
    ([1, 2, 4], [1, 2], False), ([2, 4], [1, 2], False),
    (["a"], ["a", "b"], True), (["b", "a"], ["a", "b"], False), (["a", "c"], ["a", "b"], True),
    (["a", "b", "c"], ["a", "b"], False)])
def test_smaller(value, full, expected):
    """A shorter list, or a list of names missing one of the full run's, is smaller (zip
    once let both through)."""
    assert cli.smaller(value, full) is expected


def test_a_bench_record_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """A record whose write fails (a full disk, a stop) leaves the earlier one whole and no
    temporary file; the figure the same."""
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from bench.cli import save_figure, save_json
    from fastrwa.models.files import WriteError

    path = tmp_path / "results.json"
    save_json(path, {"a": 1})
    unencodable = {"a": object()}                  # (json.dumps fails before any write)
    with pytest.raises(TypeError):
        save_json(path, unencodable)
    fig = plt.figure()
    png = tmp_path / "plot.png"
    save_figure(fig, png)
    before = png.read_bytes()

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(fig, "savefig", full)
    with pytest.raises(WriteError):
        save_figure(fig, png)
    plt.close(fig)
    assert json.loads(path.read_text()) == {"a": 1} and png.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png", "results.json"]
