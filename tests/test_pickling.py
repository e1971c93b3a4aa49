"""Every public module (the scan layers, the cells, the recurrent wrapper, the language models
and their baselines) pickles, saves whole with ``torch.save`` and deep-copies, and the copy
computes what the module computed."""

import copy
import io
import pickle

import pytest
import torch

from fastrwa.models import ByteLM, LMConfig, RecurrentLM
from fastrwa.nn import RDA, RWA, RDACell, Recurrent, RRACell, RWACell

I, H = 6, 5


def _modules():
    torch.manual_seed(0)
    seq = torch.randn(2, 4, I)
    step = torch.randn(2, I)
    tokens = torch.randint(0, 256, (2, 5))
    run_layer = lambda m: m(seq)[0]                               # noqa: E731
    run_cell = lambda m: m(step)[0]                               # noqa: E731
    run_lm = lambda m: m(tokens)[0]                               # noqa: E731
    cases = [("RWA", RWA(I, H, token_shift=True), run_layer),
             ("RWA-bidirectional", RWA(I, H, bidirectional=True), run_layer),
             ("RWACell", RWACell(I, H), run_cell),
             ("RRACell", RRACell(I, H, window=3), run_cell),
             ("Recurrent", Recurrent(RDACell(I, H, f_h="identity")), run_layer)]
    for f_h in ("tanh", "identity", "sigmoid", "relu"):
        cases.append((f"RDA-f_h={f_h}", RDA(I, H, f_h=f_h, f_o="identity"), run_layer))
        cases.append((f"RDACell-f_h={f_h}", RDACell(I, H, f_h=f_h, f_o="identity"), run_cell))
    cases.append(("RDA-sigmoid-id", RDA(I, H, preset="sigmoid-id"), run_layer))
    for layer in ("rda", "rwa"):
        cases.append((f"ByteLM-{layer}", ByteLM(LMConfig(layer=layer, d_model=8, n_layers=2,
                                                          discount_init="spread")), run_lm))
    for layer in ("lstm", "gru"):
        cases.append((f"RecurrentLM-{layer}",
                      RecurrentLM(LMConfig(layer=layer, d_model=8, n_layers=1)), run_lm))
    return cases


MODULES = _modules()


@pytest.mark.parametrize("name,module,run", MODULES, ids=[c[0] for c in MODULES])
def test_every_public_module_pickles_and_saves_whole(name, module, run):
    module.eval()
    with torch.no_grad():
        want = run(module)
        from_pickle = pickle.loads(pickle.dumps(module))
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        from_save = torch.load(buffer, weights_only=False)
        for loaded in (from_pickle, from_save, copy.deepcopy(module)):
            assert type(loaded) is type(module)
            assert torch.equal(run(loaded), want), name
