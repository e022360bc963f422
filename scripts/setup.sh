#!/usr/bin/env bash
# Create .venv with the CPU build of torch and kvtier (with the engine adapter
# and test extras) installed. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then python3 -m venv .venv; fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[test,engine]'
