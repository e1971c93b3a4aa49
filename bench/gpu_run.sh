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
# .carry/text-corpus.txt), tune (bench/gpu_sweep.py: the launch-knob sweep and the crossover),
# variants (the variants built for issue 62 beside the defaults at its three shapes: both
# passes at chunks of 32 steps, alone and with the carry kernels 8 segments at a time, the
# forward alone at 32, the carry tiles of 8 alone; first the cost model's bandwidth probe,
# bench/stream_probe.py; <= 240 s), chained (the "chained" forward and backward, never run
# on a card: their pytest --cuda tests, then their time at 1 x 1M x 256 beside the
# defaults: both passes chained with 6 and 5 programs an SM taking segments in turn (at the
# default chunks, then at chunks of 32 in segments of 2: with block_t = 32 the one set of
# knobs that meets every target of issue 62 on the cost model), uncapped, with 4 and 4, and
# uncapped at chunks of 32 in segments of 2; <= 300 s):
#     bash bench/gpu_run.sh checks,layers
#     bash bench/gpu_run.sh tune
#     bash bench/gpu_run.sh variants,chained
# Writes under $OUT (or bench-results/gpu): log.txt, pytest.txt, ncu.txt, gpu-<device>.json
# and .png, and all of them again in one archive, gpu-run.tar.gz. Each step has a time
# limit; a step that fails or outruns it is reported and the next still runs; the exit
# status is the number of failed steps (99: the package did not install, and nothing ran).
#
# Three other modes, each the whole command:
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
#     bash bench/gpu_run.sh lm [CORPUS]
# Issue 52's ByteLM against the Transformer at scale (bench/experiments/lm_gpu.py): both at
# ~25M parameters, MINUTES each of wall clock (default 3.25), bf16 autocast, on CORPUS
# (default .carry/text-corpus.txt, from `prepare`: carry .carry), after a 2-step ByteLM run
# that fills Triton's kernel cache; about 8 minutes in all, under a guard of LIMIT seconds
# (default 540; the device tool's timeout_s 600). Writes lm-gpu.json, .png, .md, log.txt and
# lm-gpu.tar.gz (those and each run's metrics, config and samples) into $OUT (default
# bench-results/lm-gpu); a run cut by the guard keeps what it measured. DEVICE=cpu checks
# the mode in seconds without a GPU (bench/experiments/lm_gpu.py --tiny). The exit status is
# the entry's (99: the package did not install; 124: cut by the guard).
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

lm() {  # lm [CORPUS]
    local corpus=${1:-.carry/text-corpus.txt}
    out=${OUT:-bench-results/lm-gpu}   # (not local: the EXIT trap reads them)
    runs=$(mktemp -d)
    local device=${DEVICE:-cuda} minutes=${MINUTES:-3.25} limit=${LIMIT:-540}
    [[ $limit =~ ^[0-9]+$ ]] || { echo "LIMIT must be whole seconds, got '$limit'" >&2; exit 2; }
    test -f "$corpus" || { echo "no corpus $corpus: run 'bash bench/gpu_run.sh prepare" \
        "PATH/TO/text-corpus.txt' where the corpus is and carry .carry" >&2; exit 2; }
    mkdir -p "$out"
    trap 'pack_lm' EXIT
    trap 'exit 143' TERM
    if [ "$device" = cuda ]; then
        python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 99
        nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader \
            | tee "$runs/log.txt"
    fi
    local tiny=()
    [ "$device" = cuda ] || tiny=(--tiny)
    echo "== bench/experiments/lm_gpu.py, $minutes minutes a model ($(date +%T))" \
        | tee -a "$runs/log.txt"
    timeout --kill-after=20 "$limit" python3 -m bench.experiments.lm_gpu --data "$corpus" \
        --device "$device" --minutes "$minutes" --out "$runs" ${tiny[@]+"${tiny[@]}"} 2>&1 \
        | tee -a "$runs/log.txt"
    exit "${PIPESTATUS[0]}"
}

pack_lm() {  # the small files of an lm run into $out, and again with the runs' own in one archive
    local kept
    cp "$runs"/lm-gpu.json "$runs"/lm-gpu.png "$runs"/lm-gpu.md "$runs"/log.txt "$out"/ 2>/dev/null
    kept=$(cd "$runs" && ls lm-gpu.json lm-gpu.png lm-gpu.md log.txt runs/*/metrics.jsonl \
        runs/*/config.json runs/*/samples.txt runs/*/learning_curve.png 2>/dev/null)
    # shellcheck disable=SC2086
    [ -n "$kept" ] && tar czf "$out/lm-gpu.tar.gz" -C "$runs" $kept
    rm -rf "$runs"
}

case "${1:-}" in
    prepare) shift; prepare "$@"; exit 0 ;;
    papers) papers ;;
    lm) shift; lm "$@" ;;
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
    # (the chained algorithm's tests run in their own step: a wait that never ends there
    # would cost this step's summary)
    timeout 170 python3 -m pytest -q -p no:cacheprovider -n 14 --cuda -rf \
        -k "(triton or test_cuda) and not chained" tests > "$out/pytest.txt" 2>&1 \
        || failed=$((failed + 1))
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
if step variants; then
    # issue 62's variants, each beside the defaults in one run (bench/gpu_sweep.py CANDIDATES)
    note "bench/gpu_sweep.py --only defaults,streams --candidates bt32 bt32-carry8 fwd-bt32 carry8"
    timeout 240 python3 -m bench.gpu_sweep --out "$out/variants" --only defaults,streams \
        --candidates bt32 bt32-carry8 fwd-bt32 carry8 --shapes 0 1 2 2>&1 | tee -a "$out/log.txt" \
        | grep -v '^{' || failed=$((failed + 1))
fi
if step chained; then
    # the "chained" algorithm (never run on a card): its tests, each process under a limit (a
    # look-back that never ends is a hang, not a failure), then, if they pass, its time at
    # the 1M row beside the defaults
    note "pytest --cuda tests/backends/triton/test_chained.py"
    # (-n 4: its builds, the forward's and the backward's for each case, compile side by side)
    timeout 180 python3 -m pytest -q -p no:cacheprovider -n 4 --cuda -rf \
        tests/backends/triton/test_chained.py > "$out/pytest-chained.txt" 2>&1
    status=$?
    tail -n 15 "$out/pytest-chained.txt" | tee -a "$out/log.txt"
    if [ $status -eq 0 ]; then
        note "bench/gpu_sweep.py --only defaults --candidates chained-cap6-5" \
            "chained-bt32-2-cap6-5 chained chained-cap4 chained-bt32-2"
        timeout 120 python3 -m bench.gpu_sweep --out "$out/chained" --only defaults \
            --candidates chained-cap6-5 chained-bt32-2-cap6-5 chained chained-cap4 \
            chained-bt32-2 --shapes 2 2>&1 \
            | tee -a "$out/log.txt" | grep -v '^{' || failed=$((failed + 1))
    else
        echo "chained: tests failed or timed out (status $status)" | tee -a "$out/log.txt"
        failed=$((failed + 1))
    fi
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
