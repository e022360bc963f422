#!/usr/bin/env bash
# All GPU checks and benchmarks in one call (run on a CUDA machine).
# Writes results under ${OUT:-gpu-results}/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
python3 -m pip install -q -e '.[test,gpu]' 2>&1 | tail -2
nvidia-smi -L | tee "$out/gpu.txt"
python3 -m pytest -q -m cuda tests 2>&1 | tee "$out/cuda-tests.log"
python3 -m pytest -q tests/tiers/test_io_conformance.py 2>&1 | tee "$out/conformance.log"
kvtier bench tiers --io-backend auto --json "$out/bench-tiers.json" 2>&1 | tee "$out/bench-tiers.log"
