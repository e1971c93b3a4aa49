"""Every command line takes the options the CLIs share from :mod:`fastrwa.options`: each
shared flag is there with the help written once in ``fastrwa.options.HELP`` (five CLIs
wrote them each their own way, and generate's ``--weights auto`` said the eager step on
CUDA where ``ByteLM.decoder`` replays a CUDA graph)."""

import argparse
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


def _parser(command: str) -> argparse.ArgumentParser:
    if command == "generate":
        from fastrwa.generate import parser
    elif command == "serve":
        from fastrwa.serve.cli import parser
    elif command == "export onnx":
        from fastrwa.export.__main__ import parser
        sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices["onnx"]
    elif command == "hf.export":
        pytest.importorskip("transformers")
        from fastrwa.hf.export import parser
    else:
        from fastrwa.train.cli import parser
    return parser()


def _options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Each action of ``p`` by its flag (a positional by its metavar)."""
    found = {}
    for action in p._actions:
        for name in action.option_strings or [action.metavar or action.dest]:
            found[name] = action
    return found


def _pattern(text: str) -> str:
    """A help text with ``{fields}`` (--overwrite's) as a regular expression."""
    return "".join(".+" if re.fullmatch(r"\{\w+\}", part) else re.escape(part)
                   for part in re.split(r"(\{\w+\})", text))


@pytest.mark.parametrize("command", sorted(SHARED))
def test_every_cli_takes_the_shared_options_with_their_one_help(command):
    options = _options(_parser(command))
    for flag in sorted(SHARED[command]):
        assert flag in options, f"{command} does not take {flag}"
        if "{" in HELP[flag]:
            assert re.fullmatch(_pattern(HELP[flag]), options[flag].help), (command, flag)
        else:
            assert options[flag].help == HELP[flag], (command, flag)
    # every flag of a shared name is the shared one, or one the command means otherwise
    for flag in set(options) & set(HELP):
        assert flag in SHARED[command] or flag in OWN.get(command, {}), (command, flag)


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
