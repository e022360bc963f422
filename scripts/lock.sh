#!/usr/bin/env bash
# Rewrite scripts/requirements.lock: set up a fresh virtual environment unlocked (the newest
# versions pyproject.toml's ranges and setup.sh's caps allow) and freeze it. Run the tests
# on the result before committing it: the lock is the set CI installs.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
KVTIER_UNLOCKED=1 KVTIER_VENV="$tmp/venv" bash scripts/setup.sh
{
    echo "# Every package of a fresh 'bash scripts/setup.sh', as it resolved on $(date -u +%Y-%m-%d)"
    echo "# (Python $("$tmp/venv/bin/python" -c 'import platform; print(platform.python_version())'), $(uname -m)). Written by scripts/lock.sh;"
    echo "# setup.sh installs exactly these, with --no-deps. Not for installing kvtier elsewhere:"
    echo "# its own dependency ranges are in pyproject.toml."
    "$tmp/venv/bin/python" -m pip freeze --all --exclude-editable | grep -v -i '^kvtier'
} > scripts/requirements.lock.new
mv scripts/requirements.lock.new scripts/requirements.lock
echo "scripts/requirements.lock: $(grep -vc '^#' scripts/requirements.lock) packages"
