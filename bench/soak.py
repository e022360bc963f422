"""Soak: N engine processes x M minutes of random ops on a real daemon, every byte verified.

Each engine process writes blocks whose bytes are a function of (engine, key),
seals them (some keys shared by every engine, so prefixes fold), releases,
re-acquires and checks every byte of what comes back, frees old sequences, and
counts what went wrong. The daemon runs small tiers, so blocks keep moving
HBM <-> DRAM <-> NVMe; with ``--faults`` its NVMe backend fails writes, fails
reads and corrupts reads now and then. The daemon's RSS is sampled every
second; its slope after the first fifth of the run (at most a minute) is what
shows an unbounded structure. Targets: 0 mismatches, 0 lost live blocks, RSS
slope < 1 KB/s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvtier.bench.args import positive_float, positive_int

BB = 16384
WORKER = "from kvtier.bench.soak_worker import main; main()"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engines", type=positive_int, default=4, help="engine processes")
    p.add_argument("--minutes", type=positive_float, default=5.0, help="how long they run")
    p.add_argument("--faults", action="store_true", help="NVMe writes and reads fail or corrupt now and then")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the daemon's directory (logs, slabs)")


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _rss_by_kind_kb(pid: int) -> dict[str, int]:
    """Resident KB by mapping kind (heap, anonymous, shared memory, files): which
    kind grows says whether a slope is Python objects, allocator arenas or pool pages."""
    kinds: dict[str, int] = {}
    kind = "anon"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            head = line.split(maxsplit=6)
            if "-" in head[0] and len(head) >= 5:  # a mapping's first line: range perms offset dev inode [path]
                path = head[5].strip() if len(head) > 5 else ""
                kind = ("shm" if path.startswith("/dev/shm") else "heap" if path == "[heap]"
                        else "anon" if not path or path.startswith("[anon") else "stack" if "stack" in path
                        else "file")
            elif head[0] == "Rss:":
                kinds[kind] = kinds.get(kind, 0) + int(head[1])
    return kinds


def _slope_kb_per_s(samples: list[tuple[float, int]], skip_s: float) -> float:
    pts = [(t, r) for t, r in samples if t >= skip_s]
    if len(pts) < 3:
        return float("nan")
    t = np.array([p[0] for p in pts])
    r = np.array([p[1] for p in pts], dtype=np.float64)
    return float(np.polyfit(t, r, 1)[0])


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    from kvtier.bench.spawn import DaemonProcess

    if args.engines < 1 or args.minutes <= 0:
        raise ValueError("--engines must be >= 1 and --minutes > 0")
    con = Console(stderr=True)
    seconds = args.minutes * 60
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-soak-"))
    env = {"KVTIER_FAULTS": "fail_writes=40,fail_reads=40,corrupt_reads=40,mode=eio"} if args.faults else {}
    d = DaemonProcess(root, f"tiers.hbm_bytes={96 * BB}", f"tiers.dram_bytes={96 * BB}", f"tiers.nvme_bytes={1024 * BB}",
                      f'tiers.io_backend="{"faulty" if args.faults else "auto"}"', "server.heartbeat_timeout_s=30",
                      env=env)
    samples: list[tuple[float, int]] = []
    by_kind: list[tuple[float, dict[str, int]]] = []
    try:
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(d.runtime_dir), str(i), str(seconds),
                                   str(args.seed)], stdout=subprocess.PIPE, text=True)
                 for i in range(args.engines)]
        t0 = time.monotonic()
        with con.status(f"soak: {args.engines} engines for {args.minutes:g} min") as status:
            while any(p.poll() is None for p in procs):
                now = time.monotonic() - t0
                samples.append((now, _rss_kb(d.proc.pid)))
                if len(samples) % 10 == 1:
                    by_kind.append((now, _rss_by_kind_kb(d.proc.pid)))
                status.update(f"soak: {now:.0f}/{seconds:.0f} s, daemon RSS {samples[-1][1] / 1024:.1f} MiB")
                time.sleep(1.0)
        results = []
        for p in procs:
            text, _ = p.communicate()
            lines = [ln for ln in text.splitlines() if ln.startswith("{")]
            results.append(json.loads(lines[-1]) if lines else {"crashed": True, "returncode": p.returncode})
        with d.client(engine_id="soak-check", heartbeat_s=None) as c:
            c.check()
            stats = c.stats()
    finally:
        rc = d.stop()
    total = {k: sum(int(r.get(k, 0)) for r in results) for k in ("ops", "mismatches", "lost_live_blocks", "errors",
                                                                    "verified_blocks")}
    crashed = sum(1 for r in results if r.get("crashed"))
    skip = min(60.0, seconds / 5)
    slope = _slope_kb_per_s(samples, skip)
    out = {
        "bench": "soak", "engines": args.engines, "minutes": args.minutes, "faults": args.faults,
        "ops_per_s": total["ops"] / seconds, "mismatches": total["mismatches"],
        "lost_live_blocks": total["lost_live_blocks"], "errors": total["errors"],
        "verified_blocks": total["verified_blocks"], "engines_crashed": crashed, "daemon_exit_code": rc,
        "rss_slope_kb_per_s": slope, "rss_skip_s": skip, "rss_kb_first": samples[0][1] if samples else 0,
        "rss_kb_last": samples[-1][1] if samples else 0, "rss_samples": samples,
        "rss_by_kind_kb": by_kind,
        "daemon_errors": {k: v for k, v in stats.get("paths", {}).items() if v.get("errors")},
        "per_engine": results,
        "targets": {"mismatches": 0, "lost_live_blocks": 0, "rss_slope_kb_per_s_max": 1.0},
    }
    out["ok"] = bool(out["mismatches"] == 0 and out["lost_live_blocks"] == 0 and crashed == 0 and rc == 0
                     and slope < 1.0)
    con.print(f"ops/s {out['ops_per_s']:.0f}  verified blocks {total['verified_blocks']}  mismatches "
              f"{out['mismatches']}  lost live blocks {out['lost_live_blocks']}  errors {out['errors']}  "
              f"RSS slope {slope:.2f} KB/s  verdict: {'PASS' if out['ok'] else 'BELOW TARGET'}")
    if not args.keep:
        import shutil

        shutil.rmtree(root, ignore_errors=True)
    return out
