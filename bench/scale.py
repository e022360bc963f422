"""How the daemon's per-op cost grows with the blocks it tracks (10^5 .. 10^7) and the engines attached.

For each block count N a real daemon process starts over an NVMe tier of N
slots that a clean stop left: the slab files are sparse (their size is set,
their bytes are not written, so 10^7 slots cost no disk) and the slot index
lists N sealed blocks, which the daemon adopts at its first register as
cached NVMe blocks, exactly as after a restart. The block table, key index,
lists, policies, predictor, prefetcher and sessions are then full size, and N
keys are indexed. Only the first ``--real-blocks`` slots hold real payloads
with their checksums: the ones engines acquire "missing" (promoted NVMe -> HBM
and verified). Metadata only: slots are one page, engines never write bytes.

Then 1, 4 and 16 engine processes (all registered for the whole run) cycle
alloc -> seal -> release -> acquire (resident) -> release -> free, plus an
acquire of recovered blocks that are on NVMe only, and time every round trip.
Reported per N and engine count: ops/s and p50/p99 latency per op, the
daemon's RSS and CPU. ``max_per_op_growth`` is the largest ratio of p50
latency at the largest N to the smallest, over all ops and engine counts.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from kvtier.bench.args import positive_float, positive_int

from .scale_worker import OPS

BLOCK = 4096
FIRST_KEY = 1 << 62  # recovered keys: FIRST_KEY + i (engines seal keys below 2^48)
WORKER = "from kvtier.bench.scale_worker import main; main()"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=positive_float, nargs="+", default=[1e5, 1e6, 1e7], help="blocks tracked by the daemon")
    p.add_argument("--engines", type=positive_int, nargs="+", default=[1, 4, 16], help="engine process counts")
    p.add_argument("--seconds", type=positive_float, default=4.0, help="measured seconds per (blocks, engines) point")
    p.add_argument("--batch", type=positive_int, default=16, help="blocks per request")
    p.add_argument("--real-blocks", type=positive_int, default=32768,
                   help="recovered blocks with real payloads (the ones acquired missing)")
    p.add_argument("--hbm-slots", type=positive_int, default=8192)
    p.add_argument("--dram-slots", type=positive_int, default=8192)
    p.add_argument("--metadata-blocks", type=positive_int, default=1_000_000, help="blocks of the metadata walk")
    p.add_argument("--plot", metavar="PNG", help="per-op p50 latency against blocks, one line per op")
    p.add_argument("--dir", default=None, help="where the slabs go (default: $KVTIER_BENCH_DIR or /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the daemon's directory")


def prepare_slabs(nvme_dir: Path, n_slots: int, n: int, real: int) -> float:
    """Sparse slabs of ``n_slots`` one-page slots, the first ``n`` listed in a clean stop's
    slot index as sealed blocks, the last ``real`` of those written with payloads (last:
    recovered blocks enter NVMe's eviction order by slot, and the ones engines will
    acquire must not be the first dropped). Returns the seconds it took."""
    from kvtier.kernels.checksum import block_checksum
    from kvtier.tiers.io_backends import PosixBackend
    from kvtier.tiers.nvme import NvmeStore
    from kvtier.tiers.pools import round_up
    from kvtier.tiers.slab_layout import SlabLayout
    from kvtier.tiers.slot_index import sealed_entries, write_index

    t0 = time.perf_counter()
    nvme_dir.mkdir(mode=0o700, parents=True)
    per_file = 65536  # the geometry the daemon's store uses
    layout = SlabLayout(n_slots, round_up(BLOCK), per_file)
    for i in range(layout.n_files):  # sized, not allocated: the store opens them without preallocating
        with open(nvme_dir / f"slab-{i:04d}.kvt", "wb") as f:
            f.truncate(layout.file_bytes(i))
    backend = PosixBackend(threads=8)
    store = NvmeStore(str(nvme_dir), n_slots, BLOCK, backend, slots_per_file=per_file)
    try:
        rng = np.random.default_rng(0)
        sums = np.zeros(n, dtype=np.uint64)
        payload = rng.integers(0, 256, (min(real, n), BLOCK), dtype=np.uint8)
        futs = []
        for j in range(payload.shape[0]):
            i = n - payload.shape[0] + j
            sums[i] = block_checksum(payload[j], BLOCK)
            futs.append(store.write(i, payload[j], FIRST_KEY + i, BLOCK, int(sums[i]), True))
        for fut in futs:
            fut.result()
        store.sync()
        slots = np.arange(n, dtype=np.int64)
        write_index(store, sealed_entries(slots, np.uint64(FIRST_KEY) + slots.astype(np.uint64),
                                          np.full(n, BLOCK, dtype=np.uint64), sums))
    finally:
        store.close()
        backend.shutdown()
    return time.perf_counter() - t0


def _proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, RSS in KiB) of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return cpu, rss


def _summary(lats: list[float], seconds: float) -> dict[str, float]:
    if not lats:
        return {"count": 0, "ops_per_s": 0.0, "p50_us": float("nan"), "p99_us": float("nan")}
    a = np.asarray(lats) * 1e6
    return {"count": int(a.size), "ops_per_s": a.size / seconds, "p50_us": float(np.percentile(a, 50)),
            "p99_us": float(np.percentile(a, 99))}


def measure_blocks(root: Path, n: int, args: argparse.Namespace, status: Any) -> dict[str, Any]:
    from kvtier.bench.spawn import DaemonProcess

    real = min(args.real_blocks, n)
    hbm, dram = args.hbm_slots, args.dram_slots
    # free NVMe slots for what the engines' blocks spill there: a full tier would drop
    # recovered blocks to make room, the ones acquired "missing" among them
    nvme = n + 4 * (hbm + dram)
    status.update(f"{n:,} blocks: writing sparse slabs and the slot index")
    prep_s = prepare_slabs(root / "nvme", nvme, n, real)
    d = DaemonProcess(root, f"tiers.hbm_bytes={hbm * BLOCK}", f"tiers.dram_bytes={dram * BLOCK}",
                      f"tiers.nvme_bytes={nvme * BLOCK}", f"tiers.max_blocks={nvme + hbm + dram}",
                      'tiers.recovery_verify="header"', 'tiers.io_backend="posix"', "server.heartbeat_timeout_s=120",
                      f"server.max_batch_blocks={max(1024, args.batch)}")
    procs: list[subprocess.Popen] = []
    out: dict[str, Any] = {"blocks": n, "prepare_s": prep_s, "engines": {}}
    try:
        status.update(f"{n:,} blocks: first register (the daemon adopts the index)")
        ctl = d.client(engine_id="scale-ctl", heartbeat_s=None, timeout_s=600)
        t0 = time.perf_counter()
        ctl.register(block_bytes=BLOCK)
        out["register_s"] = time.perf_counter() - t0
        out["rss_kb_after_register"] = _proc_stat(d.proc.pid)[1]
        recovered = ctl.stats().get("io", {}).get("recovered_blocks")
        out["recovered_blocks"] = recovered
        status.update(f"{n:,} blocks: starting {max(args.engines)} engine processes")
        procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(d.runtime_dir), str(i), str(BLOCK),
                                   str(args.batch), str(FIRST_KEY)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for i in range(max(args.engines))]
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"an engine process failed to register: {d.read_log()[-2000:]}")
        next_key = 0
        for e in args.engines:
            status.update(f"{n:,} blocks, {e} engines: {args.seconds:g} s of op cycles")
            share = max(0, (real - next_key) // (e * len(args.engines)))
            cpu0, _ = _proc_stat(d.proc.pid)
            t0 = time.perf_counter()
            for i, p in enumerate(procs[:e]):
                assert p.stdin is not None
                p.stdin.write(f"go {args.seconds} {n - real + next_key + i * share} {share}\n")
                p.stdin.flush()
            results = []
            for p in procs[:e]:
                assert p.stdout is not None
                line = p.stdout.readline()
                if not line:
                    raise RuntimeError(f"an engine process died: {d.read_log()[-2000:]}")
                results.append(json.loads(line))
            wall = time.perf_counter() - t0
            cpu1, rss = _proc_stat(d.proc.pid)
            next_key += e * share
            seconds = max(r["seconds"] for r in results)
            ops = {op: _summary([x for r in results for x in r["lat"][op]], seconds) for op in OPS}
            out["engines"][str(e)] = {"ops": ops, "cycles": sum(r["cycles"] for r in results),
                                      "daemon_cpu_cores": (cpu1 - cpu0) / wall, "daemon_rss_kb": rss}
        with d.client(engine_id="scale-check", heartbeat_s=None, timeout_s=600) as c:
            t0 = time.perf_counter()
            c.check()  # every invariant, over every block: a full scan, timed for the record
            out["check_s"] = time.perf_counter() - t0
    finally:
        for p in procs:
            if p.poll() is None and p.stdin is not None:
                try:
                    p.stdin.write("quit\n")
                    p.stdin.close()
                except OSError:
                    pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        status.update(f"{n:,} blocks: stopping the daemon (a clean stop writes the slot index)")
        t0 = time.perf_counter()
        out["daemon_exit_code"] = d.stop(timeout=120)
        out["stop_s"] = time.perf_counter() - t0
    return out


def growth(points: list[dict[str, Any]]) -> dict[str, dict[str, Optional[float]]]:
    """Per engine count and op: p50 latency at the largest N over the smallest."""
    lo, hi = points[0], points[-1]
    out: dict[str, dict[str, Optional[float]]] = {}
    for e, row in lo["engines"].items():
        out[e] = {}
        for op, s in row["ops"].items():
            top = hi["engines"][e]["ops"][op]
            ok = s["count"] and top["count"]
            out[e][op] = top["p50_us"] / s["p50_us"] if ok else None
    return out


def plot(points: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = list(points[0]["engines"])
    fig, axes = plt.subplots(1, len(engines), figsize=(5 * len(engines), 4), sharey=True, squeeze=False)
    xs = [p["blocks"] for p in points]
    for ax, e in zip(axes[0], engines):
        for op in OPS:
            ys = [p["engines"][e]["ops"][op]["p50_us"] for p in points]
            ax.plot(xs, ys, marker="o", label=op)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("blocks tracked")
        ax.set_title(f"{e} engine process{'es' if e != '1' else ''}")
    axes[0][0].set_ylabel("p50 round trip (µs)")
    axes[0][-1].legend(fontsize=8)
    fig.suptitle("kvtier bench scale: per-op latency vs blocks tracked")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from kvtier.bench.metadata import report as metadata_report

    blocks = sorted({int(b) for b in args.blocks})
    if not blocks or blocks[0] < 1 or min(args.engines) < 1 or args.seconds <= 0 or args.batch < 1:
        raise ValueError("--blocks, --engines, --seconds and --batch must be positive")
    if args.plot:  # before minutes of measuring, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError("--plot needs matplotlib: pip install 'kvtier[plot]'") from None
    con = Console(stderr=True)
    t_start = time.perf_counter()
    points = []
    with con.status("bench scale") as status:
        for n in blocks:
            root = Path(tempfile.mkdtemp(prefix="kvtier-bench-scale-", dir=args.dir or os.environ.get("KVTIER_BENCH_DIR")))
            try:
                points.append(measure_blocks(root, n, args, status))
            finally:
                if args.keep:
                    con.print(f"kept {root}")
                else:
                    shutil.rmtree(root, ignore_errors=True)
        status.update(f"metadata walk at {args.metadata_blocks:,} blocks")
        meta = metadata_report(args.metadata_blocks, engines=max(args.engines))
    g = growth(points)
    worst = max((v for row in g.values() for v in row.values() if v is not None), default=None)
    result = {
        "bench": "scale", "blocks": blocks, "engine_counts": args.engines, "batch": args.batch,
        "seconds_per_point": args.seconds, "points": points, "per_op_growth": g, "max_per_op_growth": worst,
        "metadata_bytes_per_block_all": meta["metadata_bytes_per_block_all"], "metadata": meta,
        "targets": {"max_per_op_growth": 2.0, "metadata_bytes_per_block_all": 256},
        "wall_s": time.perf_counter() - t_start,
    }
    result["ok"] = bool(worst is not None and worst <= 2.0 and meta["metadata_bytes_per_block_all"] <= 256)
    table = Table(title=f"kvtier bench scale: p50 / p99 µs per request of {args.batch} blocks")
    table.add_column("blocks")
    table.add_column("engines", justify="right")
    for op in OPS:
        table.add_column(op, justify="right")
    table.add_column("daemon CPU, RSS", justify="right")
    for p in points:
        for e, row in p["engines"].items():
            table.add_row(f"{p['blocks']:,}", e, *(f"{row['ops'][op]['p50_us']:.0f} / {row['ops'][op]['p99_us']:.0f}"
                                                   for op in OPS),
                          f"{row['daemon_cpu_cores']:.2f}, {row['daemon_rss_kb'] / 1024:.0f} MiB")
    Console().print(table)
    Console().print(f"max per-op growth {blocks[0]:,} -> {blocks[-1]:,} blocks: "
                    f"{'n/a' if worst is None else f'{worst:.2f}x'} (target ≤ 2); metadata "
                    f"{meta['metadata_bytes_per_block_all']:.0f} B/block at {args.metadata_blocks:,} (target ≤ 256); "
                    f"{result['wall_s']:.0f} s; verdict: {'PASS' if result['ok'] else 'BELOW TARGET'}")
    if args.plot:
        plot(points, args.plot)
    return result
