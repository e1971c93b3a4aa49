"""What of the GPU run can be checked without a GPU: the report's JSON shape, its table and
plot, the arguments, the exit without CUDA, the shell scripts' syntax."""

import json
import pathlib
import subprocess

import pytest
import torch

from bench import gpu_report, gpu_sweep, ops

ROOT = pathlib.Path(__file__).resolve().parents[1]


def report(**over):
    rows = [gpu_report.row("op", "rda-exp", "float32", (16, 4096, 1024), "looped", "fwd", 1.5, 0.8),
            gpu_report.row("peer", "fla.chunk_hgrn", "bfloat16", (16, 4096, 1024), None,
                           "fwd+bwd", 3.0, 0.4),
            gpu_report.row("layer", "nn.RDA", "float32", (16, 4096, 1024), None, "fwd+bwd", 9.0,
                           tokens_per_s=7e6)]
    return dict(gpu_report.empty_report("NVIDIA H100 80GB HBM3", "2.11.0", "3.6.0"), rows=rows,
                lstm_ratio=12.5) | over


def test_report_round_trips_in_the_issue_s_json_shape(tmp_path):
    path = gpu_report.write_json(report(), str(tmp_path))
    assert pathlib.Path(path).name == "gpu-nvidia-h100-80gb-hbm3.json"
    data = json.loads(pathlib.Path(path).read_text())
    gpu_report.validate(data)
    assert set(data) >= {"device", "torch", "triton", "rows", "lstm_ratio"}
    r = data["rows"][0]
    assert {k: r[k] for k in gpu_report.ROW_KEYS} == {
        "what": "op", "name": "rda-exp", "dtype": "float32", "shape": [16, 4096, 1024],
        "algorithm": "looped", "pass": "fwd", "ms": 1.5, "ratio_to_copy": 0.8}


@pytest.mark.parametrize("field,value,words", [
    ("what", "kernel", "'what' must be one of"), ("pass_", "bwd", "'pass' must be one of"),
    ("shape", (16, 4096), "'shape' must be"), ("ms", float("nan"), "'ms' must be"),
    ("ms", 0.0, "'ms' must be"), ("ratio_to_copy", -1.0, "'ratio_to_copy' must be")])
def test_a_row_outside_the_shape_is_refused(field, value, words):
    args = dict(what="op", name="rwa", dtype="float32", shape=(1, 2, 3), algorithm=None,
                pass_="fwd", ms=1.0, ratio_to_copy=None)
    args[field] = value
    with pytest.raises(ValueError, match=words):
        gpu_report.row(**args)


def test_a_report_outside_the_shape_is_not_written(tmp_path):
    with pytest.raises(ValueError, match="'device' must be a string"):
        gpu_report.write_json(report(device=None), str(tmp_path))
    with pytest.raises(ValueError, match="'lstm_ratio' must be"):
        gpu_report.validate(report(lstm_ratio="fast"))
    assert list(tmp_path.iterdir()) == []


def test_table_and_plot(tmp_path):
    text = gpu_report.table(report())
    lines = text.splitlines()
    assert "NVIDIA H100" in lines[0] and len(lines) == 2 + 3 + 1
    assert "rda-exp" in lines[2] and "0.80" in lines[2] and lines[-1].endswith("12.5x")
    png = tmp_path / "gpu.png"
    gpu_report.plot(report(), str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arguments_are_checked(capsys):
    with pytest.raises(SystemExit):
        ops.parse_args(["--device", "cuda", "--only", "ops,speed"])
    assert "argument --only: must be comma-separated names of checks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ops.parse_args(["--device", "cuda", "--training", "/no/such/lm.json"])
    assert ops.parse_args(["--device", "cuda", "--only", "ops,peers"]).sections == ["ops", "peers"]


def test_without_cuda_it_says_so_and_measures_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert ops.main(["--device", "cuda", "--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_shell_script_parses():
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_run.sh")], check=True)


def test_prepare_without_a_corpus_says_how():
    """bench/gpu_run.sh's prepare mode names its argument."""
    done = subprocess.run(["bash", str(ROOT / "bench" / "gpu_run.sh"), "prepare"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "usage: bash bench/gpu_run.sh prepare CORPUS_FILE" in done.stderr


def test_reports_of_several_calls_merge(tmp_path):
    a = report(lstm_ratio=None, checks=[{"ok": True}], section_seconds={"checks": 11.0})
    b = report(rows=report()["rows"][:1], sweep=[{"ms": 1.0}], section_seconds={"sweep": 345.0})
    merged = gpu_report.merge([a, b])
    assert len(merged["rows"]) == 4 and merged["lstm_ratio"] == 12.5
    assert merged["checks"] == [{"ok": True}] and merged["sweep"] == [{"ms": 1.0}]
    assert merged["section_seconds"] == {"checks": 11.0, "sweep": 345.0}   # each call's own
    with pytest.raises(ValueError, match="different triton"):
        gpu_report.merge([a, report(triton="3.9.0")])
    paths = []
    for i, r in enumerate((a, b)):
        (tmp_path / f"{i}").mkdir()
        paths.append(gpu_report.write_json(r, str(tmp_path / f"{i}")))
    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps({"runs": [{"model": "rda-scan", "tokens_per_s": 1e6}]}))
    assert gpu_report.main(["merge", *paths, "--training", str(lm),
                            "--out", str(tmp_path / "joined")]) == 0
    joined = json.loads((tmp_path / "joined" / "gpu-nvidia-h100-80gb-hbm3.json").read_text())
    assert len(joined["rows"]) == 4 and joined["training"]["runs"][0]["model"] == "rda-scan"
    assert (tmp_path / "joined" / "gpu-nvidia-h100-80gb-hbm3.png").exists()


def test_defaults_ratios_pair_each_candidate_with_its_defaults():
    def entry(candidate, dtype, fwd, fwd_bwd=None, op="rwa"):
        e = dict(shape=[1, 8, 4], dtype=dtype, op=op, candidate=candidate, algorithm="looped")
        if fwd is None:
            return dict(e, error="RuntimeError: failed")
        return dict(e, fwd=fwd, **{"fwd+bwd": fwd_bwd})
    entries = [
        dict(device="x"),
        entry("bt16", "float32", 1.0, 1.0),               # before any defaults: no ratio
        entry("default", "float32", 2.0, 8.0),
        entry("default", "bfloat16", 4.0, 4.0),
        entry("default", "float32", 2.0, 8.0, op="rda-exp"),
        entry("bt16", "float32", 1.0, 10.0),              # pairs with float32 rwa, not the latest
        entry("bt16", "bfloat16", 2.0, 1.0),
        entry("default", "float32", 4.0, 2.0),            # a second run re-measures the defaults
        entry("bt16", "float32", 1.0, 1.0),
        entry("bt16-w2", "float32", None),                # failed: no ratio
        entry("default", "bfloat16", None),               # defaults failed: none for bfloat16
        entry("bt16", "bfloat16", 1.0, 1.0),
    ]
    assert [(r["op"], r["dtype"], r["candidate"], r["fwd"], r["fwd_bwd"])
            for r in gpu_sweep.ratios(entries)] == [
        ("rwa", "float32", "bt16", 0.5, 1.25), ("rwa", "bfloat16", "bt16", 0.5, 0.25),
        ("rwa", "float32", "bt16", 0.25, 0.5)]


def test_the_committed_defaults_run_gives_the_docs_numbers():
    path = ROOT / "bench" / "results" / "gpu" / "defaults-nvidia-h100-80gb-hbm3.jsonl"
    entries = [json.loads(line) for line in path.read_text().splitlines()]
    got = {(tuple(r["shape"]), r["dtype"], r["op"], r["candidate"]): (r["fwd"], r["fwd_bwd"])
           for r in gpu_sweep.ratios(entries)}
    # docs/benchmarks.md, "launch defaults": three-phase at one 1M-step sequence with BT 16,
    # and looped rda_scan training with BT 16, BD 16, 2 warps.
    assert got[((1, 1048576, 256), "float32", "rda-exp", "bt16")] == (1.732, 1.548)
    assert got[((16, 4096, 1024), "float32", "rda-exp", "bt16-bd16-w2")] == (0.809, 0.772)


def test_defaults_without_cuda_measures_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_sweep.main(["--only", "defaults", "--out", str(tmp_path / "out")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
