#!/usr/bin/env bash
# The GPU run, as one device command from the repository root (carry .whl, made by
# `prepare` below, for the peers):
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
# .carry/text-corpus.txt), tune (bench/gpu_sweep.py: the launch-knob sweep and the crossover):
#     bash bench/gpu_run.sh checks,layers
#     bash bench/gpu_run.sh tune
# Writes under $OUT (or bench-results/gpu): log.txt, pytest.txt, ncu.txt, gpu-<device>.json
# and .png, and all of them again in one archive, gpu-run.tar.gz. Each step has a time
# limit; a step that fails or outruns it is reported and the next still runs; the exit
# status is the number of failed steps (99: the package did not install, and nothing ran).
#
# Two other modes, each the whole command:
#     bash bench/gpu_run.sh prepare CORPUS_FILE
# on a machine with pip and no GPU: what a GPU machine without network needs, the peers'
# wheels in .whl/ and a byte corpus in .carry/ (both ignored by git; name them in the device
# call's carry).
#     bash bench/gpu_run.sh papers
# Issue 26's runs that this project's CPUs cannot afford (copy: 3-8 hours a run), with the
# device tool's timeout_s at least LIMIT + 120: twelve bench/experiments/papers.py runs at
# once, one process each (copy for the three scan models, multicopy for both RDA presets,
# adding for rda-sigmoid-id; seeds 0 and 1), each stopped after LIMIT seconds (default 420;
# on an H100 a one-layer run made 13-16 steps a second with eleven others beside it, 36-40
# with at most five). Each writes <run>/papers.json and <run>.log, packed into one file,
# OUT/papers-gpu.tar.gz ($OUT or bench-results/papers-gpu; the device tool brings back only a
# few files); stopped early (SIGTERM), it stops the runs and packs their logs, and the
# papers.json of those that had finished. Unpack it and
#     python -m bench.experiments.papers --join DIR/*/papers.json --record
# adds the runs to bench/results/papers (without --record: to bench-results/papers).
# (DEVICE=cpu LIMIT=2 checks the mode without a GPU, in an environment where fastrwa is
# installed.) The exit status is the number of runs that failed (99: the package did not
# install).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

prepare() {  # prepare CORPUS_FILE
    set -e
    local corpus=${1:?usage: bash bench/gpu_run.sh prepare CORPUS_FILE (a byte corpus for the training run)}
    test -f "$corpus" || { echo "no file $corpus" >&2; exit 2; }
    mkdir -p .whl .carry
    # Pure-Python wheels; fla-core needs only einops, which the device machine has.
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform any --platform manylinux2014_x86_64 -d .whl \
        fla-core==0.6.0 accelerated-scan==0.3.1
    install -m 644 "$corpus" .carry/text-corpus.txt
    ls -la .whl .carry
}

papers() {
    out=${OUT:-bench-results/papers-gpu}       # (not local: the EXIT trap reads them)
    runs=$(mktemp -d)
    limit=${LIMIT:-420}
    device=${DEVICE:-cuda}
    [[ $limit =~ ^[0-9]+$ ]] || { echo "LIMIT must be whole seconds, got '$limit'" >&2; exit 2; }
    mkdir -p "$out"
    pids=()
    trap 'kill "${pids[@]}" 2>/dev/null; tar czf "$out/papers-gpu.tar.gz" -C "$runs" .' EXIT
    trap 'exit 143' TERM
    export OMP_NUM_THREADS=1
    if [ "$device" = cuda ]; then
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 99
        nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$runs/device.txt"
    fi
    one() {
        local name=$1; shift
        timeout $((limit + 60)) python3 -m bench.experiments.papers --device "$device" \
            --time-limit "$limit" --out "$runs/$name" "$@" > "$runs/$name.log" 2>&1 &
        pids+=($!)
    }
    for seed in 0 1; do
        one "copy-rwa-scan-$seed" --tasks copy --models rwa-scan --seeds $seed
        one "copy-rda-exp-tanh-$seed" --tasks copy --models rda-exp-tanh --seeds $seed
        one "copy-rda-sigmoid-id-$seed" --tasks copy --models rda-sigmoid-id --seeds $seed
        one "multicopy-rda-exp-tanh-$seed" --tasks multicopy --models rda-exp-tanh --seeds $seed
        one "multicopy-rda-sigmoid-id-$seed" --tasks multicopy --models rda-sigmoid-id --seeds $seed
        one "adding-rda-sigmoid-id-$seed" --tasks adding --models rda-sigmoid-id --seeds $seed
    done
    local failed=0 pid log
    for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
    for log in "$runs"/*.log; do echo "== $log"; tail -n 1 "$log"; done
    exit $failed
}

case "${1:-}" in
    prepare) shift; prepare "$@"; exit 0 ;;
    papers) papers ;;
esac

steps=${1:-kernels,tests,ncu}
out=${OUT:-bench-results/gpu}
mkdir -p "$out"
# An $OUT under bench/results/ (the committed records) is written with --record (bench/cli.py).
record=()
case "$(realpath -m "$out")/" in "$(pwd -P)/bench/results/"*) record=(--record) ;; esac
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
        python3 -m bench.gpu_memcheck > "$out/memcheck.txt" 2>&1 || failed=$((failed + 1))
    tail -n 4 "$out/memcheck.txt" | tee -a "$out/log.txt"
fi
training=()
if step train && [ -f .carry/text-corpus.txt ]; then
    note "ByteLM 512 x 8, bf16 autocast, 3 minutes on the corpus"
    timeout 300 python3 -m bench.experiments.lm --data .carry/text-corpus.txt --models rda-scan \
        --device cuda --autocast bf16 --minutes 3 --d-model 512 --layers 8 --batch-size 32 \
        --bptt 512 --evals 4 --out /tmp/lm 2>&1 | tail -n 5 | tee -a "$out/log.txt" \
        || failed=$((failed + 1))
    if [ -f /tmp/lm/lm.json ]; then
        cp /tmp/lm/lm.json "$out/lm.json" && training=(--training /tmp/lm/lm.json)
    fi
fi
section_run() {  # section_run LIMIT_S SECTIONS DIR: bench/ops.py's GPU sections, report in DIR
    note "bench/ops.py --device cuda --only $2"
    timeout "$1" python3 -m bench.ops --device cuda --out "$3" --only "$2" \
        ${training[@]+"${training[@]}"} ${record[@]+"${record[@]}"} 2>&1 \
        | tee -a "$out/log.txt" | grep -v '^{' || failed=$((failed + 1))
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
step bench && section_run 540 checks,ops,peers "$out/bench"
if step tune; then
    note "bench/gpu_sweep.py --only sweep,crossover"
    timeout 540 python3 -m bench.gpu_sweep --out "$out/tune" --only sweep,crossover \
        ${record[@]+"${record[@]}"} 2>&1 | tee -a "$out/log.txt" | grep -v '^{' \
        || failed=$((failed + 1))
fi
# one report of every call (a call cut by its limit keeps what it wrote after each shape)
reports=$(ls "$out"/{kernels,checks,layers,bench,tune}/gpu-*.json 2>/dev/null)
if [ -n "$reports" ]; then
    python3 -m bench.gpu_report merge $reports --out "$out" ${training[@]+"${training[@]}"} \
        ${record[@]+"${record[@]}"} 2>&1 | tail -n 60 | tee -a "$out/log.txt"
fi
if step ncu; then
    ncu_bin=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -n 1)
    if [ -n "$ncu_bin" ]; then
        note "ncu: rda_scan forward and backward, 16 x 4096 x 1024 float32"
        timeout 40 "$ncu_bin" --target-processes all -k "regex:fwd_kernel|bwd_kernel" \
            --launch-skip 2 --launch-count 2 --section SpeedOfLight --section Occupancy \
            --section WarpStateStats --section LaunchStats \
            python3 -m bench.gpu_ncu > "$out/ncu.txt" 2>&1 || failed=$((failed + 1))
        grep -E "fwd_kernel|bwd_kernel|DRAM Throughput|Memory Throughput|Issue Slots|Achieved Occupancy|Registers Per|Stall Long" \
            "$out/ncu.txt" | head -n 30 | tee -a "$out/log.txt"
    else
        note "ncu: not on this machine (no counters)"
    fi
fi
tar czf /tmp/gpu-run.tar.gz -C "$out" . && mv /tmp/gpu-run.tar.gz "$out/gpu-run.tar.gz"
echo "failed steps: $failed"
exit $failed
