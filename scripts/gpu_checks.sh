#!/usr/bin/env bash
# All GPU checks and benchmarks in one call (run on a CUDA machine).
# Writes logs and JSON under ${OUT:-gpu-results}/. Never needed by CI.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-results}
mkdir -p "$out"
py=python3
if [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
$py -m pip install -q -e '.[test,engine,gpu]' 2>&1 | tail -2
nvidia-smi -L | tee "$out/gpu.txt"
$py -c "from kvtier.tiers.io_backends import kvikio_status; print('kvikio:', kvikio_status())" | tee "$out/kvikio.txt"
$py -m pytest -q -m cuda tests 2>&1 | tee "$out/cuda-tests.log"
$py -m pytest -q tests/tiers/test_io_conformance.py 2>&1 | tee "$out/conformance.log"
$py -m kvtier.daemon.cli bench tiers --io-backend auto --json "$out/bench-tiers.json" 2>&1 | tail -20 | tee "$out/bench-tiers.log"
$py -m kvtier.daemon.cli bench rpc --json "$out/bench-rpc.json" 2>&1 | tail -3 | tee "$out/bench-rpc.log"
