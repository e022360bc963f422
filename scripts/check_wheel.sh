#!/usr/bin/env bash
# Build the wheel (and the sdist when `build` is installed), install the wheel
# into a fresh venv with the CPU torch, and run the daemon from it: `kvtier
# --version`, `kvtier config validate`, then `kvtier serve` in the background
# until /healthz answers 200, SIGTERM, exit 0. Proves that the base install
# (no extras) is enough for the daemon and the CLI.
#
# Exit 77 when the wheel cannot be built or installed here (no index, no
# setuptools): the pytest wrapper (tests/cli/test_wheel.py) skips on it.
# PYTHON picks the interpreter that builds the wheel (default: .venv's).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-$root/.venv/bin/python}
work=$(mktemp -d)
daemon_pid=
cleanup() {
    if [ -n "$daemon_pid" ] && kill -0 "$daemon_pid" 2>/dev/null; then kill -KILL "$daemon_pid" || true; fi
    rm -rf "$work"
}
trap cleanup EXIT
skip() { echo "check_wheel: SKIP: $*" >&2; exit 77; }

echo "== build wheel"
if ! "$py" -m pip wheel -q --no-deps -w "$work/dist" "$root" >"$work/build.log" 2>&1; then
    # offline, build isolation cannot fetch setuptools: build with the interpreter's own
    "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$work/dist" "$root" >>"$work/build.log" 2>&1 \
        || { cat "$work/build.log" >&2; skip "pip wheel failed (see above)"; }
fi
if (cd "$work" && "$py" -c "import build.__main__") 2>/dev/null; then
    echo "== build sdist"
    "$py" -m build -q --sdist --outdir "$work/dist" "$root"
    echo "== wheel from the sdist: the same files as the wheel built from the tree"
    "$py" -m pip wheel -q --no-deps -w "$work/from-sdist" "$work"/dist/kvtier-*.tar.gz >>"$work/build.log" 2>&1 \
        || { cat "$work/build.log" >&2; echo "check_wheel: the sdist does not build a wheel" >&2; exit 1; }
    list() { "$py" -c "import sys, zipfile; print('\n'.join(sorted(n for n in zipfile.ZipFile(sys.argv[1]).namelist() if '.dist-info/' not in n)))" "$1"; }
    if ! diff <(list "$(ls "$work"/dist/kvtier-*.whl)") <(list "$(ls "$work"/from-sdist/kvtier-*.whl)") >&2; then
        echo "check_wheel: the sdist is missing files the wheel has (above)" >&2; exit 1
    fi
    echo "sdist ok: $(basename "$(ls "$work"/dist/kvtier-*.tar.gz)")"
else
    echo "== no sdist: the 'build' package is not installed"
fi
wheel=$(ls "$work"/dist/kvtier-*.whl)
echo "built $(basename "$wheel")"

echo "== fresh venv"
python3 -m venv "$work/venv"
vpy=$work/venv/bin/python
# the CPU build first, so that resolving kvtier's dependencies does not pull the CUDA one
"$vpy" -m pip install -q --no-compile --no-warn-script-location torch==2.13.0 2>&1 | grep -v "is ignored: it is neither" || true; "$vpy" -c "import torch" 2>/dev/null || skip "cannot install torch==2.13.0 into a fresh venv"
# the base dependencies at the lock's versions (setup.sh's): a new release cannot turn this red;
# KVTIER_UNLOCKED=1 resolves them against the index, as a user's `pip install kvtier` does
# (torch apart: the CPU build above is the one wanted, whatever local label the index gives it)
grep -v '^torch==' "$root/scripts/requirements.lock" >"$work/pins.txt"
pins=(-c "$work/pins.txt"); [ "${KVTIER_UNLOCKED:-0}" = 1 ] && pins=()
"$vpy" -m pip install -q --no-compile "${pins[@]}" "$wheel" 2>"$work/pip.log" || { cat "$work/pip.log" >&2; false; } || skip "cannot install the wheel's dependencies"
kv=$work/venv/bin/kvtier

echo "== kvtier --version"
(cd "$work" && "$kv" --version)
echo "== kvtier config validate (the packaged default)"
"$vpy" -c "from importlib import resources; print(resources.files('kvtier.daemon').joinpath('defaults/kvtier.toml').read_text(), end='')" >"$work/kvtier.toml"
(cd "$work" && "$kv" config validate "$work/kvtier.toml")

echo "== kvtier serve"
run=$work/run
# --config is given so that no config of this machine (KVTIER_CONFIG, ~/.config, /etc) is read
(cd "$work" && exec env -u KVTIER_CONFIG "$kv" serve --config "$work/kvtier.toml" \
    --set metrics.port=0 --set "server.runtime_dir=\"$run\"" --set "tiers.nvme_dir=\"$work/nvme\"" \
    >"$work/serve.log" 2>&1) &
daemon_pid=$!
for _ in $(seq 300); do
    [ -s "$run/daemon.json" ] && break
    kill -0 "$daemon_pid" 2>/dev/null || { cat "$work/serve.log" >&2; echo "daemon exited early" >&2; exit 1; }
    sleep 0.1
done
[ -s "$run/daemon.json" ] || { cat "$work/serve.log" >&2; echo "no daemon.json after 30 s" >&2; exit 1; }
"$vpy" - "$run/daemon.json" <<'EOF'
import json, sys, time, urllib.request
info = json.load(open(sys.argv[1]))
url = f"http://127.0.0.1:{info['metrics_port']}/healthz"
for _ in range(50):
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            print(f"GET {url}: {r.status}")
            sys.exit(0 if r.status == 200 else 1)
    except OSError as e:  # not yet published, or 503 (URLError/HTTPError are OSErrors)
        err = e
        time.sleep(0.1)
sys.exit(f"GET {url}: {err}")
EOF
kill -TERM "$daemon_pid"
rc=0
wait "$daemon_pid" || rc=$?
daemon_pid=
cat "$work/serve.log"
[ "$rc" = 0 ] || { echo "kvtier serve exited $rc after SIGTERM" >&2; exit 1; }
echo "check_wheel: OK"
