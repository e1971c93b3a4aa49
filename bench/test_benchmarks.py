"""pytest-benchmark cases: ``pytest bench/ --benchmark-only`` (``--benchmark-disable`` runs each
once, as CI does, so they cannot rot). Timings are reported, never asserted; the ratios to
``copy_`` and to ``torch.nn.LSTM`` come from ``python -m bench.ops --device cpu``.
"""

import math

import pytest
import torch

import fastrwa
from bench.common import OPS, forward_backward_fn, forward_fn, inputs
from fastrwa.models import ByteLM, LMConfig

SHAPE = (4, 2048, 256)          # 8 MB per float32 tensor


def test_copy_baseline(benchmark):
    """copy_ of the bytes of one forward of rda_scan (z, a, g read; y written)."""
    src = torch.randn(2 * SHAPE[0] * SHAPE[1] * SHAPE[2])
    dst = torch.empty_like(src)
    benchmark(dst.copy_, src)
    assert torch.equal(dst, src)


@pytest.mark.parametrize("path", ["numba", "torch"])
@pytest.mark.parametrize("op", ["rwa", "rda-exp", "rda-sigmoid"])
def test_scan_forward(benchmark, path, op):
    z, a, g = inputs(OPS[op], *SHAPE, torch.float32)
    benchmark(forward_fn(OPS[op], z, a, g, path))


@pytest.mark.parametrize("path", ["numba", "torch"])
@pytest.mark.parametrize("op", ["rwa", "rda-exp"])
def test_scan_forward_backward(benchmark, path, op):
    z, a, g = inputs(OPS[op], *SHAPE, torch.float32)
    benchmark(forward_backward_fn(OPS[op], z, a, g, path))


@pytest.mark.parametrize("layer", ["RDA", "LSTM", "GRU"])
def test_rnn_layer_forward_backward(benchmark, layer):
    torch.manual_seed(0)
    B, T, H = 8, 256, 128
    model = fastrwa.nn.RDA(H, H) if layer == "RDA" else getattr(torch.nn, layer)(
        H, H, batch_first=True)
    x = torch.randn(B, T, H)

    def step():
        out = model(x)[0]
        out.backward(torch.ones_like(out))
    benchmark(step)


def test_lm_streaming_step(benchmark):
    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=256, n_layers=4)).eval()
    cache = model.allocate_cache(1)
    token = torch.tensor([65])
    with torch.no_grad():
        model.prefill(torch.randint(0, 256, (1, 16)), cache)
        logits = benchmark(model.step_, token, cache)
    assert logits.shape == (1, 257) and torch.isfinite(logits).all()


def test_long_context_carried_windows_read_as_one_pass():
    """bench/experiments/long_context.py: windows that carry the state score each byte as one
    forward pass over the stretch does; reset windows differ after the first window."""
    from bench.experiments import long_context

    torch.manual_seed(0)
    model = ByteLM(LMConfig(d_model=16, n_layers=1)).eval()
    data = torch.randint(0, 256, (2, 41))
    logits, _ = model(data[:, :-1])
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), data[:, 1:],
                                             reduction="none").mean(0) / math.log(2)
    carried = long_context.bits_per_position(model, data, 16, "carried")
    reset = long_context.bits_per_position(model, data, 16, "reset")
    torch.testing.assert_close(carried, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reset[:16], want[:16], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(reset[16:], want[16:], rtol=1e-3, atol=1e-3)
    assert long_context.buckets(300, 32) == [(0, 32), (32, 64), (64, 128), (128, 256),
                                             (256, 300)]


def test_papers_results_merge_across_invocations(tmp_path):
    """A new run replaces only the earlier run of the same task, model, seed, length,
    discount initialisation, layers and learning rate; runs saved by older versions (no
    length, timescales, quick, layers or lr fields) load with the record's values or the
    defaults."""
    from bench.experiments import papers
    path = tmp_path / "papers.json"
    path.write_text('{"seq_len": 1000, "quick": false, "results": ['
                    '{"task": "adding", "model": "rwa-scan", "seed": 0, "steps_run": 5},'
                    '{"task": "adding", "model": "rda-exp-tanh", "seed": 0, "steps_run": 6}]}')
    new = [{"task": "adding", "model": "rda-exp-tanh", "seed": 0, "timescales": None,
            "layers": 1, "steps_run": 7},
           {"task": "adding", "model": "rda-exp-tanh", "seed": 0, "timescales": (2, 2000),
            "steps_run": 8},
           {"task": "adding", "model": "rwa-scan", "seed": 0, "timescales": None, "layers": 2,
            "steps_run": 9}]
    out = papers.merged(path, new, 1000)
    assert sorted((r["model"], r["steps_run"]) for r in out) == [
        ("rda-exp-tanh", 7), ("rda-exp-tanh", 8), ("rwa-scan", 5), ("rwa-scan", 9)]
    assert papers.variant(out[-1]) == "paper, 2 layers"
    assert all(r["lr"] == 1e-3 for r in out)                # the paper's, where unsaved
    faster = [dict(new[0], lr=3e-3, steps_run=10)]
    both = papers.merged(path, faster, 1000)                # another learning rate adds a run
    assert len(both) == 3 and papers.variant(both[-1]) == "paper, lr 0.003"
    assert all(r["seq_len"] == 1000 for r in out)
    assert [r["quick"] for r in out if r["steps_run"] == 5] == [False]
    assert len(papers.merged(path, new, 20)) == 5          # another length replaces nothing


def test_papers_join_adds_runs_saved_elsewhere(tmp_path, monkeypatch, capsys):
    """``--join`` trains nothing: it adds another machine's runs (their device kept and shown)
    to OUT/papers.json beside the runs already there (of two alike, the last), and refuses
    --quick check runs bound for bench/results/papers and training options."""
    import json

    from bench import cli
    from bench.experiments import papers
    monkeypatch.setattr(cli, "ROOT", tmp_path)         # a refusal that fails writes here
    run = {"task": "adding", "model": "rwa-scan", "seed": 0, "timescales": None, "layers": 1,
           "lr": 1e-3, "device": "cuda", "steps_to_threshold": 5, "steps_run": 5,
           "seconds": 1.0, "curve": [[5, 0.0005]], "seq_len": 1000}
    gpu = tmp_path / "gpu.json"          # (an older layout: the length kept for the file)
    gpu.write_text(json.dumps({"argv": ["--device", "cuda"], "quick": False, "seq_len": 500,
                               "results": [{k: v for k, v in run.items() if k != "seq_len"}]}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "papers.json").write_text(json.dumps({"results": [
        dict(run, model="rda-exp-tanh", device="cpu", steps_to_threshold=None),
        dict(run, device="cpu", seq_len=500, steps_to_threshold=None)]}))
    again = tmp_path / "again.json"
    again.write_text(json.dumps({"results": [dict(run, seq_len=500, seconds=2.0)]}))
    assert papers.main(["--join", str(again), str(gpu), f"--out={out}"]) == 0
    assert "replacing the earlier run of adding rwa-scan seed 0" in capsys.readouterr().err
    saved = json.loads((out / "papers.json").read_text())["results"]
    assert sorted((r["model"], r["device"], r["steps_to_threshold"], r["seq_len"])
                  for r in saved) == [("rda-exp-tanh", "cpu", None, 1000),
                                      ("rwa-scan", "cuda", 5, 500)]
    joined = next(r for r in saved if r["model"] == "rwa-scan")
    assert joined["argv"] == ["--device", "cuda"] and joined["quick"] is False
    assert joined["seconds"] == 1.0                  # gpu.json's, joined after again.json's
    assert papers.variant(joined) == "paper, cuda" and (out / "adding.png").is_file()
    quick = tmp_path / "quick.json"
    quick.write_text(json.dumps({"quick": True, "results": [run]}))
    broken = tmp_path / "broken.json"
    broken.write_text('{"results": [')
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"results": [{k: v for k, v in run.items() if k != "curve"}]}))
    for flags, message in (([str(quick), "--record"], "holds --quick check runs"),  # the record
                           ([str(tmp_path / "missing.json"), f"--out={out}"], "no such file"),
                           ([str(broken), f"--out={out}"], "is not JSON"),
                           ([str(partial), f"--out={out}"], "a run without curve"),
                           ([str(gpu), f"--out={out}", "--seeds", "1"], "drop --seeds")):
        with pytest.raises(SystemExit):
            papers.main(["--join", *flags])
        assert message in capsys.readouterr().err
    assert not (tmp_path / "bench").exists()


@pytest.mark.parametrize("flags,message", [
    (["--time-limit", "-1"], "argument --time-limit: must be a finite number above 0"),
    (["--time-limit", "nan"], "argument --time-limit: must be a finite number above 0"),
    (["--max-steps", "-3"], "argument --max-steps: must be an integer >= 1"),
    (["--seeds", "-1"], "argument --seeds: must be an integer >= 0"),
    (["--seq-len", "1"], "--seq-len must be an int >= 2"),
    (["--seq-len", "0"], "--seq-len must be an int >= 2"),
    (["--discount-timescales", "5", "2"], "longest (2.0) must be >= shortest"),
    (["--discount-timescales", "0", "inf"], "shortest must be a finite number > 1"),
    (["--out", "FILE"], "is a file, not a folder"),
    (["--out", "/proc/x"], "cannot create the folder"),
    (["--out", "RECORD"], "add --record to write there"),
    (["--record", "--out", "ELSEWHERE"], "--record writes under bench/results/"),
    (["--record", "--quick"], "--record takes full-size runs only"),
])
def test_papers_refuses_impossible_values_before_anything_runs(tmp_path, monkeypatch, capsys,
                                                               flags, message):
    """Every impossible value is one error: line before any training, and nothing is
    written; the committed record takes runs only with --record (a run of --time-limit -1
    once replaced a measured run there with one of no steps)."""
    from bench import cli
    from bench.experiments import papers
    monkeypatch.setattr(cli, "ROOT", tmp_path)
    (tmp_path / "FILE").write_text("")
    record = tmp_path / "bench" / "results" / "papers"
    names = {"FILE": str(tmp_path / "FILE"), "RECORD": str(record),
             "ELSEWHERE": str(tmp_path / "elsewhere")}
    monkeypatch.setattr(papers, "run", lambda *a, **k: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as exit_:
        papers.main(["--tasks", "adding", *[names.get(f, f) for f in flags]])
    assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bench").exists() and not (tmp_path / "bench-results").exists()


@pytest.mark.parametrize("flags", [["--quick"], ["--seq-len", "50", "--time-limit", "1"],
                                   ["--discount-timescales", "2", "2000", "--layers", "2"]])
def test_papers_valid_flags_reach_the_runs(tmp_path, monkeypatch, flags):
    """The refusals above refuse nothing valid: these calls reach the first run."""
    from bench.experiments import papers

    class Reached(Exception):
        pass

    def run(*args, **kwargs):
        raise Reached
    monkeypatch.setattr(papers, "run", run)
    with pytest.raises(Reached):
        papers.main(["--tasks", "adding", "--out", str(tmp_path / "out"), *flags])


def test_papers_a_run_that_measured_nothing_replaces_no_record(tmp_path, capsys):
    import json
    from bench.experiments import papers
    path = tmp_path / "papers.json"
    run = {"task": "adding", "model": "rwa-scan", "seed": 0, "steps_to_threshold": 800,
           "steps_run": 1490, "curve": [[10, 0.1]], "seq_len": 1000}
    path.write_text(json.dumps({"results": [run]}))
    empty = dict(run, steps_to_threshold=None, steps_run=0, curve=[])
    out = papers.merged(path, [empty], 1000)
    assert [r["steps_run"] for r in out] == [1490]
    assert "the new one measured nothing" in capsys.readouterr().err
    fresh = dict(empty, seed=1)                       # nothing to keep: it is recorded
    assert [r["steps_run"] for r in papers.merged(path, [fresh], 1000)] == [1490, 0]


def test_long_context_refuses_empty_windows(tmp_path):
    from bench.experiments import long_context
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"abc " * 100)
    for flags in (["--window", "0"], ["--length", "16", "--window", "32"], ["--docs", "-1"]):
        with pytest.raises(SystemExit):
            long_context.main(["--data", str(corpus), "--quick", *flags])


def test_papers_accuracy_exactly_at_the_threshold_is_not_above_it():
    """Multicopy's rule is accuracy > 0.99: 99 right of 100 must not pass (a float32 mean of
    0.99 is 0.9900000095 and did)."""
    import types
    from bench.experiments import papers
    target = torch.arange(100) % 8
    logits = torch.nn.functional.one_hot(target, 9).float()
    logits[0] = torch.nn.functional.one_hot((target[0] + 1) % 8, 9).float()    # one wrong
    batch = types.SimpleNamespace(x=logits[None], target=target[None],
                                  mask=torch.ones(1, 100, dtype=torch.bool))
    net = lambda x: (x, None)                                                  # noqa: E731
    value = papers.evaluate(net, types.SimpleNamespace(name="multicopy"), batch)
    assert value == 0.99 and not papers.met("multicopy", value)


def test_ablate_rows_can_each_be_chosen_with_only(tmp_path, capsys, monkeypatch):
    """``--only`` takes comma-separated names: no row's name may hold a comma (one did, and
    could not be run alone), an unknown name is refused with the known ones listed, and a
    subset is refused where it would replace the committed study's ablate.json."""
    from bench.experiments import ablate
    from bench import cli
    monkeypatch.setattr(cli, "ROOT", tmp_path)   # a refusal that fails trains in here
    study = cli.results_dir("ablate")
    assert all("," not in name for name in ablate.ROWS)
    out = tmp_path / "a"
    with pytest.raises(SystemExit):
        ablate.main(["--only", "base,no such row", "--data", __file__, "--out", str(out)])
    assert "no such row" in capsys.readouterr().err and not out.exists()
    with pytest.raises(SystemExit):
        ablate.main(["--only", "base", "--data", __file__, "--steps", "1", "--record"])
    assert "--out" in capsys.readouterr().err and not study.exists()


def test_lm_baselines_alone_are_matched_to_bytelm():
    """``bench/experiments/lm.py --models lstm,gru`` (no fastrwa model) matches the baselines
    to ByteLM's parameter count at --d-model x --layers, as a run with ByteLM would (it
    matched them to an LSTM of that shape, half ByteLM's count)."""
    from bench.experiments import lm
    bytelm = lm.params("rda-scan", 64, 2, {})
    assert lm.target_params(["lstm", "gru"], 64, 2, {}) == bytelm
    assert lm.target_params(["transformer", "rda-scan"], 64, 2, {}) == bytelm
    assert lm.target_params(["rwa-scan", "lstm"], 64, 2, {}) == lm.params("rwa-scan", 64, 2, {})


@pytest.mark.parametrize("flags,message", [
    (["--models", "bogus"], "argument --models: must be comma-separated names of"),
    (["--models", ""], "argument --models: must be comma-separated names of"),
    (["--models", "lstm,lstm"], "each once, got 'lstm,lstm'"),
    (["--lm", "bogus=1"], "--lm: LMConfig.__init__() got an unexpected keyword argument 'bogus'"),
    (["--lm", "nonsense"], "expected KEY=VALUE"),
    (["--baseline-layers", "0"], "argument --baseline-layers: must be an integer >= 1"),
    (["--minutes", "-1"], "argument --minutes: must be a finite number above 0"),
    (["--minutes", "0"], "argument --minutes: must be a finite number above 0"),
    (["--lr", "-1"], "argument --lr: must be a finite number above 0"),
    (["--lr", "1e40"], "--lr must be a finite number above 0 and at most"),
    (["--seed", "-1"], "argument --seed: must be an integer >= 0"),
    (["--seed", "4294967296"], "--seed must be an integer from 0"),
    (["--out", "FILE"], "is a file, not a folder"),
])
def test_lm_refuses_bad_flags_before_any_run(tmp_path, monkeypatch, capsys, flags, message):
    """bench/experiments/lm.py: every flag a run would fail on is one error: line, exit 2,
    before any training (these were tracebacks, or a calibration of every model first)."""
    from bench.experiments import lm
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"abc " * 1000)
    (tmp_path / "FILE").write_text("")
    monkeypatch.setattr(lm, "run", lambda *a, **k: pytest.fail("a run started"))
    flags = [str(tmp_path / "FILE") if f == "FILE" else f for f in flags]
    with pytest.raises(SystemExit) as exit_:
        lm.main(["--data", str(corpus), "--out", str(tmp_path / "out"), *flags])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_lm_table_of_a_missing_or_foreign_file_is_one_error(tmp_path, capsys):
    from bench.experiments import lm
    bad = tmp_path / "bad.json"
    bad.write_text('{"runs": [{"model": "x"}]}')
    with pytest.raises(SystemExit) as exit_:
        lm.main(["--table", str(bad)])
    assert exit_.value.code == 2
    assert "is not an lm.json of bench/experiments/lm.py" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        lm.main(["--table", str(tmp_path / "nope.json")])
    assert exit_.value.code == 2 and "--table" in capsys.readouterr().err


def test_lm_a_failed_training_run_is_one_error(tmp_path, capsys):
    """A run the trainer refuses ends bench/experiments/lm.py with one error: line (status 1), not a
    CalledProcessError traceback."""
    from bench.experiments import lm
    with pytest.raises(lm.RunFailed, match="the x run failed"):
        lm.run("x", ["--task", "text", "--data", str(tmp_path / "none.txt")], tmp_path)


def test_cpu_fair_reports_every_cell_with_a_positive_ratio(tmp_path, capsys):
    """bench/cpu_fair.py runs end to end at a tiny shape and writes what it prints."""
    import json

    from bench import cpu_fair

    assert cpu_fair.main(["--shape", "2,64,8", "--rounds", "1", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu_fair.json").read_text())
    assert sorted(result["cells"]) == ["rda forward", "rda forward+backward", "rwa forward",
                                       "rwa forward+backward"]
    assert all(c["ratio"] > 0 and c["op_ms"] > 0 and c["reference_kept_ms"] > 0
               for c in result["cells"].values())
    assert "rda forward+backward" in capsys.readouterr().out


def test_cpu_cycles_reports_every_call_at_both_sizes(tmp_path, capsys):
    """bench/cpu_cycles.py runs end to end at tiny shapes, writes what it prints and leaves
    the thread count as it found it."""
    import json

    from bench import cpu_cycles

    threads = torch.get_num_threads()
    assert cpu_cycles.main(["--sizes", "1,16,8;2,32,8", "--rounds", "1",
                            "--out", str(tmp_path)]) == 0
    assert torch.get_num_threads() == threads
    result = json.loads((tmp_path / "cpu_cycles.json").read_text())["ns_per_element"]
    assert list(result) == ["in cache", "out of cache"]
    for cells in result.values():
        assert sorted(cells) == sorted(["shape", "rwa", "weighted (log decay)", "rda exp",
                                        "rda sigmoid", "torch.addcmul"])
        assert all(v > 0 for k, v in cells.items() if k != "shape")
    assert "rda sigmoid" in capsys.readouterr().out
