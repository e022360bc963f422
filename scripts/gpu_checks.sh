#!/usr/bin/env bash
# All GPU checks and benchmarks in one call, on a CUDA machine, in under 10 minutes
# (each step gets at most its cap and what is left of a 570 s budget). Never needed by CI.
# Writes logs, JSON and summary.txt under ${OUT:-gpu-results}/. Exit status: 0 all
# passed, 1 a step failed or timed out, 2 no CUDA device (GPU steps skipped, said so).
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
budget=${GPU_CHECKS_BUDGET_S:-570}
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
: > "$out/summary.txt"
failed=0

# step NAME CAP_S LOG CMD...: run CMD under the smaller of CAP_S and the budget left
step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((budget - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "SKIP  $name (time budget spent)" | tee -a "$out/summary.txt"
        failed=1
        return
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    echo "== $name (at most ${cap}s)"
    timeout -k 10 "$cap" "$@" > "$out/$log" 2>&1
    local rc=$?
    tail -n 15 "$out/$log"
    if [ $rc -eq 0 ]; then
        echo "PASS  $name" | tee -a "$out/summary.txt"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "TIME  $name (over ${cap}s; see $out/$log)" | tee -a "$out/summary.txt"
        failed=1
    else
        echo "FAIL  $name (rc $rc; see $out/$log)" | tee -a "$out/summary.txt"
        failed=1
    fi
}

{
    if command -v nvidia-smi > /dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
    "$py" -c "import sys, torch; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
    "$py" -c "from kvtier.tiers.io_backends import kvikio_status; print('kvikio:', kvikio_status())"
} 2>&1 | tee "$out/env.txt"

if ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
    echo "no CUDA device here: the cuda tests, the GPU engine test and the GPU bench baselines are skipped" \
        | tee -a "$out/summary.txt"
    echo "(they need a GPU machine; the host-side I/O conformance suite still runs)"
    step "I/O conformance (host backends)" 120 conformance.log \
        "$py" -m pytest -q -p no:cacheprovider -m "not cuda" tests/tiers/test_io_conformance.py \
        tests/tiers/test_io_recovery.py
    echo "GPU checks NOT run (no CUDA device)." | tee -a "$out/summary.txt"
    exit 2
fi

# cuda-marked: device pools and streams, device checksum, bounce buffers, layer events,
# kvikio device-direct promotion, CUDA IPC, the transformers engine bit-exact on the GPU
step "cuda tests" 240 cuda-tests.log \
    "$py" -m pytest -q -p no:cacheprovider -m cuda tests/tiers/test_cuda.py tests/kernels/test_checksum.py \
    tests/tiers/test_io_conformance.py
# the kvikio (and posix) conformance suite, the tier fault and manager tests on a CUDA HBM pool
step "I/O conformance and tier tests" 150 tiers-tests.log \
    "$py" -m pytest -q -p no:cacheprovider tests/tiers/test_io_conformance.py tests/tiers/test_io_recovery.py \
    tests/tiers/test_faults.py tests/tiers/test_manager.py
# GPU baselines in the same run: pinned H2D/D2H (CUDA events), raw kvikio read/write
step "bench tiers" 200 bench-tiers.log \
    "$py" -m kvtier.cli bench tiers --io-backend auto --total-mib 256 --reps 4 --copy-rounds 2 \
    --json "$out/bench-tiers.json"
step "bench rpc" 45 bench-rpc.log "$py" -m kvtier.cli bench rpc --json "$out/bench-rpc.json"
echo "total ${SECONDS}s" | tee -a "$out/summary.txt"
exit $failed
