#!/usr/bin/env bash
# All GPU checks and benchmarks in one call, on a CUDA machine. Never needed by CI.
# Writes logs and JSON under ${OUT:-gpu-results}/.
#
# Works offline: where .whl/ exists (scripts/fetch_gpu_wheels.sh, run on a machine
# with a package index, then carried), its wheels are installed into /tmp/site, and
# kvtier runs from this tree through a package directory of links, so nothing
# needs a network or a build. Elsewhere it uses .venv or python3 as they are.
set -uo pipefail
cd "$(dirname "$0")/.."
root=$PWD
out=${OUT:-gpu-results}
mkdir -p "$out"
py=python3
if [ -x .venv/bin/python ]; then py=.venv/bin/python; fi
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        2>&1 | tail -3 | tee "$out/wheels.log"
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! "$py" -c "import kvtier.tiers" 2>/dev/null; then
    src=$(mktemp -d)
    mkdir "$src/kvtier"
    cp daemon/_root/__init__.py "$src/kvtier/"
    for d in protocol client daemon policy scoring predictor tiers kernels replay bench cli; do ln -s "$root/$d" "$src/kvtier/$d"; done
    export PYTHONPATH=$src:${PYTHONPATH:-}
fi
{
    nvidia-smi -L
    "$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
    "$py" -c "from kvtier.tiers.io_backends import kvikio_status; print('kvikio:', kvikio_status())"
} 2>&1 | tee "$out/env.txt"
"$py" -m pytest -q -p no:cacheprovider -m cuda tests/tiers/test_cuda.py 2>&1 | tee "$out/cuda-tests.log"
"$py" -m pytest -q -p no:cacheprovider tests/tiers/test_io_conformance.py tests/tiers/test_faults.py tests/tiers/test_manager.py \
    2>&1 | tee "$out/tiers-tests.log"
"$py" -m kvtier.cli bench tiers --io-backend auto --json "$out/bench-tiers.json" 2>&1 | tee "$out/bench-tiers.log"
"$py" -m kvtier.cli bench rpc --json "$out/bench-rpc.json" 2>&1 | tail -3 | tee "$out/bench-rpc.log"
