"""Replay over capacities x policies: JSON rows, gap closed, table, plot."""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from kvtier.replay.sim import RunResult, run_one
from kvtier.replay.traces import Trace


def parse_fractions(text: str) -> list[float]:
    out = []
    for part in text.split(","):
        part = part.strip()
        try:
            v = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        except ValueError:
            raise ValueError(f"bad capacity {part!r}: use fractions like 0.05 or percentages like 5%") from None
        if not 0 < v <= 1:
            raise ValueError(f"capacity {part!r} must be in (0, 100%]")
        out.append(v)
    return out


def replay(trace: Trace, fractions: Sequence[float], policies: Sequence[str], params: dict[str, Any],
           progress: Optional[Any] = None) -> dict[str, Any]:
    next_use = trace.next_use()
    rows, results = [], []
    for f in fractions:
        cap = max(1, int(round(f * trace.n_unique)))
        row: dict[str, Any] = {"fraction": f, "capacity_blocks": cap, "hit": {}, "hit_by_part": {}}
        for name in policies:
            r: RunResult = run_one(name, cap, trace, next_use, params, progress)
            row["hit"][name] = r.hit_ratio
            row["hit_by_part"][name] = r.hit_ratio_by_part  # per eighth of the accesses: the learning curve
            results.append(r)
        rows.append(row)
    # gap closed: the mean over the capacities where Belady beats LRU (elsewhere there is no gap
    # to close); which ones were averaged, and which left out, goes into the report with it
    gap: dict[str, Optional[float]] = {}
    has_gap = "lru" in policies and "belady" in policies
    gap_rows = [r for r in rows if r["hit"]["belady"] > r["hit"]["lru"]] if has_gap else []
    if has_gap:
        for name in policies:
            gs = [(r["hit"][name] - r["hit"]["lru"]) / (r["hit"]["belady"] - r["hit"]["lru"]) for r in gap_rows]
            gap[name] = float(np.mean(gs)) if gs else None
    aps: dict[str, float] = {}
    for name in policies:
        rs = [r for r in results if r.policy == name]
        aps[name] = sum(r.accesses for r in rs) / sum(r.seconds for r in rs)
    calibration = _mean_calibration([r.calibration for r in results if r.calibration])
    return {"trace": trace.name, "format": trace.format, "accesses": trace.n_accesses,
            "unique_blocks": trace.n_unique, "requests": trace.n_requests,
            "max_hit_ratio": 1 - trace.n_unique / trace.n_accesses,
            "rows": rows, "gap_closed": gap, **_gap_capacities(rows, gap_rows, has_gap),
            "calibration": calibration,
            "calibration_per_run": [{"policy": r.policy, "capacity": r.capacity, **r.calibration}
                                    for r in results if r.calibration],
            "accesses_per_s": aps}


def _gap_capacities(rows: list[dict], averaged: list[dict], have_gap: bool) -> dict[str, Any]:
    """The capacities ``gap_closed`` is the mean over, and those left out (Belady no better than LRU)."""
    if not have_gap:
        return {}
    return {"gap_capacities": [r["fraction"] for r in averaged],
            "gap_left_out": [{"fraction": r["fraction"], "capacity_blocks": r["capacity_blocks"],
                              "reason": "Belady == LRU: no gap to close"}
                             for r in rows if not any(r is a for a in averaged)]}


def _mean_calibration(calib: list[dict]) -> dict[str, Any]:
    """Brier, ECE (and the model's own ECE) as the mean over the runs that scored predictions
    (``n`` > 0: a run whose windows never closed has none, and its scores are NaN); None where
    no run did. ``runs``: how many runs the means are over. Empty where no policy is scored."""
    if not calib:
        return {}
    scored = [c for c in calib if c.get("n", 0) > 0]
    out: dict[str, Any] = {"runs": len(scored)}
    for k in ("brier", "ece", "ece_raw"):
        if not all(k in c for c in calib):
            continue
        vals = [float(c[k]) for c in scored if np.isfinite(c[k])]
        out[k] = float(np.mean(vals)) if vals else None
    return out


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["fraction"] * 100 for r in report["rows"]]
    for name in report["rows"][0]["hit"]:
        ax.plot(xs, [r["hit"][name] for r in report["rows"]], marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("capacity (% of unique blocks)")
    ax.set_ylabel("block hit ratio")
    ax.set_title(report["trace"])
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
