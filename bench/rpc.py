"""RPC latency and telemetry rate vs a bare ZeroMQ round trip.

Same run, same machine: a bare pyzmq ROUTER echo process answers a DEALER
over ``ipc://`` with frames of the same sizes as an ``acquire`` of 128
resident blocks and its reply, and a real daemon process serves that acquire
through ``TierClient``; the two round trips alternate, so both see the same
machine state. The ratio of the p50 round trips is what matters. Telemetry: attention-mass reports of 1024 blocks each, pushed as
fast as the client can, counted by the daemon.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvtier.bench.args import positive_int

ECHO = r"""
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.bind(sys.argv[1]); reply = b"x" * int(sys.argv[2])
print("ready", flush=True)
while True:
    f = s.recv_multipart()
    if f[-1] == b"stop": break
    s.send_multipart([*f[:-1], reply])
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=positive_int, default=128, help="blocks per acquire")
    p.add_argument("--iters", type=positive_int, default=2000, help="round trips per measurement")
    p.add_argument("--telemetry-messages", type=positive_int, default=500, help="telemetry messages of 1024 blocks")
    p.add_argument("--keep", action="store_true", help="keep the temp directory (daemon log, sockets)")


def _p50_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def _interleaved(endpoint: str, request: bytes, reply_len: int, iters: int,
                 acquire: Callable[[], None], release: Callable[[], None]) -> tuple[list[float], list[float]]:
    """Alternate one raw round trip and one acquire, so both see the same machine state."""
    import zmq

    proc = subprocess.Popen([sys.executable, "-c", ECHO, endpoint, str(reply_len)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(endpoint)
        raw, acq = [], []
        for i in range(iters + 100):
            t0 = time.perf_counter()
            s.send_multipart([b"", request])
            s.recv_multipart()
            t1 = time.perf_counter()
            acquire()
            t2 = time.perf_counter()
            release()
            if i >= 100:  # warm-up excluded
                raw.append(t1 - t0)
                acq.append(t2 - t1)
        s.send_multipart([b"", b"stop"])
        s.close(0)
        return raw, acq
    finally:
        proc.wait(timeout=10)


def run(args: argparse.Namespace) -> dict:
    """The measurement in a temp directory of its own, removed afterwards unless ``--keep``."""
    from rich.console import Console

    con = Console(stderr=True)
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-rpc-"))
    try:
        return _measure(args, root, con)
    finally:
        if args.keep:
            con.print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def _measure(args: argparse.Namespace, root: Path, con: Any) -> dict:
    from kvtier.bench.spawn import DaemonProcess
    from kvtier.protocol import wire as P

    n = args.blocks
    d = DaemonProcess(root, "tiers.hbm_bytes=16777216", "tiers.dram_bytes=16777216", "tiers.nvme_bytes=0",
                      "server.heartbeat_timeout_s=60")
    try:
        c = d.client(engine_id="bench", heartbeat_s=None)
        c.register(block_bytes=4096)
        blocks, _ = c.alloc(n, seq=1)
        keys = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        blocks = c.seal(blocks, keys, seq=1)
        request = P.pack({"v": P.VERSION, "id": 1, "op": "acquire", "engine": c.engine_id,
                          "args": {"blocks": P.id_bytes(blocks)}})
        reply_len = len(P.ok(1, {"done": True, "ticket": 1, "blocks": P.id_bytes(blocks), "slots": P.id_bytes(blocks)}))
        con.print(f"raw zmq round trips ({len(request)} B request, {reply_len} B reply) interleaved with "
                  f"acquire of {n} resident blocks through TierClient ...")
        raw, acq = _interleaved(f"ipc://{root / 'echo.sock'}", request, reply_len, args.iters,
                                lambda: c.acquire(blocks=blocks), lambda: c.release(blocks=blocks))
        con.print(f"telemetry: {args.telemetry_messages} x 1024 block updates ...")
        tele_blocks, _ = c.alloc(1024, seq=2)
        mass = np.random.default_rng(0).random(1024).astype(np.float32)
        base = c.stats()["service"].get("telemetry_block_updates", 0)
        total = args.telemetry_messages * 1024
        t0 = time.perf_counter()
        for _ in range(args.telemetry_messages):
            c.report_attention(tele_blocks, mass)
        while c.stats()["service"].get("telemetry_block_updates", 0) - base < total:
            if time.perf_counter() - t0 > 60:
                break
            time.sleep(0.002)
        tele_s = time.perf_counter() - t0
        got = c.stats()["service"].get("telemetry_block_updates", 0) - base
        c.close()
    finally:
        d.stop()
    raw_p50, acq_p50 = _p50_us(raw), _p50_us(acq)
    result = {
        "raw_zmq_rtt_us_p50": raw_p50, "acquire_rtt_us_p50": acq_p50, "ratio": acq_p50 / raw_p50,
        "raw_zmq_rtt_us_p99": float(np.percentile(raw, 99) * 1e6), "acquire_rtt_us_p99": float(np.percentile(acq, 99) * 1e6),
        "telemetry_block_updates_per_s": got / tele_s, "telemetry_delivered": got / total,
        "blocks_per_acquire": n, "iters": args.iters,
        "targets": {"ratio_max": 2.0, "telemetry_block_updates_per_s_min": 200_000},
    }
    result["ok"] = bool(result["ratio"] <= 2.0 and result["telemetry_block_updates_per_s"] >= 200_000)
    con.print(f"raw zmq p50 {raw_p50:.1f} us | acquire({n}) p50 {acq_p50:.1f} us | ratio {result['ratio']:.2f} "
              f"(target <= 2.0) | telemetry {result['telemetry_block_updates_per_s']:,.0f} block updates/s "
              f"(target >= 200,000) | verdict: {'PASS' if result['ok'] else 'BELOW TARGET'}")
    return result
