#!/usr/bin/env bash
# Prepare, on a machine with pip and no GPU, what bench/gpu_run.sh carries to a GPU machine
# that has no network: the peers' wheels in .whl/ and a byte corpus in .carry/ (both ignored
# by git; name them in the device call's carry). Usage:
#     bash bench/gpu_prepare.sh CORPUS_FILE
set -euo pipefail
cd "$(dirname "$0")/.."
corpus=${1:?usage: bash bench/gpu_prepare.sh CORPUS_FILE (a byte corpus for the training run)}
test -f "$corpus" || { echo "no file $corpus" >&2; exit 2; }
mkdir -p .whl .carry
# Pure-Python wheels; fla-core needs only einops, which the device machine has.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform any --platform manylinux2014_x86_64 -d .whl \
    fla-core==0.6.0 accelerated-scan==0.3.1
install -m 644 "$corpus" .carry/text-corpus.txt
ls -la .whl .carry
