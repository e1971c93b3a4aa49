"""Context parallelism (``context_group=``, fastrwa/ops/context.py): a sequence split along
time over 2, 3 and 4 gloo processes gives the outputs and every gradient of one scan of the
whole sequence, in float64 within 1e-12 (each rank checks its slice in
tests/context_parallel/scan_worker.py), and bad calls are clear errors."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch

import fastrwa

WORKER = pathlib.Path(__file__).with_name("scan_worker.py")
LAYERS_WORKER = pathlib.Path(__file__).with_name("layers_worker.py")


def _run_ranks(worker, tmp_path, lengths, *more):
    """Run ``worker`` as ``len(lengths)`` gloo processes; each must print OK."""
    world = len(lengths)
    store = tmp_path / "store"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(worker), str(rank), str(world), str(store),
                               ",".join(map(str, lengths)), *more], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env)
             for rank in range(world)]
    try:
        results = [p.communicate(timeout=600) for p in procs]
    finally:
        for p in procs:                                   # (none left behind on a timeout)
            p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, results)):
        assert p.returncode == 0 and out.strip().endswith("OK"), \
            f"rank {rank} of {world}:\n{err[-3000:]}"


@pytest.mark.parametrize("lengths", [[1, 6], [2, 0, 3], [2, 3, 1, 2]],
                         ids=["2 ranks", "3 ranks, one empty", "4 ranks"])
def test_slices_over_ranks_equal_one_scan(tmp_path, lengths):
    # (Triton's interpreter, slow, in one layout: the one with an empty slice; not under
    # --cuda, which compiles the kernels for CUDA tensors)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    _run_ranks(WORKER, tmp_path, lengths, *(["triton"] if interpreted and 0 in lengths else []))


@pytest.mark.parametrize("lengths", [[1, 6], [2, 0, 3], [2, 3, 1, 2]],
                         ids=["2 ranks", "3 ranks, one empty", "4 ranks"])
def test_layers_and_the_language_model_over_ranks_equal_one_process(tmp_path, lengths):
    """RWA/RDA layers (token shift, bidirectional, time-first, float32) and a ByteLM: outputs,
    input gradients, final state and the parameters' gradients summed over the ranks equal
    one process's (tests/context_parallel/layers_worker.py); refusals stop every rank."""
    _run_ranks(LAYERS_WORKER, tmp_path, lengths)


def test_a_group_needs_torch_distributed():
    """(Refusals that need ranks, e.g. cu_seqlens or another width on one rank, are checked
    by every rank in the worker.)"""
    z = torch.randn(1, 4, 2)
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="needs torch.distributed initialised"):
        fastrwa.rwa_scan(z, z, context_group=object())
