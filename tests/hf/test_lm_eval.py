"""lm-evaluation-harness's own code (its ``HFLM`` and ``simple_evaluate``, offline) on a run's
``model/`` directory (model.pt, ``trust_remote_code``) and on its Hugging Face export: bits
per byte of a local perplexity task equal to the model's own forward, documents longer
than lm-eval's 2,048-token default read whole, and a generation task (``generate_until``,
which stops at the tokenizer's EOS) that gives ByteLM.generate's bytes. Skipped only where
lm-eval is not installed and not under CI (.ci/run installs ``lm-eval[hf]``)."""

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

if not os.environ.get("CI"):
    pytest.importorskip("transformers")
    pytest.importorskip("lm_eval")

import fastrwa.hf as fhf  # noqa: E402,F401 (the extra: CI fails here without it)
import lm_eval  # noqa: E402,F401 (CI installs it: there a missing lm_eval fails)
from helpers import fit_on_bytes, lm_eval_ppl_task  # noqa: E402
from fastrwa.models import ByteLM, LMConfig, save_pretrained  # noqa: E402

# (a process of its own: HF_HUB_OFFLINE is read when huggingface_hub is imported)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}

# A few local documents, one longer than lm-eval's default context (2,048 tokens) and one
# not ASCII (more bytes than characters).
DOCS = ["the cat sat on the mat.",
        "naïve café — señor 東京. " * 3,
        "".join(f"line {i}: a dog ran in the fog, {i * i} times.\n" for i in range(90))]
assert len(DOCS[2].encode()) > 3000

# lm-eval in a process that never imports fastrwa itself (a run's model/ loads through its
# auto_map with trust_remote_code): for each directory, per document the summed
# log-likelihood of loglikelihood_rolling, the bits per byte of the same documents as a
# local task through simple_evaluate, and generate_until's continuations.
HARNESS = textwrap.dedent("""
    import json, sys
    from lm_eval import simple_evaluate
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    tasks, docs, prompts = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    for directory in sys.argv[4:]:
        lm = HFLM(pretrained=directory, trust_remote_code=True, device="cpu", batch_size=2)
        rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i)
                                            for i, d in enumerate(docs)], disable_tqdm=True)
        until = lm.generate_until([Instance("generate_until", {}, (p, {"until": ["\\n"],
                                            "max_gen_toks": 12, "do_sample": False}), i)
                                   for i, p in enumerate(prompts)], disable_tqdm=True)
        results = simple_evaluate(model=lm, tasks=["fastrwa_local_ppl"],
                                  task_manager=TaskManager(include_path=tasks))
        print(json.dumps({"max_length": lm.max_length, "eot": lm.eot_token_id,
                          "rolling": rolling, "until": until,
                          "bpb": results["results"]["fastrwa_local_ppl"]["bits_per_byte,none"]}))
""")

@pytest.fixture(scope="module")
def byte_lm():
    """A ByteLM trained a little on the documents (an untrained one gives every byte about
    the same probability, which would hide documents scored from the wrong context)."""
    torch.manual_seed(0)
    return fit_on_bytes(ByteLM(LMConfig(d_model=16, n_layers=2, mlp_ratio=2)),
                        "".join(DOCS).encode(), steps=40, window=64)


def _own_log_likelihoods(model: ByteLM, docs: list[str]) -> list[float]:
    """Per document the natural-log likelihood of its bytes by the model's own forward over
    the whole document, from BOS (what lm-eval's rolling windows prefix it with)."""
    out = []
    for doc in docs:
        ids = torch.tensor([[model.config.bos_token, *doc.encode()]])
        with torch.no_grad():
            logits, _ = model(ids[:, :-1])
        out.append(-float(torch.nn.functional.cross_entropy(
            logits[0].double(), ids[0, 1:], reduction="sum")))
    return out


def test_lm_eval_reads_a_runs_model_directory_and_its_export_as_the_model_does(byte_lm,
                                                                              tmp_path):
    """Issue 59: from a run's model/ (model.pt) from_pretrained refused the options lm-eval
    always passes, generate_until failed on a tokenizer without EOS, and documents were cut
    at 2,048 bytes (no context length in the config)."""
    from fastrwa.hf.export import export

    save_pretrained(byte_lm, tmp_path / "run" / "model")
    directories = [tmp_path / "run" / "model", export(tmp_path / "run", tmp_path / "hf")]
    tasks = lm_eval_ppl_task(tmp_path, DOCS)
    prompts = ["the cat ", "line 3: a dog"]
    done = subprocess.run([sys.executable, "-c", HARNESS, str(tasks),
                           json.dumps(DOCS), json.dumps(prompts), *map(str, directories)],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env={**ENV, "HF_HOME": str(tmp_path / "hf_home")})
    assert done.returncode == 0, done.stderr[-4000:]
    lines = done.stdout.strip().splitlines()[-len(directories):]
    want = _own_log_likelihoods(byte_lm, DOCS)
    n_bytes = sum(len(d.encode()) for d in DOCS)
    for directory, line in zip(directories, lines):
        got = json.loads(line)
        assert got["max_length"] >= max(len(d.encode()) for d in DOCS) + 1, directory
        assert got["rolling"] == pytest.approx(want, rel=1e-6), directory
        assert got["bpb"] == pytest.approx(-sum(want) / n_bytes / math.log(2), rel=1e-6)
        # generate_until: greedy, cut before the first "\n" (and at the tokenizer's EOS)
        assert got["eot"] == byte_lm.config.eos_token
        for prompt, text in zip(prompts, got["until"]):
            ids = byte_lm.generate(torch.tensor([list(prompt.encode())]), 12, top_k=1)[0]
            whole = bytes(ids[len(prompt.encode()):].tolist()).decode("utf-8", "replace")
            assert text == whole.split("\n")[0], (directory, prompt, text, whole)
