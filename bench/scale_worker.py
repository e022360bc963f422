"""One engine process of ``bench scale``: timed alloc / seal / acquire / release / free round trips.

It registers, prints ``ready``, then obeys lines on stdin: ``go SECONDS FIRST COUNT`` runs the
op cycle for SECONDS (missing acquires take recovered keys FIRST .. FIRST+COUNT-1, each once)
and prints one JSON line of per-op latencies; ``quit`` ends it. Bytes are never written: the
bench measures the daemon's per-op cost, not copies.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import numpy as np

from kvtier.client.tier_client import TierClient

OPS = ("alloc", "seal", "release", "acquire_resident", "free", "acquire_missing")


def _cycle(c: TierClient, lat: dict[str, list[float]], seq: int, keys: np.ndarray, missing: np.ndarray) -> None:
    def timed(name: str, fn: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        lat[name].append(time.perf_counter() - t0)
        return out

    blocks, _ = timed("alloc", c.alloc, keys.size, seq=seq, pin=True)
    blocks = timed("seal", c.seal, blocks, keys, seq=seq)
    timed("release", c.release, blocks)
    timed("acquire_resident", c.acquire, blocks)
    timed("release", c.release, blocks)
    timed("free", c.free, seqs=[seq])
    if missing.size:  # recovered blocks that sit on NVMe only: the acquire promotes and verifies them
        got = c.ref(missing, seq=seq + 1)
        if np.any(got < 0):
            raise RuntimeError(f"recovered key {int(missing[np.argmax(got < 0)]):#x} unknown")
        timed("acquire_missing", c.acquire, got)
        c.release(got)
        c.free(seqs=[seq + 1])


def main() -> None:
    runtime_dir, idx, block_bytes, batch, first_key = (sys.argv[1], int(sys.argv[2]), int(sys.argv[3]),
                                                       int(sys.argv[4]), int(sys.argv[5]))
    c = TierClient(runtime_dir=runtime_dir, engine_id=f"scale-{idx}", heartbeat_s=1.0, timeout_s=60)
    c.register(block_bytes=block_bytes)
    print("ready", flush=True)
    next_key, seq = (idx + 1) << 40, 2
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "quit":
            break
        seconds, first, count = float(cmd[1]), int(cmd[2]), int(cmd[3])
        pool = first_key + np.arange(first, first + count, dtype=np.uint64)
        lat: dict[str, list[float]] = {op: [] for op in OPS}
        cycles, used = 0, 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            keys = np.arange(next_key, next_key + batch, dtype=np.uint64)
            next_key += batch
            missing = pool[used: used + batch]
            used += missing.size
            _cycle(c, lat, seq, keys, missing)
            seq += 2
            cycles += 1
        print(json.dumps({"engine": idx, "cycles": cycles, "seconds": time.perf_counter() - t0, "lat": lat}),
              flush=True)
    c.close()


if __name__ == "__main__":
    main()
