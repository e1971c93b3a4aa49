#!/usr/bin/env bash
# Issue 26's runs that this project's CPUs cannot afford (copy: 3-8 hours a run), on one GPU,
# as one device command from the repository root, with the device tool's timeout_s at least
# LIMIT + 120:
#     bash bench/gpu_papers.sh
# Twelve bench/papers.py runs at once, one process each (copy for the three scan models,
# multicopy for both RDA presets, adding for rda-sigmoid-id; seeds 0 and 1), each stopped
# after LIMIT seconds (default 420; on an H100 a one-layer run made 13-16 steps a second
# with eleven others beside it, 36-40 with at most five). Each writes <run>/papers.json and
# <run>.log, packed into one file, OUT/papers-gpu.tar.gz (the device tool brings back only a
# few files); stopped early (SIGTERM), it stops the runs and packs their logs, and the
# papers.json of those that had finished. Unpack it and
#     python bench/papers.py --join DIR/*/papers.json --record
# adds the runs to bench/results/papers (without --record: to bench-results/papers).
# (DEVICE=cpu LIMIT=2 checks the script without a GPU, in an environment where fastrwa is
# installed.)
# The exit status is the number of runs that failed (99: the package did not install).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-results/papers-gpu}
runs=$(mktemp -d)
limit=${LIMIT:-420}
device=${DEVICE:-cuda}
[[ $limit =~ ^[0-9]+$ ]] || { echo "LIMIT must be whole seconds, got '$limit'" >&2; exit 2; }
mkdir -p "$out"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null; tar czf "$out/papers-gpu.tar.gz" -C "$runs" .' EXIT
trap 'exit 143' TERM
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD
if [ "$device" = cuda ]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 99
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$runs/device.txt"
fi
one() {
    local name=$1; shift
    timeout $((limit + 60)) python3 bench/papers.py --device "$device" --time-limit "$limit" \
        --out "$runs/$name" "$@" > "$runs/$name.log" 2>&1 &
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
failed=0
for pid in "${pids[@]}"; do wait "$pid" || failed=$((failed + 1)); done
for log in "$runs"/*.log; do echo "== $log"; tail -n 1 "$log"; done
exit $failed
