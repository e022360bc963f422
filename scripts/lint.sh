#!/usr/bin/env bash
# Lint and type-check: ruff over the tree, mypy over the kvtier package as it is
# imported (a package directory of links maps each top-level folder to
# kvtier.<folder>, as pyproject's package-dir does), plus the layer rules test.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-$root/.venv/bin/python}
"$py" -m ruff check .
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
mkdir "$src/kvtier"
cp daemon/_root/__init__.py "$src/kvtier/"
for d in protocol client connectors daemon policy scoring predictor tiers kernels replay bench cli; do
    ln -s "$root/$d" "$src/kvtier/$d"
done
(cd "$src" && MYPYPATH="$src" "$py" -m mypy --config-file "$root/pyproject.toml" -p kvtier)
