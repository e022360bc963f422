#!/usr/bin/env bash
# Wheels the GPU machine lacks, fetched here into .whl/ (git-ignored).
# That machine has no network and its own Python 3.12 with torch (CUDA 13),
# numpy, scipy, msgpack, xxhash, rich, prometheus-client, psutil, pytest and
# transformers; kvtier also needs pyzmq and pydantic(-settings), and the kvikio
# backend needs kvikio for CUDA 13. Carry .whl with the run; gpu_checks.sh
# installs it offline.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
[ -x "$py" ] || py=python3
rm -rf .whl
mkdir -p .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl \
    pyzmq==27.3.0 pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0 \
    typing-inspection==0.4.5 "typing-extensions>=4.16" python-dotenv==1.2.4 \
    kvikio-cu13==26.10.0 libkvikio-cu13==26.10.0 "rapids-logger==0.3.*"
ls .whl
du -sh .whl
