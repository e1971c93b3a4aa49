"""Every command line takes the options the CLIs share from :mod:`fastrwa.options`: each
shared flag is there with the help written once in ``fastrwa.options.HELP`` (five CLIs
wrote them each their own way, and generate's ``--weights auto`` said the eager step on
CUDA where ``ByteLM.decoder`` replays a CUDA graph)."""

import contextlib
import io
import pathlib
import re

import pytest

from fastrwa.options import HELP, MODEL_DIR

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECODING = {MODEL_DIR, "--best", "--device", "--weights", "--threads"}
SAMPLING = {"--temperature", "--top-k", "--top-p", "--seed"}
EXPORTING = {MODEL_DIR, "--best", "--overwrite"}
# The shared options each command takes.
SHARED = {
    "generate": DECODING | SAMPLING,
    "serve": DECODING,
    "export onnx": EXPORTING,
    "hf.export": EXPORTING,
    "train": {"--device", "--overwrite"},
}
# Flags of a shared name that mean another thing in a command, and why (their help is the
# command's own).
OWN = {
    "export onnx": {"--weights": "how the ONNX files store the matrices (float16, int8)"},
    "train": {"--seed": "the run's seed (initialisation, data order), not a sampler's",
              "--threads": "auto, the cores other programs leave free, per process"},
}


def _help(command: str, monkeypatch) -> str:
    """The ``--help`` text of ``command``, each option's help on one line."""
    monkeypatch.setenv("COLUMNS", "10000")          # (argparse wraps to the terminal's width)
    if command == "generate":
        from fastrwa.generate import parser
    elif command == "serve":
        from fastrwa.serve.cli import parser
    elif command == "export onnx":
        from fastrwa.export.__main__ import parser
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            parser().parse_args(["onnx", "--help"])
        return out.getvalue()
    elif command == "hf.export":
        pytest.importorskip("transformers")
        from fastrwa.hf.export import parser
    else:
        from fastrwa.train.cli import parser
    return parser().format_help()


def _pattern(text: str) -> str:
    """A help text with ``{fields}`` (--overwrite's) as a regular expression."""
    return "".join(".+" if re.fullmatch(r"\{\w+\}", part) else re.escape(part)
                   for part in re.split(r"(\{\w+\})", text))


@pytest.mark.parametrize("command", sorted(SHARED))
def test_every_cli_takes_the_shared_options_with_their_one_help(command, monkeypatch):
    # each option's entry: "  --flag [METAVAR]   its help", the help on the next line, more
    # indented, where the flag and its metavar are long
    entries = re.split(r"\n(?=  \S)|\n\n", _help(command, monkeypatch))
    for flag in sorted(SHARED[command]):
        entry = [e for e in entries if re.match(rf"  {re.escape(flag)}\b", e)]
        assert entry, f"{command} does not take {flag}"
        text = " ".join(entry[0].split())
        assert re.search(rf"\s{_pattern(HELP[flag])}$", text), (command, flag, text)


def test_the_shared_options_are_added_in_one_place():
    """No module but fastrwa/options.py adds a shared flag (the commands' own meanings in
    :data:`OWN` aside): the help cannot drift again."""
    own = {flag for flags in OWN.values() for flag in flags}
    adds = re.compile(r"""\badd(?:_argument)?\(\s*["'](--[\w-]+)["']""")
    for path in sorted((ROOT / "fastrwa").rglob("*.py")):
        if path.name == "options.py" and path.parent.name == "fastrwa":
            continue
        for flag in adds.findall(path.read_text()):
            assert flag not in HELP or flag in own, f"{path.relative_to(ROOT)} adds {flag}"


def test_weights_auto_says_what_the_decoder_does():
    """``--weights auto``: the fused float32 step on CPU (what ``ByteLM.decoder`` picks
    here), the CUDA graph on CUDA (not the eager step, as generate's help said)."""
    from fastrwa.models import ByteLM, LMConfig, PackedLM

    help_ = HELP["--weights"]
    assert "on CUDA the step replayed from a CUDA graph" in help_
    assert "on CPU the fused step with float32 matrices" in help_
    decoder = ByteLM(LMConfig(d_model=16, n_layers=1)).decoder("auto")
    assert isinstance(decoder, PackedLM) and decoder.format == "float32"
