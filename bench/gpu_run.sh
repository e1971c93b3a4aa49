#!/usr/bin/env bash
# The whole GPU run, as device commands from the repository root (carry .whl and .carry,
# made by bench/gpu_prepare.sh). Each call of the device tool may run 10 minutes, so the
# steps are split over calls (times measured on 2026-11-26, on the card named):
#     bash bench/gpu_run.sh tests,memcheck     # 2.5 min (pytest 90-101 s on 14 workers, memcheck <50 s; H200)
#     bash bench/gpu_run.sh bench              # a 7.9 min call on an H100, all finished (on an H200 a
#                                              # 420 s call ended inside the peers' last shape;
#                                              # torch.logcumsumexp takes 2-5 s a call at 1M steps)
#     bash bench/gpu_run.sh layers             # 25 s (layers 18 s, streaming 3 s; H100)
#     bash bench/gpu_run.sh tune               # 6.3 min call (sweep 345 s, crossover 17 s; H100)
#     bash bench/gpu_run.sh train              # ~4 min (estimate; a 2.5-minute run was a 3.3-min call)
# and, apart from gpu_run.sh, the defaults against the sweep's knobs (170 s for the defaults
# and three candidates on an H100, about 40 s more per candidate):
#     python3 bench/gpu_defaults.py --out "$OUT"
# then join the calls' reports:
#     python bench/gpu_report.py merge B.json L.json T.json --training lm.json --out bench/results/gpu
# Writes under $OUT (or bench-results/gpu): log.txt, pytest.txt, memcheck.txt,
# gpu-<device>.json and .png, lm.json, and prints the short table last. A step that fails or
# outruns its time limit is reported and the next still runs; the exit status is the number
# of failed steps (99: the package did not install, and nothing ran).
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-tests,memcheck,bench,layers,train,tune}
out=${OUT:-bench-results/gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# fastrwa.kernels is the top-level kernels/ folder, mapped into the package by pyproject.toml:
# only an install makes it importable (editable, so the tests run this checkout).
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    || { echo "pip install -e . failed: fastrwa cannot be imported" >&2; exit 99; }
failed=0
step() { [[ ",$steps," == *",$1,"* ]]; }
note() { echo "== $* ($(date +%T))" | tee -a "$out/log.txt"; }
note "$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$out/log.txt"
if step tests; then
    # xdist spreads Triton's compiles (one per kernel specialisation) over 14 processes.
    note "pytest --cuda (the Triton columns and tests/test_cuda.py)"
    timeout 330 python3 -m pytest -q -p no:cacheprovider -n 14 --cuda -rf \
        -k "triton or test_cuda" tests > "$out/pytest.txt" 2>&1 || failed=$((failed + 1))
    tail -n 25 "$out/pytest.txt" | tee -a "$out/log.txt"
fi
if step memcheck; then
    note "compute-sanitizer --tool memcheck"
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 1 \
        python3 bench/gpu_memcheck.py > "$out/memcheck.txt" 2>&1 || failed=$((failed + 1))
    tail -n 4 "$out/memcheck.txt" | tee -a "$out/log.txt"
fi
training=()
if step train && [ -f .carry/text-corpus.txt ]; then
    note "ByteLM 512 x 8, bf16 autocast, 3 minutes on the corpus"
    timeout 300 python3 bench/lm.py --data .carry/text-corpus.txt --models rda-scan \
        --device cuda --autocast bf16 --minutes 3 --d-model 512 --layers 8 --batch-size 32 \
        --bptt 512 --evals 4 --out /tmp/lm 2>&1 | tail -n 5 | tee -a "$out/log.txt" \
        || failed=$((failed + 1))
    if [ -f /tmp/lm/lm.json ]; then
        cp /tmp/lm/lm.json "$out/lm.json" && training=(--training /tmp/lm/lm.json)
    fi
fi
sections=""
step bench && sections="checks,ops,peers"
step layers && sections="${sections:+$sections,}layers,streaming"
step tune && sections="${sections:+$sections,}sweep,crossover"
if [ -n "$sections" ]; then
    note "bench/gpu.py --only $sections"
    timeout 540 python3 bench/gpu.py --out "$out" --only "$sections" "${training[@]}" 2>&1 \
        | tee -a "$out/log.txt" | grep -v '^{' || failed=$((failed + 1))
fi
echo "failed steps: $failed"
exit $failed
