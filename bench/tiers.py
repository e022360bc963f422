"""Tier data-plane throughput vs the fastest raw copies and O_DIRECT I/O this machine does.

Every figure is measured in the same run, on the same bytes and block size:
the raw baselines (``baselines.py``) are memory copies between two POSIX
shared-memory buffers, the memory both pools are made of (one numpy copy,
torch's multi-threaded copy, a pool of threads, the mover's chunked copy with the loop the
daemon's start chose, ``tiers.copy_loop``), and O_DIRECT I/O at queue
depth 1 and from as many threads as the I/O backend has (a Python call a block,
and each thread's share in one call of the backend's compiled loop); each ratio divides
by the best of its baselines. The kvtier figures go through ``TierManager``
and its mover. Raw and kvtier steps
alternate within every repetition, so drift on a noisy machine hits both
sides of a ratio alike. Ratios are what matter.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, Callable

import numpy as np

from kvtier.bench.args import positive_int
from kvtier.daemon.config import load_config
from kvtier.daemon.node import attach_deciders
from kvtier.kernels.checksum import block_checksum
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import Tier

from .baselines import COMPILED_IO, COPY_BASELINES, READ_BASELINES, WRITE_BASELINES, RawODirect, ShmCopy, best
from .gpu_baselines import GPU_RATIOS, GpuBaselines, gpu_reasons
from .intervals import LEVEL, median_ratio_interval, rep_ratios
from .tiers_headlines import HEADLINE_STEPS, HEADS, TARGETS, step_ratios

MiB = 1 << 20
# pause before each timed step: torch's OpenMP threads spin ~5-10 ms of a core after
# a copy returns (measured here), so the step after ``torch_copy_tier`` lost a core
# for its first milliseconds; a third of the dram_copy shortfall was that, not kvtier
SETTLE_S = 0.03


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-kib", type=positive_int, nargs="+", default=[256, 2048], help="block sizes in KiB")
    p.add_argument("--total-mib", type=positive_int, default=256, help="bytes moved per measurement")
    p.add_argument("--reps", type=positive_int, default=6,
                   help="repetitions; raw and kvtier run back to back, each first in every other rep (median per-rep ratio)")
    p.add_argument("--copy-rounds", type=positive_int, default=3,
                   help="HBM<->DRAM copy measurements per repetition (cheap, and the noisiest figure)")
    p.add_argument("--nvme-dir", default=None, help="directory on the NVMe device; the bench works in a temp "
                                                    "dir inside it (default: in $KVTIER_BENCH_DIR or /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the temp dir (slab and raw O_DIRECT files)")
    p.add_argument("--io-backend", default="auto", choices=("auto", "posix", "kvikio"), help="auto | posix | kvikio")
    p.add_argument("--io-threads", type=positive_int, default=8)
    p.add_argument("--batch-mib", type=positive_int, default=64,
                   help="bytes per transfer descriptor, in MiB (the daemon demotes a watermark's worth of "
                        "blocks in one descriptor; 64 MiB = 256 blocks of 256 KiB or 32 of 2 MiB)")
    p.add_argument("--metadata-blocks", type=positive_int, default=1_000_000)
    p.add_argument("--one-process", action="store_true",
                   help="measure every block size in this process, one after another (before 2026-12-08 "
                        "the only way; the size measured second read lower): by default each gets a process")


def _batches(arr: np.ndarray, size: int) -> list[np.ndarray]:
    return [arr[i : i + size] for i in range(0, arr.size, size)]


def interleaved_figures(directory: str, block: int, n: int, reps: int, args: argparse.Namespace) -> dict[str, Any]:
    """Raw baselines and mover paths measured alternately, rep by rep, so a noisy
    machine's drift hits both sides of every ratio alike."""
    per_batch = max(1, args.batch_mib * MiB // block)
    m = TierManager(block, n, n, n, nvme_dir=os.path.join(directory, f"slabs-{block}"),
                    io_backend=args.io_backend, io_threads=args.io_threads, recover=False,
                    queue_depth=max(8, n // per_batch + 1))
    # the daemon's deciders listen to every move, as in a running daemon: applying a completion
    # runs their per-block listeners on the owner thread (a bare manager had none: 13-26% of a copy)
    node = attach_deciders(load_config(environ={}), m, block)
    if m.dram.block_bytes != block or m.dram.host_view_all().nbytes < block * n:
        raise RuntimeError("the DRAM pool's slots are not one contiguous run of blocks")
    raw = RawODirect(directory, "anon", block, n)
    raw_tier = RawODirect(directory, "tier", block, n, m.dram.host_view_all()[: block * n], threads=args.io_threads)
    src = np.random.default_rng(0).integers(0, 255, block * n, dtype=np.uint8)
    dst = np.empty_like(src)
    shm = ShmCopy(block * n)
    reasons = gpu_reasons(m)
    gpu = None if "h2d" in reasons else GpuBaselines(directory, block, n, "kvikio_read" not in reasons)
    try:
        blocks = m.alloc(n)
        assert blocks is not None
        payload = np.random.default_rng(1).integers(0, 255, block, dtype=np.uint8)
        for i, b in enumerate(blocks.tolist()):
            m.write(b, payload)
            m.seal(b, 1000 + i)

        def run(move: Callable[[np.ndarray], object]) -> None:
            for batch in _batches(blocks, per_batch):
                move(batch)
            m.wait()
            node.events.take_batch()  # each daemon loop encodes the KV events of what moved
            if m.last_errors:
                raise RuntimeError(f"transfer errors: {list(m.last_errors.values())[:3]}")

        def drop(tier: Tier) -> None:
            for b in blocks.tolist():
                if m.table.has_copy(b, int(tier)):
                    m.drop_copy(b, tier)

        def reset() -> None:  # back to HBM only, wherever the blocks are
            run(lambda b: m.promote(b, Tier.HBM))
            drop(Tier.DRAM)
            drop(Tier.NVME)

        # blocks start each rep in HBM only. Each ratio's raw and kvtier steps run back
        # to back, and which of the two goes first alternates by rep: a virtual disk's
        # host-side cache fills during a burst of writes and throttles whatever comes
        # next, so a fixed order would charge that to one side. The raw read lands in
        # the DRAM slots, so it runs only while no block has a DRAM copy.
        def pair(rep: int, raw_step: tuple, ours: tuple) -> list:
            return [raw_step, ours] if rep % 2 == 0 else [ours, raw_step]

        # every slot holds ``payload``, and so does the raw file written from them: the verified
        # raw read checks each block against its checksum, as kvtier's reads do (not a baseline)
        verify_as = int(block_checksum(payload, block))
        raw_reads = [("raw_odirect_read_tier", raw_tier.read), ("raw_odirect_read_tier_qd", raw_tier.read_qd),
                     *([("raw_odirect_read_tier_qd_c", raw_tier.read_qd_c),
                        ("raw_odirect_read_tier_qd_c_verified", lambda: raw_tier.read_qd_c_verified(verify_as))]
                       if COMPILED_IO else [])]
        nvme_read = ("nvme_to_dram", lambda: run(lambda b: m.promote(b, Tier.DRAM)))  # -> DRAM + NVMe

        def copy_round(i: int) -> list[tuple[str, Callable[[], object]]]:  # HBM only -> HBM only
            return [
                *pair(i, ("memcpy_tier", shm.memcpy),
                      ("hbm_to_dram", lambda: run(lambda b: m.demote(b, Tier.HBM, Tier.DRAM)))),  # -> DRAM only
                *pair(i, ("dram_to_hbm", lambda: run(lambda b: m.promote(b, Tier.HBM))),  # -> HBM + DRAM
                      ("torch_copy_tier", shm.torch_copy)),
                ("threads_copy_tier", shm.threads_copy),
                ("chunks_copy_tier", shm.chunks_copy),
                *([("raw_d2h", gpu.d2h), ("raw_h2d", gpu.h2d)] if gpu is not None else []),
                ("", lambda: drop(Tier.DRAM)),
            ]

        def gpu_io(rep: int) -> list[tuple[str, Callable[[], object]]]:  # HBM only -> HBM only
            if gpu is None or gpu.file is None:
                return []
            return [*pair(rep, ("raw_kvikio_write", gpu.kvikio_write),
                          ("hbm_to_nvme", lambda: run(lambda b: m.demote(b, Tier.HBM, Tier.NVME)))),
                    *pair(rep, ("raw_kvikio_read", gpu.kvikio_read),
                          ("nvme_to_hbm", lambda: run(lambda b: m.promote(b, Tier.HBM)))),
                    ("", lambda: drop(Tier.NVME))]

        def steps(rep: int) -> list[tuple[str, Callable[[], object]]]:
            reads = [*raw_reads, nvme_read] if rep % 2 == 0 else [nvme_read, ("", lambda: drop(Tier.DRAM)), *raw_reads]
            rounds = args.copy_rounds
            return [
                # memory copies are cheap to repeat and the noisiest figure: several rounds a rep
                *(step for i in range(rounds) for step in copy_round(rep * rounds + i)),
                ("", lambda: run(lambda b: m.demote(b, Tier.HBM, Tier.DRAM))),  # -> DRAM only
                *pair(rep, ("raw_odirect_write_tier", raw_tier.write),
                      ("dram_to_nvme", lambda: run(lambda b: m.demote(b, Tier.DRAM, Tier.NVME)))),  # -> NVMe only
                ("raw_odirect_write_tier_qd", raw_tier.write_qd),
                *([("raw_odirect_write_tier_qd_c", raw_tier.write_qd_c)] if COMPILED_IO else []),
                *reads,
                ("memcpy", lambda: np.copyto(dst, src)),  # anonymous-memory baselines: reported, not in ratios
                ("raw_odirect_write", raw.write),
                ("raw_odirect_read", raw.read),
                ("", reset),
                *gpu_io(rep),
            ]

        times: dict[str, list[float]] = {name: [] for name, _ in steps(0) if name}
        for rep in range(reps + 1):  # rep 0 is a warm-up: page faults and caches are not what we measure
            for name, fn in steps(rep):
                if name:
                    time.sleep(SETTLE_S)  # the previous step's leftover CPU is not this step's cost
                t0 = time.perf_counter()
                took = fn()  # a GPU baseline returns its CUDA-event time
                if name and rep:
                    times[name].append(took if isinstance(took, float) else time.perf_counter() - t0)
        total = block * n
        res: dict[str, Any] = {f"{k}_gbps": total / statistics.median(v) / 1e9 for k, v in times.items()}
        # each ratio is the median of per-rep ratios: a rep's raw and kvtier steps ran
        # back to back, so they saw the same machine
        per_rep = lambda ours, raw_: statistics.median(rep_ratios(times, ours, raw_))
        names = {"dram_copy": COPY_BASELINES, "nvme_write": WRITE_BASELINES, "nvme_read": READ_BASELINES}
        # every baseline's ratio; the headline divides by the fastest (smallest median time)
        against = {k: {x: min(per_rep(o, x) for o in HEADLINE_STEPS[k]) for x in v} for k, v in names.items()}
        res["best_baseline"] = {k: best(times, v) for k, v in names.items()}
        res["ratios"] = {k: against[k][res["best_baseline"][k]] for k in names}
        res["ratios_by_step"] = {k: {o: per_rep(o, res["best_baseline"][k]) for o in HEADLINE_STEPS[k]}
                                 for k in names}  # the headline is the worse step (e.g. of two copy directions)
        res["ratio_intervals"] = {k: list(median_ratio_interval(step_ratios(times, k, res["best_baseline"][k])))
                                  for k in names}
        res["ratios_by_baseline"] = against
        res["ratios_old_baseline"] = {k: against[k][v[0]] for k, v in names.items()}  # one numpy copy; QD1 I/O
        res["baseline_threads"] = {"copy": shm.threads, "io": raw_tier.threads}
        if COMPILED_IO:  # how much of the read gap is the checksum every kvtier read is verified against
            verified = "raw_odirect_read_tier_qd_c_verified"
            res["read_verification"] = {"raw_verified_vs_raw": per_rep(verified, "raw_odirect_read_tier_qd_c"),
                                        "nvme_read_vs_raw_verified": per_rep("nvme_to_dram", verified)}
        ours = {"h2d": ("dram_to_hbm", "raw_h2d"), "d2h": ("hbm_to_dram", "raw_d2h"),
                "kvikio_read": ("nvme_to_hbm", "raw_kvikio_read"), "kvikio_write": ("hbm_to_nvme", "raw_kvikio_write")}
        for k, (mine, raw_name) in ours.items():
            res["ratios"][k] = None if k in reasons else per_rep(mine, raw_name)
        res["ratio_reasons"] = reasons
        res["samples_s"] = times  # every repetition, for anyone re-deriving a ratio
        run(lambda b: m.demote(b, Tier.HBM, Tier.NVME))  # on disk at the clean stop: recovery_figures restarts
        res["nvme_direct_io"] = bool(m.nvme.direct) if m.nvme else False
        res["io_backend"] = m.backend.name
        res["copy_loop"] = dataclasses.asdict(m.copy_loop)  # the loop both the mover and chunks_copy_tier took
        m.check_invariants()
        return res
    finally:
        raw.close()
        raw_tier.close()
        shm.close()
        if gpu is not None:
            gpu.close()
        m.close()


def recovery_figures(directory: str, block: int, n: int, args: argparse.Namespace) -> dict[str, float]:
    """Restart cost on the slabs the run left behind: a start from the index a clean
    stop leaves, then a full scan (every payload read and checksummed) against a
    header-only scan (``tiers.recovery_verify``)."""
    out: dict[str, float] = {}
    slabs = os.path.join(directory, f"slabs-{block}")
    t0 = time.perf_counter()
    m = TierManager(block, 1, 1, n, nvme_dir=slabs, io_backend=args.io_backend, io_threads=args.io_threads,
                    recover_payloads=False)
    out["recovery_index_s"] = time.perf_counter() - t0  # the whole start, pools and threads included
    out["recovery_index_blocks"] = m.recovered if m.recovered_from == "index" else 0
    m.close()
    for mode, verify in (("payload", True), ("header", False)):
        m = TierManager(block, 1, 1, n, nvme_dir=slabs, io_backend=args.io_backend, io_threads=args.io_threads,
                        recover=False)
        try:
            t0 = time.perf_counter()
            assert m.nvme is not None  # built with NVMe slots
            found, _ = m.nvme.recover(verify_payload=verify)
            out[f"recovery_{mode}_s"] = time.perf_counter() - t0
            out[f"recovery_{mode}_blocks"] = len(found)
        finally:
            m.close()
    return out


def _size_figures_here(directory: str, block: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    mv = interleaved_figures(directory, block, n, args.reps, args)
    mv.update(recovery_figures(directory, block, n, args))
    return mv


def size_figures(directory: str, block: int, n: int, args: argparse.Namespace) -> dict[str, Any]:
    """One block size's figures, measured in a fresh process (spawned, as a daemon builds its
    tiers once a process) unless ``--one-process``. Measured in one process, the size that
    went second read 0.03-0.06 lower whichever it was (pooled over runs; docs/benchmarks.md,
    2026-12-08): a state the first manager leaves in the process, not found, that no daemon has."""
    if args.one_process:
        return _size_figures_here(directory, block, n, args)
    options = argparse.Namespace(**{k: v for k, v in vars(args).items() if not callable(v)})  # (the CLI's func)
    # (an executor, not a Pool: a child killed mid-run raises BrokenProcessPool here, a Pool waits forever)
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as child:
        try:
            return child.submit(_size_figures_here, directory, block, n, options).result()
        except BrokenProcessPool:
            raise ChildProcessError(f"block {block >> 10} KiB: the process measuring it died (killed, or out of "
                               "memory); --one-process measures in this one") from None


def run(args: argparse.Namespace) -> dict:
    from rich.console import Console
    from rich.table import Table

    from kvtier.bench.metadata import report as metadata_report

    console = Console(stderr=True)
    # the files go in a temp dir of our own, inside --nvme-dir when given: nothing of the run is left
    # behind (a --nvme-dir the bench had to create goes too) unless --keep
    made = args.nvme_dir is not None and not os.path.exists(args.nvme_dir)
    if args.nvme_dir is not None:
        os.makedirs(args.nvme_dir, exist_ok=True)
    directory = tempfile.mkdtemp(prefix="kvtier-bench-", dir=args.nvme_dir or os.environ.get("KVTIER_BENCH_DIR"))
    sizes = {}
    try:
        for kib in args.block_kib:
            block = kib * 1024
            n = max(4, args.total_mib * MiB // block)
            where = "in this process" if args.one_process else "in a process of its own"
            with console.status(f"block {kib} KiB: raw baselines and kvtier mover, interleaved, {where}"):
                mv = size_figures(directory, block, n, args)
            sizes[f"{kib}KiB"] = {"block_bytes": block, "blocks": n, **mv}
        with console.status(f"metadata of a running daemon at {args.metadata_blocks:,} blocks"):
            meta_report = metadata_report(args.metadata_blocks)
        meta = meta_report["metadata_bytes_per_block_all"]
    finally:
        if args.keep:
            console.print(f"kept {directory}")
        else:
            shutil.rmtree(directory, ignore_errors=True)
            if made:
                with contextlib.suppress(OSError):  # empty now, unless someone else wrote into it meanwhile
                    os.rmdir(args.nvme_dir)
    # headline ratios: the worse block size, so a target holds for both
    ratios = {k: min(s["ratios"][k] for s in sizes.values()) for k in HEADS}
    targets = dict(TARGETS)
    reasons: dict[str, str] = {}
    for k in GPU_RATIOS:  # reported beside the targets, not part of the verdict
        got = [s["ratios"][k] for s in sizes.values()]
        ratios[k] = None if None in got else min(got)
        if ratios[k] is None:
            reasons[k] = next(s["ratio_reasons"][k] for s in sizes.values() if k in s["ratio_reasons"])
    # how far each headline could move on a rerun: its steps' repetitions at every size, resampled
    intervals = {k: list(median_ratio_interval([r for s in sizes.values()
                                                for r in step_ratios(s["samples_s"], k, s["best_baseline"][k])]))
                 for k in HEADS}
    result = {
        "bench": "tiers", "ratios": ratios, "targets": targets, "ratio_reasons": reasons,
        "ratio_intervals": intervals, "ratio_interval_level": LEVEL,
        "sizes_measured": "in this process, one after another" if args.one_process else "each in a process of its own",
        # the same ratios against the old baselines (one numpy copy; O_DIRECT at queue depth 1), for comparison
        "ratios_old_baseline": {k: min(s["ratios_old_baseline"][k] for s in sizes.values()) for k in HEADS},
        "best_baseline": {name: s["best_baseline"] for name, s in sizes.items()},
        "metadata_bytes_per_block": meta, "metadata_blocks": args.metadata_blocks, "metadata": meta_report,
        "sizes": sizes, "ok": all(ratios[k] >= v for k, v in targets.items()) and meta <= 256,
    }
    table = Table(title="kvtier bench tiers (GB/s; ratio = kvtier / raw, same run)")
    table.add_column("figure")
    for name in sizes:
        table.add_column(name, justify="right")
    first = next(iter(sizes.values()))
    ct, it = first["baseline_threads"]["copy"], first["baseline_threads"]["io"]
    rows = (("memcpy, shared memory (raw, 1 thread)", "memcpy_tier_gbps"), ("memcpy, anonymous memory", "memcpy_gbps"),
            (f"torch copy, shared memory (raw, {ct} threads)", "torch_copy_tier_gbps"),
            (f"memcpy, shared memory (raw, {ct} threads)", "threads_copy_tier_gbps"),
            (f"the mover's loop, 1 MiB pieces pulled by {ct} threads (raw)", "chunks_copy_tier_gbps"),
            ("hbm→dram (kvtier)", "hbm_to_dram_gbps"), ("dram→hbm (kvtier)", "dram_to_hbm_gbps"),
            ("O_DIRECT write (raw, QD1)", "raw_odirect_write_tier_gbps"),
            (f"O_DIRECT write (raw, {it} threads)", "raw_odirect_write_tier_qd_gbps"),
            (f"O_DIRECT write (raw, {it} threads, compiled loop)", "raw_odirect_write_tier_qd_c_gbps"),
            ("dram→nvme (kvtier)", "dram_to_nvme_gbps"),
            ("O_DIRECT read (raw, QD1)", "raw_odirect_read_tier_gbps"),
            (f"O_DIRECT read (raw, {it} threads)", "raw_odirect_read_tier_qd_gbps"),
            (f"O_DIRECT read (raw, {it} threads, compiled loop)", "raw_odirect_read_tier_qd_c_gbps"),
            (f"O_DIRECT read, every block verified (raw, {it} threads, compiled loop; not a baseline)",
             "raw_odirect_read_tier_qd_c_verified_gbps"),
            ("nvme→dram (kvtier)", "nvme_to_dram_gbps"))
    gpu_rows = (("pinned H2D (raw)", "raw_h2d_gbps"), ("pinned D2H (raw)", "raw_d2h_gbps"),
                ("kvikio write (raw)", "raw_kvikio_write_gbps"), ("hbm→nvme (kvtier)", "hbm_to_nvme_gbps"),
                ("kvikio read (raw)", "raw_kvikio_read_gbps"), ("nvme→hbm (kvtier)", "nvme_to_hbm_gbps"))
    for label, key in tuple(r for r in rows + gpu_rows if all(r[1] in s for s in sizes.values())):
        table.add_row(label, *(f"{s[key]:.2f}" for s in sizes.values()))
    for k in HEADS:
        table.add_row(f"ratio {k} vs best (target ≥ {targets[k]})",
                      *(f"{s['ratios'][k]:.3f} ({s['best_baseline'][k]})" for s in sizes.values()))
        table.add_row(f"  {LEVEL:.0%} interval, repetitions resampled",
                      *("{:.3f}–{:.3f}".format(*s["ratio_intervals"][k]) for s in sizes.values()))
        table.add_row(f"ratio {k} vs old baseline", *(f"{s['ratios_old_baseline'][k]:.3f}" for s in sizes.values()))
    if all("read_verification" in s for s in sizes.values()):
        for label, key in (("raw read verified / raw read (what verifying costs)", "raw_verified_vs_raw"),
                           ("ratio nvme_read vs the verified raw read (no target)", "nvme_read_vs_raw_verified")):
            table.add_row(label, *(f"{s['read_verification'][key]:.3f}" for s in sizes.values()))
    for k in GPU_RATIOS:
        table.add_row(f"ratio {k} (no target)", *("n/a" if s["ratios"][k] is None else f"{s['ratios'][k]:.3f}"
                                                  for s in sizes.values()))
    Console().print(table)
    Console().print(f"metadata: {meta:.1f} B/block at {args.metadata_blocks:,} blocks (target ≤ 256); "
                    f"backend {next(iter(sizes.values()))['io_backend']}; verdict: {'PASS' if result['ok'] else 'BELOW TARGET'}")
    Console().print("headline ratios (the worse block size), with their " + f"{LEVEL:.0%} intervals: " + "; ".join(
        f"{k} {ratios[k]:.3f} ({intervals[k][0]:.3f}–{intervals[k][1]:.3f})" for k in HEADS))
    for k, why in reasons.items():
        Console().print(f"ratio {k}: not measured ({why})")
    return result
