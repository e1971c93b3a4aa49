"""lm-evaluation-harness's own ``local-completions`` model (its ``TemplateAPI``, default
settings: the remote tokenizer it finds at ``/tokenizer_info``, token prompts that start
with its prefix token, BOS, ``echo`` with ``logprobs: 1`` and ``max_tokens: 1``) against
``python -m fastrwa.serve`` on loopback, offline: bits per byte of a local perplexity task
equal to the model's own forward over the same windows (lm-eval's rolling windows of its
default 2,048 tokens: a document longer than that is read in two). Skipped only where
lm-eval is not installed and not under CI (.ci/run installs ``lm-eval[hf,api]``)."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not os.environ.get("CI"):
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")         # (lm-eval's api extra)

from lm_eval import utils as lm_utils  # noqa: E402 (CI installs it: there a missing one fails)
from helpers import fit_on_bytes, lm_eval_ppl_task  # noqa: E402
from fastrwa.models import ByteLM, LMConfig  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
BOS = 256

# Local documents: one not ASCII, one longer than lm-eval's default window (2,048 tokens).
DOCS = ["the cat sat on the mat.",
        "naïve café — señor 東京. " * 3,
        "".join(f"line {i}: a dog ran in the fog, {i * i} times.\n" for i in range(90))]
assert len(DOCS[2].encode()) > 3000

# lm-eval in a process of its own: its remote-tokenizer model on the server's URL with
# default settings; per document loglikelihood_rolling, then the same documents as a local
# task through simple_evaluate (the model made from its registry name, as its command
# line makes it).
HARNESS = textwrap.dedent("""
    import json, sys
    from lm_eval import simple_evaluate
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    url, name, tasks, docs = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
    lm = LocalCompletionsAPI(base_url=url + "/v1/completions", model=name)
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i)
                                        for i, d in enumerate(docs)], disable_tqdm=True)
    results = simple_evaluate(model="local-completions",
                              model_args=f"base_url={url}/v1/completions,model={name}",
                              tasks=["fastrwa_local_ppl"],
                              task_manager=TaskManager(include_path=tasks))
    print(json.dumps({"backend": lm.tokenizer_backend, "prefix": lm.prefix_token_id,
                      "eot": lm.eot_token_id, "max_length": lm.max_length,
                      "rolling": rolling,
                      "bpb": results["results"]["fastrwa_local_ppl"]["bits_per_byte,none"]}))
""")

@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A ByteLM trained a little on the documents (an untrained one gives every byte about
    the same probability, which would hide bytes scored from the wrong context), saved."""
    torch.manual_seed(0)
    model = fit_on_bytes(ByteLM(LMConfig(d_model=16, n_layers=2, mlp_ratio=2)),
                         "".join(DOCS).encode(), steps=40, window=64).eval()
    directory = tmp_path_factory.mktemp("trained")
    model.save_pretrained(directory)
    return directory


def _window_log_likelihood(model: ByteLM, context: list, continuation: list) -> float:
    """The natural-log likelihood of ``continuation`` after ``context`` by the model's own
    forward over the window (float64 log-softmax of its logits)."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logits, _ = model(ids[:, :-1])
    logprobs = logits[0].double().log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
    return float(logprobs[-len(continuation):].sum())


def _own_log_likelihoods(model: ByteLM, docs: list, max_length: int) -> list:
    """Per document, the sum over lm-eval's rolling windows (its own window code, BOS as
    the prefix token) of each window's likelihood by the model's forward."""
    out = []
    for doc in docs:
        windows = map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
            token_list=list(doc.encode()), prefix_token=BOS, max_seq_len=max_length - 1,
            context_len=1))
        out.append(sum(_window_log_likelihood(model, list(c), list(w)) for c, w in windows))
    return out


def test_lm_eval_local_completions_scores_as_the_models_forward(trained_dir, tmp_path,
                                                                 server_process):
    """Issue 61 item 3: lm-eval's perplexity task through the server (echo, logprobs, a
    BOS in the token prompt, the remote tokenizer) gives the forward's bits per byte."""
    server = server_process(trained_dir, "--max-batch", "4")
    tasks = lm_eval_ppl_task(tmp_path, DOCS)
    done = subprocess.run([sys.executable, "-c", HARNESS, server.url, "tiny",
                           str(tasks), json.dumps(DOCS)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**ENV, "HF_HOME": str(tmp_path / "hf_home")})
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["backend"] == "remote"            # (found at /tokenizer_info: no Hub)
    assert got["prefix"] == BOS and got["eot"] == BOS
    assert got["max_length"] < len(DOCS[2].encode())        # (the long one: two windows)
    model = ByteLM.load(trained_dir).eval()
    want = _own_log_likelihoods(model, DOCS, got["max_length"])
    assert got["rolling"] == pytest.approx(want, rel=1e-6, abs=0)
    n_bytes = sum(len(d.encode()) for d in DOCS)
    assert got["bpb"] == pytest.approx(-sum(want) / n_bytes / math.log(2), rel=1e-6, abs=0)
