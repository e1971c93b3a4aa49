"""fastrwa.export's ONNX files run by onnxruntime: the logits and states of PyTorch, token
for token; greedy bytes as ``ByteLM.generate``; dynamic batch and prompt length; the CLI;
the int8 and float16 weights; a user's own module of scan layers; what is refused; and
the streaming loop of docs/onnx.md, run as it is written there (NumPy and onnxruntime only)."""

import json
import pathlib
import re
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

import onnx  # noqa: E402

from fastrwa.export import (LayerStep, OnnxLM, bytelm_onnx, export_layer_step,  # noqa: E402
                            export_onnx, exportable_steps, flat_state)
from fastrwa.export.__main__ import main  # noqa: E402
from fastrwa.models import ByteLM, LMConfig, build, save_pretrained  # noqa: E402
from fastrwa.nn import RDA, RWA, LayerState, RWACell  # noqa: E402
from fastrwa.state import ScanState  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]


def session(model) -> "ort.InferenceSession":
    """A one-thread CPU session (onnxruntime's default spins a thread per core: slow on a
    shared machine) of a model, a path or serialized bytes."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    model = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
LOGITS_TOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """PyTorch on one thread: its tiny steps' element-wise operations (GELU) otherwise
    wait milliseconds for a second thread on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(seed: int = 0, **fields) -> ByteLM:
    """A small ByteLM whose parameters are spread out (a fresh model's zero biases and
    small logits would leave most of the recurrence's paths untried)."""
    torch.manual_seed(seed)
    model = ByteLM(LMConfig(**{"d_model": 32, "n_layers": 2, **fields})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "initial_logit" in name and not model.config.learn_initial_state:
                continue                                   # (-inf: an empty prior)
            p.add_(0.2 * torch.randn_like(p))
    return model


def state_close(got, want, where: str) -> None:
    """Each state tensor within 1e-5 of PyTorch's, relative to its largest value (the
    scaled numerator ``n`` sums terms of both signs: its rounding error is that of its
    largest terms, whatever the sum); ``m`` is ``-inf`` in the same places (an empty
    state)."""
    for name, a, b in zip(NAMES[0], got, flat_state(want)):
        b = b.numpy()
        finite = np.isfinite(b)
        np.testing.assert_array_equal(a[~finite], b[~finite], err_msg=f"{name} {where}")
        scale = max(1.0, float(np.abs(b[finite]).max(initial=0.0)))
        np.testing.assert_allclose(a[finite], b[finite], rtol=0, atol=1e-5 * scale,
                                   err_msg=f"{name} {where}")


NAMES = [[]]


def run_stream(model: ByteLM, lm: OnnxLM, ids: torch.Tensor, prompt_length: int) -> float:
    """Prompt ``ids[:, :prompt_length]``, then step through the rest, comparing logits and
    states with PyTorch's forward and step after the prompt and every step; returns the
    largest logit difference."""
    NAMES[0] = lm.state_names
    with torch.no_grad():
        want, state = model(ids[:, :prompt_length])
        logits, got = lm.prompt(ids[:, :prompt_length].numpy())
        worst = float(np.abs(logits - want[:, -1].numpy()).max())
        state_close(got, state, "after the prompt")
        for t in range(prompt_length, ids.shape[1]):
            want, state = model.step(ids[:, t], state)
            logits, got = lm.step(ids[:, t].numpy(), got)
            worst = max(worst, float(np.abs(logits - want.numpy()).max()))
            state_close(got, state, f"after step {t}")
    return worst


@pytest.fixture(scope="module")
def rda(tmp_path_factory):
    model = tiny()
    return model, OnnxLM(export_onnx(model, tmp_path_factory.mktemp("rda")), threads=1)


def test_a_1000_byte_stream_matches_pytorch(rda):
    model, lm = rda
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 1000))
    assert run_stream(model, lm, ids, 100) <= LOGITS_TOL
    with torch.no_grad():                      # (and all 1,000 bytes as one prompt)
        want, state = model(ids)
    logits, got = lm.prompt(ids.numpy())
    np.testing.assert_allclose(logits, want[:, -1].numpy(), rtol=0, atol=LOGITS_TOL)
    NAMES[0] = lm.state_names
    state_close(got, state, "after a 1,000-byte prompt")


CONFIGS = {
    "rwa": dict(layer="rwa"),
    "rwa-plain": dict(layer="rwa", token_shift=False, output_gate=False,
                      learn_initial_state=False),
    "rda-relu-groups": dict(attention="relu", f_h="tanh", f_o="sigmoid", discount_groups=4,
                            token_shift=False, learn_initial_state=False, output_gate=False),
    "rda-softplus-spread": dict(attention="softplus", f_o="relu", discount_init="spread"),
    "rda-exp-tanh": dict(preset="exp-tanh", tie_embeddings=False),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_every_configuration_matches_at_any_batch_and_prompt_length(name, tmp_path):
    model = tiny(3, **CONFIGS[name])
    lm = OnnxLM(export_onnx(model, tmp_path), threads=1)
    torch.manual_seed(2)
    for batch, prompt_length in ((1, 1), (3, 50)):
        ids = torch.randint(0, 257, (batch, prompt_length + 12))
        assert run_stream(model, lm, ids, prompt_length) <= LOGITS_TOL


def test_greedy_bytes_are_generates(rda):
    model, lm = rda
    prompt = torch.tensor([list(b"The quick brown fox "), list(b"jumps over the lazy dog")[:20]])
    for weights in ("eager", "auto"):                  # (PyTorch's step, the fused decode)
        want = model.generate(prompt, 100, top_k=1, weights=weights)
        np.testing.assert_array_equal(lm.generate(prompt.numpy(), 100), want.numpy())
    empty = torch.zeros(2, 0, dtype=torch.long)       # (from the BOS id)
    np.testing.assert_array_equal(lm.generate(empty.numpy(), 30),
                                  model.generate(empty, 30, top_k=1).numpy())


def test_only_standard_operators_and_the_documented_names(rda, tmp_path):
    model, _ = rda
    for weights in ("float32", "int8", "float16"):
        prompt, step, config = bytelm_onnx(model, weights)
        for m in (prompt, step):
            graphs = [m.graph] + [a.g for n in m.graph.node for a in n.attribute if a.g.node]
            assert {n.domain for g in graphs for n in g.node} == {""}, weights
            assert [(o.domain, o.version) for o in m.opset_import] == [("", 17)]
        names = [f"state.{i}.{f}" for i in range(2) for f in ("m", "n", "d", "last")]
        assert [i.name for i in step.graph.input] == ["ids", *names]
        assert [i.name for i in prompt.graph.input] == ["ids"]
        outputs = ["logits", *(n.replace("state", "next_state") for n in names)]
        assert [o.name for o in step.graph.output] == outputs
        assert [o.name for o in prompt.graph.output] == outputs
        assert config["state"] == names and config["bos_token"] == 256


def test_int8_and_float16_weights_stay_close(rda, tmp_path):
    model, _ = rda
    torch.manual_seed(4)
    ids = torch.randint(0, 256, (2, 40))
    with torch.no_grad():
        want, _ = model(ids)
    sizes = {}
    for weights, tol in (("float16", 0.05), ("int8", 1.0)):
        directory = export_onnx(model, tmp_path / weights, weights=weights)
        sizes[weights] = (directory / "step.onnx").stat().st_size
        lm = OnnxLM(directory, threads=1)
        logits, state = lm.prompt(ids[:, :20].numpy())
        for t in range(20, 40):
            assert np.abs(logits - want[:, t - 1].numpy()).max() < tol, weights
            logits, state = lm.step(ids[:, t].numpy(), state)
    float32 = len(bytelm_onnx(model)[1].SerializeToString())
    assert sizes["float16"] < 0.6 * float32 and sizes["int8"] < 0.45 * float32


def test_the_cli_exports_a_run_and_evaluates(tmp_path, capsys):
    model = tiny(5)
    save_pretrained(model, tmp_path / "run" / "model")
    text = tmp_path / "text.txt"
    text.write_bytes(bytes(range(32, 127)) * 4)
    out = tmp_path / "onnx"
    assert main(["onnx", str(tmp_path / "run"), str(out), "--eval", str(text),
                 "--eval-bytes", "200"]) == 0
    err = capsys.readouterr()
    assert sorted(p.name for p in out.iterdir()) == ["onnx_config.json", "prompt.onnx",
                                                     "step.onnx"]
    bpc = re.search(r"onnxruntime \(float32\) ([\d.]+), PyTorch ([\d.]+), change", err.out)
    assert bpc and abs(float(bpc[1]) - float(bpc[2])) < 1e-4, err
    assert json.loads((out / "onnx_config.json").read_text())["model"]["d_model"] == 32
    # an earlier export is replaced with --overwrite only; other files never
    assert main(["onnx", str(tmp_path / "run"), str(out)]) == 2
    assert "pass --overwrite (overwrite=True)" in capsys.readouterr().err
    assert main(["onnx", str(tmp_path / "run"), str(out), "--overwrite",
                 "--weights", "float16"]) == 0
    assert json.loads((out / "onnx_config.json").read_text())["weights"] == "float16"
    assert main(["onnx", str(tmp_path / "run"), str(tmp_path / "run"), "--overwrite"]) == 2
    assert "is not a fastrwa ONNX export (it holds model)" in capsys.readouterr().err
    assert main(["onnx", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2
    assert "no model there" in capsys.readouterr().err


def test_what_is_refused_is_named(tmp_path):
    baseline = build(LMConfig(d_model=16, n_layers=1, layer="lstm"))
    with pytest.raises(TypeError, match="baselines are not exported"):
        bytelm_onnx(baseline)
    save_pretrained(baseline, tmp_path / "lstm")
    with pytest.raises(ValueError, match="'lstm' baseline"):
        export_onnx(tmp_path / "lstm", tmp_path / "out")
    with pytest.raises(ValueError, match="bidirectional=True"):
        export_layer_step(RDA(4, 8, bidirectional=True), tmp_path / "x.onnx")
    with pytest.raises(TypeError, match="RWACell: the faithful cells are not exported"):
        LayerStep(RWACell(4, 8))
    with pytest.raises(ValueError, match="weights must be one of"):
        bytelm_onnx(tiny(), weights="int4")
    with pytest.raises(ValueError, match="exporter must be one of"):
        bytelm_onnx(tiny(), exporter="jit")
    user = torch.nn.Sequential(RDA(4, 8), RDA(8, 8, bidirectional=True))
    with pytest.raises(ValueError, match="the layer '1' has bidirectional=True"):
        with exportable_steps(user):
            pass
    assert "step" not in user[0].__dict__             # (nothing was changed)


def test_the_cli_checks_eval_before_writing_anything(tmp_path, capsys):
    save_pretrained(tiny(5, d_model=16, n_layers=1), tmp_path / "run" / "model")
    short = tmp_path / "short.txt"
    short.write_bytes(b"hello")
    out = tmp_path / "onnx"
    for args, message in (
            (["--eval", str(short), "--eval-bytes", "3"],
             "error: argument --eval-bytes: must be at least 16 (8 rows of 2 bytes), got 3"),
            (["--eval-bytes", "3"], "error: argument --eval-bytes: must be at least 16"),
            (["--eval", str(short)],
             f"error: argument --eval: {short} has 5 bytes, too few to evaluate on"),
            (["--eval", str(tmp_path / "missing.txt")],
             "error: argument --eval: cannot read"),
            (["--eval", str(tmp_path)], "error: argument --eval: cannot read")):
        assert main(["onnx", str(tmp_path / "run"), str(out), *args]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, (args, err)
        assert not out.exists(), args                   # (nothing written)


def test_onnxlm_refuses_what_the_raw_graphs_do_not_check(tmp_path):
    model = tiny(8, token_shift=False)          # (no Concat: a short state would broadcast)
    lm = OnnxLM(export_onnx(model, tmp_path), threads=1)
    with pytest.raises(ValueError, match=r"ids has no positions .*BOS id, \[\[256\]\]"):
        lm.prompt(np.zeros((2, 0), np.int64))     # (prompt.onnx itself: SIGFPE, not run)
    for bad in (-1, 257):
        with pytest.raises(ValueError, match=rf"ids must be in \[0, 257\) .*got {bad}"):
            lm.prompt(np.array([[65, bad]]))
        with pytest.raises(ValueError, match=rf"ids must be in \[0, 257\) .*got {bad}"):
            lm.step(np.array([bad, 65]), lm.prompt(np.array([[65], [66]]))[1])
    with pytest.raises(ValueError, match=r"ids must be \(batch, length\) integers"):
        lm.prompt(np.array([65, 66]))
    with pytest.raises(ValueError, match=r"ids must be \(batch,\) integers"):
        lm.step(np.array([[65]]), lm.prompt(np.array([[65]]))[1])
    _, state = lm.prompt(np.array([[65], [66]]))
    with pytest.raises(ValueError, match=r"state input state\.0\.m .* got \(1, 32\)"):
        lm.step(np.array([1, 2]), [t[:1] for t in state])     # (step.onnx: broadcast)
    with pytest.raises(ValueError, match=r"state input state\.0\.m must have shape \(batch, "
                                         r"32\) = \(3, 32\) for ids of batch 3, got \(2, 32\)"):
        lm.step(np.array([1, 2, 3]), state)
    with pytest.raises(ValueError, match=r"state input state\.1\.d .* got \(2, 31\)"):
        lm.step(np.array([1, 2]), [*state[:-1], state[-1][:, 1:]])
    with pytest.raises(ValueError, match=r"state must be 6 arrays \(state\.0\.m, "):
        lm.step(np.array([1, 2]), state[:3])
    # the raw graphs: a negative id is out of range for their Gather (an error), as 257 is;
    # not read from the end (the BOS row) as ONNX Gather reads negative indices
    for bad in (-1, 257):
        with pytest.raises(Exception, match="out of data bounds"):
            lm.step_session.run(None, {"ids": np.array([bad, 65]),
                                       **dict(zip(lm.state_names, state))})
        with pytest.raises(Exception, match="out of data bounds"):
            lm.prompt_session.run(None, {"ids": np.array([[65, bad]])})


class Stepper(torch.nn.Module):
    """A user's module that steps one scan layer (and nothing else)."""

    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x, m, n, d, last):
        y, state = self.layer.step(x, LayerState(ScanState(m, n, d), last))
        return (y, *state.scan, state.last_input)


def test_a_bfloat16_layer_steps_and_exports_in_float32(tmp_path):
    torch.manual_seed(9)
    layer = RDA(6, 8, token_shift=True, attention="softplus").eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.2 * torch.randn_like(p))
    half = Stepper(layer).to(torch.bfloat16)
    wide = Stepper(RDA(6, 8, token_shift=True, attention="softplus")).eval()
    wide.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    x = torch.randn(3, 6).to(torch.bfloat16)
    with torch.no_grad():
        initial = half.layer.initial_state(3)
    args = (x, *initial.scan, initial.last_input)
    # exportable_steps: computed in float32 as LayerStep is (the same numbers as a float32
    # copy of the layer), returned in the dtypes of the layer's own step
    with torch.no_grad(), exportable_steps(half):
        got = half(*args)
        want = wide(x.float(), *(t.float() for t in args[1:]))
    assert [t.dtype for t in got] == [torch.bfloat16, *[torch.float32] * 3, torch.bfloat16]
    for a, b in zip(got, want):                     # (bfloat16: to its rounding)
        rtol = 2 ** -8 if a.dtype == torch.bfloat16 else 1e-5
        np.testing.assert_allclose(a.float().numpy(), b.numpy(), rtol=rtol, atol=1e-5)
    # the layer's step file: float32 inputs, float32 arithmetic from the bfloat16 weights
    names = ["x", "m", "n", "d", "last"]
    with exportable_steps(half), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(half, args, tmp_path / "half.onnx", dynamo=False, input_names=names,
                          dynamic_axes={k: {0: "batch"} for k in names})
    onnx.checker.check_model(onnx.load(tmp_path / "half.onnx"))
    step = session(export_layer_step(half.layer, tmp_path / "step.onnx"))
    assert {i.type for i in step.get_inputs()} == {"tensor(float)"}
    out = step.run(None, dict(zip([i.name for i in step.get_inputs()],
                                  [t.float().numpy() for t in args])))
    for a, b in zip(out, want):
        np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", [RWA(6, 8, token_shift=True),
                                   RDA(6, 8, attention="sigmoid", f_h="tanh",
                                       discount_groups=2, learn_initial_state=False)],
                         ids=["rwa", "rda"])
def test_a_layers_step_exports(layer, tmp_path):
    torch.manual_seed(6)
    step = session(export_layer_step(layer, tmp_path / "step.onnx"))
    names = [i.name for i in step.get_inputs()]
    assert names[:4] == ["x", "state.m", "state.n", "state.d"]
    for batch in (1, 3):
        state = layer.initial_state(batch)
        got = [t.numpy() for t in flat_state(state)]
        with torch.no_grad():
            for _ in range(10):
                x = torch.randn(batch, 6)
                y, state = layer.step(x, state)
                out = step.run(None, dict(zip(names, [x.numpy(), *got])))
                np.testing.assert_allclose(out[0], y.numpy(), rtol=1e-5, atol=1e-5)
                got = out[1:]
                for a, b in zip(got, flat_state(state)):
                    np.testing.assert_allclose(a, b.numpy(), rtol=1e-5, atol=1e-5)


class UserModel(torch.nn.Module):
    """A user's own streaming module: a projection, an RDA layer's step, a head."""

    def __init__(self):
        super().__init__()
        self.inp, self.rda, self.out = torch.nn.Linear(3, 8), RDA(8, 8, token_shift=True), \
            torch.nn.Linear(8, 2)

    def forward(self, x, m, n, d, last):
        h, state = self.rda.step(torch.relu(self.inp(x)), LayerState(ScanState(m, n, d), last))
        return (self.out(h), *state.scan, state.last_input)


def test_a_users_own_module_exports_inside_exportable_steps(tmp_path):
    torch.manual_seed(7)
    user = UserModel().eval()
    initial = user.rda.initial_state(2)
    args = (torch.randn(2, 3), *flat_state(initial))
    names = ["x", "m", "n", "d", "last"]
    with exportable_steps(user), warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # (the TorchScript exporter's)
        torch.onnx.export(user, args, tmp_path / "user.onnx", dynamo=False, input_names=names,
                          dynamic_axes={k: {0: "batch"} for k in names})
    assert "step" not in user.rda.__dict__          # (the layer's own step, back)
    exported = session(tmp_path / "user.onnx")
    state = user.rda.initial_state(4)
    got = [t.numpy() for t in flat_state(state)]
    with torch.no_grad():
        for _ in range(5):
            x = torch.randn(4, 3)
            want = user(x, *state.scan, state.last_input)
            state = LayerState(ScanState(*want[1:4]), want[4])
            out = exported.run(None, dict(zip(names, [x.numpy(), *got])))
            np.testing.assert_allclose(out[0], want[0].numpy(), rtol=1e-5, atol=1e-5)
            got = out[1:]


def test_the_dynamo_exporter_gives_the_same_model(rda):
    pytest.importorskip("onnxscript")
    model, lm = rda
    prompt, step, _ = bytelm_onnx(model, exporter="dynamo")
    ids = np.array([list(b"hello"), list(b"world")], dtype=np.int64)
    want = lm.prompt(ids)
    got = session(prompt).run(None, {"ids": ids})
    for a, b in zip(got, [want[0], *want[1]]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def doc_loop() -> str:
    """The streaming loop of docs/onnx.md: the python block after its marker."""
    text = (ROOT / "docs" / "onnx.md").read_text()
    after = text.split("<!-- the streaming loop: tests/export/test_onnx.py runs it -->", 1)[1]
    return re.search(r"```python\n(.*?)```", after, re.S)[1]


def test_the_docs_streaming_loop_runs_without_torch(rda, tmp_path):
    model, _ = rda
    code = doc_loop()
    assert len(code.strip().splitlines()) <= 20
    export_onnx(model, tmp_path / "onnx-model")
    # (torch made unimportable: the loop needs NumPy and onnxruntime only)
    run = subprocess.run([sys.executable, "-c",
                          "import sys; sys.modules['torch'] = None; exec(sys.stdin.read())"],
                         input=code, capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 0, run.stderr
    prompt = torch.tensor([list(b"The quick brown fox")])
    want = bytes(model.generate(prompt, 200, top_k=1)[0].tolist()).decode(errors="replace")
    assert run.stdout == want + "\n"
