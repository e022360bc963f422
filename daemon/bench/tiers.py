"""Tier data-plane throughput vs raw memcpy and plain O_DIRECT I/O.

Every figure is measured in the same run, on the same bytes and block size:
the raw baselines are a single numpy copy of the whole buffer (memcpy) and a
sequential ``os.pwrite``/``os.preadv`` loop on an O_DIRECT file; the kvtier
figures go through ``TierManager`` and its mover. Raw and kvtier steps
alternate within every repetition, so drift on a noisy machine hits both
sides of a ratio alike. Ratios are what matter.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import numpy as np

from kvtier.tiers.aligned import aligned_empty
from kvtier.tiers.block_table import BlockTable
from kvtier.tiers.manager import TierManager
from kvtier.tiers.pools import DramPool
from kvtier.tiers.types import Tier

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-kib", type=int, nargs="+", default=[256, 2048], help="block sizes in KiB")
    p.add_argument("--total-mib", type=int, default=256, help="bytes moved per measurement")
    p.add_argument("--reps", type=int, default=5, help="repetitions, raw and kvtier alternating (median is reported)")
    p.add_argument("--nvme-dir", default=None, help="directory on the NVMe device (default: a temp dir)")
    p.add_argument("--io-backend", default="auto", help="auto | posix | kvikio")
    p.add_argument("--io-threads", type=int, default=8)
    p.add_argument("--batch", type=int, default=64, help="blocks per transfer descriptor")
    p.add_argument("--metadata-blocks", type=int, default=1_000_000)


def _batches(arr: np.ndarray, size: int) -> list[np.ndarray]:
    return [arr[i : i + size] for i in range(0, arr.size, size)]


class _RawODirect:
    """The baseline disk path: a sequential pwrite/preadv loop on one O_DIRECT file.

    ``shm``: the buffers are POSIX shared memory, as the DRAM tier's slots are. The
    kernel moves O_DIRECT data to and from shmem pages ~30% slower than anonymous
    pages on this kind of VM, a cost of the memory, not of kvtier; both baselines are
    reported and the ratios use the one with the tier's memory."""

    def __init__(self, directory: str, block: int, n: int, shm: bool = False) -> None:
        self.path = os.path.join(directory, f"raw-odirect{'-shm' if shm else ''}.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
        os.posix_fallocate(self.fd, 0, block * n)
        # one buffer per block, like the tier's slots: a single cache-hot buffer would
        # flatter the baseline with a memory footprint no real tier has
        self.pool = DramPool(n, block) if shm else None
        self.buf = self.pool.host_view_all() if self.pool is not None else aligned_empty(block * n)
        self.buf[:] = 7
        self.block, self.n = block, n

    def write(self) -> None:
        b = self.block
        for i in range(self.n):
            os.pwrite(self.fd, self.buf[i * b:(i + 1) * b], i * b)

    def read(self) -> None:
        b = self.block
        for i in range(self.n):
            os.preadv(self.fd, [self.buf[i * b:(i + 1) * b]], i * b)

    def close(self) -> None:
        os.close(self.fd)
        os.unlink(self.path)
        self.buf = None  # type: ignore[assignment]
        if self.pool is not None:
            self.pool.close()


def interleaved_figures(directory: str, block: int, n: int, reps: int, args: argparse.Namespace) -> dict[str, float]:
    """Raw baselines and mover paths measured alternately, rep by rep, so a noisy
    machine's drift hits both sides of every ratio alike."""
    m = TierManager(block, n, n, n, nvme_dir=os.path.join(directory, f"slabs-{block}"),
                    io_backend=args.io_backend, io_threads=args.io_threads, recover=False,
                    queue_depth=max(8, n // args.batch + 1))
    raw = _RawODirect(directory, block, n)
    raw_shm = _RawODirect(directory, block, n, shm=True)
    src = np.random.default_rng(0).integers(0, 255, block * n, dtype=np.uint8)
    dst = np.empty_like(src)
    try:
        blocks = m.alloc(n)
        assert blocks is not None
        payload = np.random.default_rng(1).integers(0, 255, block, dtype=np.uint8)
        for i, b in enumerate(blocks.tolist()):
            m.write(b, payload)
            m.seal(b, 1000 + i)

        def run(move: Callable[[np.ndarray], object]) -> None:
            for batch in _batches(blocks, args.batch):
                move(batch)
            m.wait()
            if m.last_errors:
                raise RuntimeError(f"transfer errors: {list(m.last_errors.values())[:3]}")

        def drop(tier: Tier) -> None:
            for b in blocks.tolist():
                m.drop_copy(b, tier)

        steps: list[tuple[str, Callable[[], None]]] = [  # blocks start each rep in HBM only
            ("memcpy", lambda: np.copyto(dst, src)),
            ("hbm_to_dram", lambda: run(lambda b: m.demote(b, Tier.HBM, Tier.DRAM))),  # -> DRAM only
            ("dram_to_hbm", lambda: run(lambda b: m.promote(b, Tier.HBM))),  # -> HBM + DRAM
            ("", lambda: drop(Tier.HBM)),  # -> DRAM only
            ("raw_odirect_write", raw.write),
            ("raw_odirect_write_shm", raw_shm.write),
            ("dram_to_nvme", lambda: run(lambda b: m.demote(b, Tier.DRAM, Tier.NVME))),  # -> NVMe only
            ("raw_odirect_read", raw.read),
            ("raw_odirect_read_shm", raw_shm.read),
            ("nvme_to_dram", lambda: run(lambda b: m.promote(b, Tier.DRAM))),  # -> DRAM + NVMe
            ("", lambda: (drop(Tier.NVME), run(lambda b: m.promote(b, Tier.HBM)), drop(Tier.DRAM))),
        ]
        times: dict[str, list[float]] = {name: [] for name, _ in steps if name}
        for rep in range(reps + 1):  # rep 0 is a warm-up: page faults and caches are not what we measure
            for name, fn in steps:
                t0 = time.perf_counter()
                fn()
                if name and rep:
                    times[name].append(time.perf_counter() - t0)
        total = block * n
        res: dict[str, float] = {f"{k}_gbps": total / statistics.median(v) / 1e9 for k, v in times.items()}
        res["nvme_direct_io"] = bool(m.nvme.direct) if m.nvme else False
        res["io_backend"] = m.backend.name
        m.check_invariants()
        return res
    finally:
        raw.close()
        raw_shm.close()
        m.close()


def metadata_bytes_per_block(n: int) -> float:
    """Worst case: every tier has as many slots as there are blocks."""
    return BlockTable(n, (n, n, n)).metadata_nbytes() / n


def run(args: argparse.Namespace) -> dict:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    tmp = None
    directory = args.nvme_dir
    if directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvtier-bench-", dir=os.environ.get("KVTIER_BENCH_DIR"))
        directory = tmp.name
    os.makedirs(directory, exist_ok=True)
    sizes = {}
    try:
        for kib in args.block_kib:
            block = kib * 1024
            n = max(4, args.total_mib * MiB // block)
            total = block * n
            with console.status(f"block {kib} KiB: raw baselines and kvtier mover, interleaved"):
                mv = interleaved_figures(directory, block, n, args.reps, args)
            memcpy, raw_w, raw_r = mv.pop("memcpy_gbps"), mv["raw_odirect_write_shm_gbps"], mv["raw_odirect_read_shm_gbps"]
            sizes[f"{kib}KiB"] = {
                "block_bytes": block, "blocks": n, "memcpy_gbps": memcpy,
                **mv,
                "ratios": {
                    "dram_copy": min(mv["hbm_to_dram_gbps"], mv["dram_to_hbm_gbps"]) / memcpy,
                    "nvme_write": mv["dram_to_nvme_gbps"] / raw_w,
                    "nvme_read": mv["nvme_to_dram_gbps"] / raw_r,
                },
            }
        meta = metadata_bytes_per_block(args.metadata_blocks)
    finally:
        if tmp is not None:
            tmp.cleanup()
    # headline ratios: the worse block size, so a target holds for both
    ratios = {k: min(s["ratios"][k] for s in sizes.values()) for k in ("dram_copy", "nvme_write", "nvme_read")}
    targets = {"dram_copy": 0.9, "nvme_write": 0.85, "nvme_read": 0.85}
    result = {
        "bench": "tiers", "ratios": ratios, "targets": targets,
        "metadata_bytes_per_block": meta, "metadata_blocks": args.metadata_blocks,
        "sizes": sizes, "ok": all(ratios[k] >= v for k, v in targets.items()) and meta <= 256,
    }
    table = Table(title="kvtier bench tiers: GB/s, ratios = kvtier / raw (same run; raw = memcpy, O_DIRECT pwrite/preadv)")
    for col in ("block", "memcpy", "hbm→dram", "dram→hbm", "raw w shm", "dram→nvme", "raw r shm", "nvme→dram",
                "dram_copy", "nvme_w", "nvme_r"):
        table.add_column(col, justify="right")
    for name, s in sizes.items():
        r = s["ratios"]
        table.add_row(name, f"{s['memcpy_gbps']:.2f}", f"{s['hbm_to_dram_gbps']:.2f}", f"{s['dram_to_hbm_gbps']:.2f}",
                      f"{s['raw_odirect_write_shm_gbps']:.2f}", f"{s['dram_to_nvme_gbps']:.2f}",
                      f"{s['raw_odirect_read_shm_gbps']:.2f}", f"{s['nvme_to_dram_gbps']:.2f}",
                      f"{r['dram_copy']:.2f}", f"{r['nvme_write']:.2f}", f"{r['nvme_read']:.2f}")
    Console().print(table)
    Console().print(f"metadata: {meta:.1f} B/block at {args.metadata_blocks:,} blocks (target ≤ 256); "
                    f"backend {next(iter(sizes.values()))['io_backend']}; verdict: {'PASS' if result['ok'] else 'BELOW TARGET'}")
    return result
