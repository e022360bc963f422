"""Multi-tier replay: HBM and DRAM caches stacked over an NVMe tier that keeps everything.

The same policy objects rank each upper tier. A block found in HBM is an HBM
hit; found in DRAM, it is a DRAM hit and moves up if HBM's policy admits it
(tiers are exclusive), else it stays in DRAM; otherwise, if it was ever
written, NVMe serves it; else it is a miss (computed). HBM victims, and
blocks HBM's policy declines, are offered to DRAM, whose policy may decline
them too (admission), in which case they remain only on NVMe. Estimated stall = bytes promoted per tier / that
tier's bandwidth, the time an engine would wait if nothing were prefetched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np

from kvtier.policy import make_policy
from kvtier.replay.traces import Trace


@dataclass
class TierSpec:
    hbm_blocks: int
    dram_blocks: int
    block_bytes: int = 2 << 20  # 512 tokens of a mid-size model
    dram_bytes_per_s: float = 20e9
    nvme_bytes_per_s: float = 5e9


def _offer(dram: Any, b: int, now: float, c: int, where: np.ndarray) -> None:
    """Place ``b`` in DRAM if its policy admits it (else it lives on NVMe only)."""
    if dram.admit(b, now, c, -1):
        if dram.size >= dram.capacity:
            where[dram.evict(now)] = 0
        dram.insert(b, now, c, -1)
        where[b] = 2


def simulate_tiers(policy: str, spec: TierSpec, trace: Trace, params: Optional[dict[str, Any]] = None,
                   progress: Optional[Callable[[int], None]] = None, chunk: int = 20000) -> dict[str, Any]:
    params = params or {}
    hbm = make_policy(policy, spec.hbm_blocks, trace.n_unique, **params)
    dram = make_policy(policy, spec.dram_blocks, trace.n_unique, **params)
    where = np.zeros(trace.n_unique, dtype=np.int8)  # 0 none, 1 hbm, 2 dram
    written = np.zeros(trace.n_unique, dtype=bool)
    counts = {"hbm": 0, "dram": 0, "nvme": 0, "miss": 0}
    t0 = time.perf_counter()
    blocks, times, classes = trace.block.tolist(), trace.time_s.tolist(), trace.cls.tolist()
    for i, b in enumerate(blocks):
        now, c = times[i], classes[i]
        hbm.observe(b, now, c)
        dram.observe(b, now, c)
        w = where[b]
        if w == 1:
            counts["hbm"] += 1
            hbm.on_hit(b, now, c, -1)
            continue
        if w == 2:
            counts["dram"] += 1
            dram.on_hit(b, now, c, -1)  # DRAM's policy learns from its own hits
        elif written[b]:
            counts["nvme"] += 1
        else:
            counts["miss"] += 1
            written[b] = True
        if hbm.admit(b, now, c, -1):  # promote (tiers are exclusive: the DRAM copy goes)
            if w == 2:
                dram.remove(b)
            if hbm.size >= hbm.capacity:
                v = hbm.evict(now)
                where[v] = 0
                _offer(dram, v, now, c, where)  # the HBM victim may go one tier down
            hbm.insert(b, now, c, -1)
            where[b] = 1
        elif w != 2:  # not worth HBM: maybe worth DRAM, rather than NVMe only
            _offer(dram, b, now, c, where)
        if progress is not None and i % chunk == chunk - 1:
            progress(chunk)
    if progress is not None:
        progress(len(blocks) % chunk)
    n = len(blocks)
    stall = (counts["dram"] * spec.block_bytes / spec.dram_bytes_per_s
             + counts["nvme"] * spec.block_bytes / spec.nvme_bytes_per_s)
    return {"policy": policy, "hbm_blocks": spec.hbm_blocks, "dram_blocks": spec.dram_blocks,
            "hit": {k: v / n for k, v in counts.items() if k != "miss"}, "miss": counts["miss"] / n,
            "stall_s": stall, "accesses_per_s": n / (time.perf_counter() - t0)}


__all__ = ["TierSpec", "simulate_tiers"]
