"""Stats objects: one plain dict snapshot of the daemon, taken by the owner thread.

The exporter (``metrics.py``), ``kvtier stats`` and the ``stats`` RPC all read
this snapshot, so nothing outside the owner thread touches live metadata.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.tiers.types import FREE

from .service import STALL_BUCKETS, Service


def snapshot(svc: Service) -> dict[str, Any]:
    c = svc.counters
    acquires = c["acquires"]
    out: dict[str, Any] = {
        "engines": [{"engine": s.engine_id, "pid": s.pid, "live_blocks": len(s.refs), "pins": int(s.pins.sum()),
                     "sequences": len(s.seqs)} for s in svc.engines.values()],
        "service": dict(c),
        "prefetch_on_time_ratio": c["acquires_on_time"] / acquires if acquires else 1.0,
        "acquire_stall_s_total": c["stall_ns"] / 1e9,
        "acquire_stall_histogram": {"le": list(STALL_BUCKETS), "counts": svc.stall_counts.tolist(),
                                    "sum": svc.stall_sum},
        "policy": svc.cfg.policy.name,
        "config_hot": {name: getattr(svc.cfg, name).model_dump() for name in ("policy", "scoring", "predictor")},
    }
    mgr = svc.mgr
    if mgr is None:
        out["tiers"] = []
        return out
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
                 "recovered_blocks": mgr.recovered,  # cached blocks found on NVMe at start ...
                 "recovered_from": mgr.recovered_from}  # ... from a clean stop's "index", or a "scan"
    paths: dict[str, dict[str, float]] = {}
    for name, v in mgr.counters.items():
        for kind in ("moves", "bytes", "errors", "clean", "busy_ns"):
            if name.startswith(kind + "_") and "->" in name:
                paths.setdefault(name[len(kind) + 1:], {})[kind] = v
    for row in paths.values():
        busy = row.get("busy_ns", 0) / 1e9
        row["bandwidth_bytes_per_s"] = row.get("bytes", 0) / busy if busy > 0 else 0.0
    out["paths"] = paths
    out["placement"] = svc.placement.stats() if svc.placement else {}
    calib = {}
    for tier, pol in (svc.placement.policies.items() if svc.placement else ()):
        tracker = getattr(pol, "calib", None)
        if tracker is not None:
            tracker.finish(svc.clock() / svc.cfg.policy.epoch_s)
            if tracker.n_scored:
                calib = tracker.summary()
            break
    out["calibration"] = calib
    pf = svc.prefetcher
    out["prefetch"] = {"hinted": pf.hinted, "started": pf.started, "queued": len(pf),
                       "speculated": pf.speculated, "speculative_used": pf.speculative_used,
                       "speculative_wasted": pf.speculative_wasted} if pf is not None else {}
    out["importance_mean"] = float(np.mean(t.importance[used])) if used.any() else 0.0
    if svc.scores is not None:  # live blocks per segment tag (untagged: "")
        counts = np.bincount(svc.scores.segment[used], minlength=len(svc.scores.segment_names))
        out["segments"] = {name or "untagged": int(n) for name, n in zip(svc.scores.segment_names, counts)}
    return out


__all__ = ["snapshot"]
