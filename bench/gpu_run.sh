#!/usr/bin/env bash
# The GPU run, as one device command from the repository root (carry .whl, made by
# bench/gpu_prepare.sh, for the peers):
#     bash bench/gpu_run.sh                    # the default steps, at most about 9 minutes:
#         kernels  the ops and their peers, shape by shape, the issue's target shapes first
#                  (<= 300 s; on the H100 of 2026-11-27 the first two shapes took about
#                  260 s and 1x1Mx256 most of 230 s with the looped and fused-recurrent
#                  rows, now left out past 2**16 steps: the last shapes may be cut, and
#                  the report keeps every shape finished)
#         tests    pytest --cuda on the Triton columns and tests/test_cuda.py   (<= 170 s;
#                  138 s on the H100 of 2026-11-27)
#         ncu      Nsight Compute's speed-of-light, occupancy and warp-state sections for
#                  rda_scan's forward and backward at 16 x 4096 x 1024, when ncu exists (<= 40 s)
# Other steps, each its own call: checks (rda_scan against float64 at full scale and past
# 2**31 elements, <= 60 s), layers (fastrwa.nn.RDA against cuDNN LSTM/GRU, ByteLM streaming,
# <= 60 s), memcheck, bench (the older checks,ops,peers sections), train (needs
# .carry/text-corpus.txt), tune (the launch-knob sweep and the crossover):
#     bash bench/gpu_run.sh checks,layers
#     bash bench/gpu_run.sh tune
# Writes under $OUT (or bench-results/gpu): log.txt, pytest.txt, ncu.txt, gpu-<device>.json
# and .png, and all of them again in one archive, gpu-run.tar.gz. Each step has a time
# limit; a step that fails or outruns it is reported and the next still runs; the exit
# status is the number of failed steps (99: the package did not install, and nothing ran).
set -uo pipefail
cd "$(dirname "$0")/.."
steps=${1:-kernels,tests,ncu}
out=${OUT:-bench-results/gpu}
mkdir -p "$out"
# An $OUT under bench/results/ (the committed records) is written with --record (bench/cli.py).
record=()
case "$(realpath -m "$out")/" in "$(pwd -P)/bench/results/"*) record=(--record) ;; esac
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
step tune && sections="${sections:+$sections,}sweep,crossover"
section_run() {  # section_run LIMIT_S SECTIONS DIR: bench/gpu.py's sections, report in DIR
    note "bench/gpu.py --only $2"
    timeout "$1" python3 bench/gpu.py --out "$3" --only "$2" ${training[@]+"${training[@]}"} \
        ${record[@]+"${record[@]}"} 2>&1 | tee -a "$out/log.txt" | grep -v '^{' \
        || failed=$((failed + 1))
}
step kernels && section_run 300 kernels "$out/kernels"
if step tests; then
    # xdist spreads Triton's compiles (one per kernel specialisation) over 14 processes.
    note "pytest --cuda (the Triton columns and tests/test_cuda.py)"
    timeout 170 python3 -m pytest -q -p no:cacheprovider -n 14 --cuda -rf \
        -k "triton or test_cuda" tests > "$out/pytest.txt" 2>&1 || failed=$((failed + 1))
    tail -n 25 "$out/pytest.txt" | tee -a "$out/log.txt"
fi
step checks && section_run 60 checks "$out/checks"
step layers && section_run 60 layers,streaming "$out/layers"
[ -n "$sections" ] && section_run 540 "$sections" "$out/other"
# one report of every call (a call cut by its limit keeps what it wrote after each shape)
reports=$(ls "$out"/{kernels,checks,layers,other}/gpu-*.json 2>/dev/null)
if [ -n "$reports" ]; then
    python3 bench/gpu_report.py merge $reports --out "$out" ${record[@]+"${record[@]}"} 2>&1 \
        | tail -n 60 | tee -a "$out/log.txt"
fi
if step ncu; then
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
    if [ -n "$ncu_bin" ]; then
        note "ncu: rda_scan forward and backward, 16 x 4096 x 1024 float32"
        timeout 40 "$ncu_bin" --target-processes all -k "regex:fwd_kernel|bwd_kernel" \
            --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section LaunchStats \
            python3 bench/gpu_ncu.py > "$out/ncu.txt" 2>&1 || failed=$((failed + 1))
        grep -E "fwd_kernel|bwd_kernel|DRAM Throughput|Memory Throughput|Issue Slots|Achieved Occupancy|Registers Per|Stall Long" \
            "$out/ncu.txt" | head -n 30 | tee -a "$out/log.txt"
    else
        note "ncu: not on this machine (no counters)"
    fi
fi
tar czf /tmp/gpu-run.tar.gz -C "$out" . && mv /tmp/gpu-run.tar.gz "$out/gpu-run.tar.gz"
echo "failed steps: $failed"
exit $failed
