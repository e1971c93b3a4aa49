#!/usr/bin/env bash
# Issue 26's runs that this project's CPUs cannot afford (copy: 3-8 hours a run), on one GPU,
# as one device command from the repository root (carry .whl):
#     bash bench/gpu_papers.sh
# Twelve bench/papers.py runs at once, one process each (copy for the three scan models,
# multicopy for both RDA presets, adding for rda-sigmoid-id; seeds 0 and 1), each stopped
# after LIMIT seconds (default 420). Each writes OUT/<run>/papers.json and OUT/<run>.log;
# join them into bench/results/papers with bench/papers_merge.py.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench-results/papers-gpu}
limit=${LIMIT:-420}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . || exit 99
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
one() {
    local name=$1; shift
    timeout $((limit + 100)) python3 bench/papers.py --device cuda --time-limit "$limit" \
        --out "$out/$name" "$@" > "$out/$name.log" 2>&1 &
}
for seed in 0 1; do
    one "copy-rwa-scan-$seed" --tasks copy --models rwa-scan --seeds $seed
    one "copy-rda-exp-tanh-$seed" --tasks copy --models rda-exp-tanh --seeds $seed
    one "copy-rda-sigmoid-id-$seed" --tasks copy --models rda-sigmoid-id --seeds $seed
    one "multicopy-rda-exp-tanh-$seed" --tasks multicopy --models rda-exp-tanh --seeds $seed
    one "multicopy-rda-sigmoid-id-$seed" --tasks multicopy --models rda-sigmoid-id --seeds $seed
    one "adding-rda-sigmoid-id-$seed" --tasks adding --models rda-sigmoid-id --seeds $seed
done
wait
for log in "$out"/*.log; do echo "== $log"; grep -E "seed [01]: " "$log" | grep -v step | tail -n 1; tail -n 2 "$log"; done
