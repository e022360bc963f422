"""Stats objects: one plain dict snapshot of the daemon, taken by the owner thread.

The exporter (``metrics.py``), ``kvtier stats`` and the ``stats`` RPC all read
this snapshot, so nothing outside the owner thread touches live metadata.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Optional

import numpy as np

from kvtier.predictor.classes import N_FEATURE_CLASSES
from kvtier.tiers.types import FREE

from .config import KvtierConfig
from .node import Node
from .residency import STALL_BUCKETS, ResidencyOps
from .session import EngineSession


def snapshot(cfg: KvtierConfig, counters: Counter[str], engines: dict[str, EngineSession], node: Optional[Node],
             res: Optional[ResidencyOps], clock: Callable[[], float]) -> dict[str, Any]:
    c = counters
    stall_counts = res.stall_counts.tolist() if res is not None else [0] * (len(STALL_BUCKETS) + 1)
    stall_sum = res.stall_sum if res is not None else 0.0
    acquires = c["acquires"]
    out: dict[str, Any] = {
        "engines": [{"engine": s.engine_id, "pid": s.pid, "live_blocks": s.refs.held, "pins": int(s.pins.sum()),
                     "sequences": len(s.seqs)} for s in engines.values()],
        "service": dict(c),
        # no acquires: no ratio (1.0 would claim a perfect prefetcher that was never asked)
        "prefetch_on_time_ratio": c["acquires_on_time"] / acquires if acquires else None,
        "acquire_stall_s_total": c["stall_ns"] / 1e9,
        "acquire_stall_histogram": {"le": list(STALL_BUCKETS), "counts": stall_counts, "sum": stall_sum},
        "policy": cfg.policy.name,
        "config_hot": {name: getattr(cfg, name).model_dump() for name in ("policy", "scoring", "predictor")},
    }
    if node is None:
        out["tiers"] = []
        return out
    mgr = node.mgr
    t = mgr.table
    used = t.state != FREE
    out["tiers"] = mgr.tier_usage()
    for row in out["tiers"]:
        row["hits"] = c[f"hits_{row['tier']}"]
    out["blocks"] = {"live": int((used & (t.refcount > 0)).sum()), "cached": int((used & (t.refcount == 0)).sum()),
                     "pinned": int((t.pins > 0).sum()), "max": t.max_blocks}
    out["block_bytes"] = mgr.block_bytes
    out["io"] = {"backend": mgr.backend.name,  # direct: False once the filesystem refused O_DIRECT
                 "nvme_direct_io": bool(mgr.nvme.direct) if mgr.nvme is not None else None,
                 "copy_loop": mgr.copy_loop.loop, "copy_loop_how": mgr.copy_loop.how,  # tiers.copy_loop's outcome
                 "recovered_blocks": mgr.recovered,  # cached blocks found on NVMe at start ...
                 "recovered_from": mgr.recovered_from,  # ... from a clean stop's "index", or a "scan"
                 # ... of which still waiting for their namespace's engines to register
                 "recovered_unclaimed": mgr.unclaimed.count(mgr.table, mgr.namespace),
                 # the data plane's other counts: corrupt copies, keys detached, read retries,
                 # NVMe write backoffs and skips, seals folded, slots zeroed, ...
                 "events": {k: int(v) for k, v in sorted(mgr.counters.items()) if "->" not in k}}
    paths: dict[str, dict[str, float]] = {}
    for name, v in mgr.counters.items():
        for kind in ("moves", "bytes", "errors", "clean", "busy_ns"):
            if name.startswith(kind + "_") and "->" in name:
                paths.setdefault(name[len(kind) + 1:], {})[kind] = v
    for row in paths.values():
        busy = row.get("busy_ns", 0) / 1e9
        row["bandwidth_bytes_per_s"] = row.get("bytes", 0) / busy if busy > 0 else 0.0
    out["paths"] = paths
    out["placement"] = node.placement.stats()
    calib = {}
    for pol in node.placement.policies.values():
        summary = pol.calibration()
        if summary is not None:
            if summary["n"]:
                calib = summary
            break
    out["calibration"] = calib
    pf = node.prefetcher
    out["prefetch"] = {"hinted": pf.hinted, "started": pf.started, "queued": len(pf),
                       "speculated": pf.speculated, "speculative_used": pf.speculative_used,
                       "speculative_wasted": pf.speculative_wasted}
    out["remote"] = node.remote.stats() if node.remote is not None else {"enabled": False}
    out["importance_mean"] = float(np.mean(t.importance[used])) if used.any() else 0.0
    scores = node.scores  # tracked (live and cached) blocks per segment tag (untagged: "")
    counts = np.bincount(scores.segment[used], minlength=len(scores.segment_names))
    out["segments"] = {name or "untagged": int(n) for name, n in zip(scores.segment_names, counts)}
    classes = np.bincount(node.placement.feature_class[used], minlength=N_FEATURE_CLASSES)
    out["feature_classes"] = classes.tolist()  # the same per predictor feature class (tail*8 + cont*4 + span)
    return out


__all__ = ["snapshot"]
