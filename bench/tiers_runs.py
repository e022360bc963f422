"""Several saved bench tiers runs pooled: each headline's range, the runs that met it, and every repetition's median.

One run's headline is uncertain by a few hundredths on a shared host (its
interval, ``intervals.py``), so a target met in most runs and missed in some
says little by itself. Pooled, the repetitions of N runs give the figure those
runs agree on, with an interval that narrows as runs are added: each size's
per-repetition ratios (raw time / kvtier time, against the baseline that run
found fastest) from every run, the headline the worse of the steps and sizes as
in one run. The interval resamples the runs and then each one's repetitions, so
a difference between runs (another hour on a shared host) widens it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from typing import Any

from .intervals import LEVEL, pooled_interval
from .tiers_headlines import HEADLINE_STEPS, HEADS, TARGETS, step_ratios


class NotATiersRun(ValueError):
    """A file given to pool is no ``bench tiers`` result (the CLI prints it as one line)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN_JSON", help="files written by `kvtier bench tiers --json`")


def load_run(path: str) -> dict[str, Any]:
    """A ``bench tiers`` JSON, or a NotATiersRun saying why this file is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            run = json.load(f)
    except OSError as e:
        raise NotATiersRun(f"{path}: cannot read it ({e.strerror or e})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise NotATiersRun(f"{path}: not JSON ({e})") from None
    if not isinstance(run, dict) or run.get("bench") != "tiers":
        raise NotATiersRun(f"{path}: not a `kvtier bench tiers --json` result (its \"bench\" is not \"tiers\")")
    sizes = run.get("sizes")
    if not isinstance(sizes, dict) or not sizes:
        raise NotATiersRun(f"{path}: a bench tiers result with no block sizes")
    steps = {o for k in HEADS for o in HEADLINE_STEPS[k]}
    for name, size in sizes.items():
        samples = size.get("samples_s") if isinstance(size, dict) else None
        best = size.get("best_baseline") if isinstance(size, dict) else None
        if (not isinstance(samples, dict) or not isinstance(best, dict)
                or not all(isinstance(best.get(k), str) for k in HEADS)):
            raise NotATiersRun(f"{path}: size {name} lacks its repetitions or best baselines "
                               "(written by an older bench tiers?)")
        ratios, block = size.get("ratios"), size.get("block_bytes", 0)
        if not isinstance(ratios, dict) or not all(_positive(ratios.get(k)) for k in HEADS):
            raise NotATiersRun(f"{path}: size {name}: its headline ratios are not positive numbers")
        if not isinstance(block, int) or isinstance(block, bool) or block < 0:
            raise NotATiersRun(f"{path}: size {name}: block_bytes {block!r} is not a byte count")
        missing = sorted((steps | {best[k] for k in HEADS}) - set(samples))
        if missing:
            raise NotATiersRun(f"{path}: size {name} lacks the repetitions of {', '.join(missing)}")
        for step in sorted(steps | {best[k] for k in HEADS}):
            times = samples[step]
            if not isinstance(times, list) or not times or not all(_positive(t) for t in times):
                raise NotATiersRun(f"{path}: size {name}, {step}: its repetitions are not positive times in seconds")
        for k in HEADS:  # each step's repetitions pair with its baseline's, one for one
            for o in HEADLINE_STEPS[k]:
                if len(samples[o]) != len(samples[best[k]]):
                    raise NotATiersRun(f"{path}: size {name}: {len(samples[o])} repetitions of {o} against "
                                       f"{len(samples[best[k]])} of {best[k]}")
    return run


def _positive(t: Any) -> bool:
    """A finite number above 0 (a JSON integer too large for a float is not)."""
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        return False
    try:
        return math.isfinite(float(t)) and t > 0
    except OverflowError:
        return False


def _pooled(reps: list[list[list[float]]]) -> float:
    """The worse figure's median over every run's repetitions (``reps[i][j]``: run i, figure j)."""
    return min(statistics.median(x for r in reps for x in r[j]) for j in range(len(reps[0])))


def pool(runs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per headline: every run's figure (the worse size), the runs at or above its target,
    and per block size and over all sizes the pooled median with its interval."""
    block_bytes = {s: size.get("block_bytes", 0) for r in runs for s, size in r["sizes"].items()}
    sizes = sorted(block_bytes, key=lambda s: (block_bytes[s], s))
    heads: dict[str, Any] = {}
    for k in HEADS:
        figures = [(s, o) for s in sizes for o in HEADLINE_STEPS[k]]
        # reps[i][j]: run i's per-repetition ratios of figure j (a size and step), [] where it has no such size
        reps = [[x for s in sizes for x in (step_ratios(r["sizes"][s]["samples_s"], k, r["sizes"][s]["best_baseline"][k])
                                            if s in r["sizes"] else [[]] * len(HEADLINE_STEPS[k]))] for r in runs]
        by_size: dict[str, Any] = {}
        for s in sizes:
            cols = [j for j, (size, _) in enumerate(figures) if size == s]
            have = [i for i, r in enumerate(runs) if s in r["sizes"]]
            cells = [runs[i]["sizes"][s]["ratios"][k] for i in have]
            mine = [[reps[i][j] for j in cols] for i in have]
            by_size[s] = {"runs": len(have), "per_run": cells, "range": [min(cells), max(cells)],
                          "met": sum(c >= TARGETS[k] for c in cells),
                          "pooled": _pooled(mine), "pooled_interval": list(pooled_interval(mine))}
        per_run = [min(r["sizes"][s]["ratios"][k] for s in r["sizes"]) for r in runs]
        heads[k] = {"target": TARGETS[k], "per_run": per_run, "range": [min(per_run), max(per_run)],
                    "met": sum(v >= TARGETS[k] for v in per_run),
                    "pooled": min(v["pooled"] for v in by_size.values()),
                    "pooled_interval": list(pooled_interval(reps)), "by_size": by_size}
    return {"bench": "tiers-runs", "runs": len(runs), "files": names, "interval_level": LEVEL, "heads": heads,
            "ok": all(h["pooled"] >= h["target"] for h in heads.values()),
            # and each interval above it: the medians these runs estimate are likely at or above the targets
            "clear_of_targets": all(h["pooled_interval"][0] >= h["target"] for h in heads.values())}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    result = pool([load_run(p) for p in args.runs], list(args.runs))
    sizes = list(next(iter(result["heads"].values()))["by_size"])
    table = Table(title=f"kvtier bench tiers, {result['runs']} runs pooled (kvtier / best raw, same run)")
    table.add_column("figure")
    for s in (*sizes, "worse size"):
        table.add_column(s, justify="right")
    for k, h in result["heads"].items():
        cells = [*h["by_size"].values(), h]
        table.add_row(f"{k} (≥ {h['target']}): runs met", *(f"{c['met']} of {len(c['per_run'])}" for c in cells))
        table.add_row("  range over runs", *("{:.3f}–{:.3f}".format(*c["range"]) for c in cells))
        table.add_row("  pooled median", *(f"{c['pooled']:.3f}" for c in cells))
        table.add_row(f"  {LEVEL:.0%} interval", *("{:.3f}–{:.3f}".format(*c["pooled_interval"]) for c in cells))
    Console().print(table)
    verdict = ("PASS, every interval clear of its target" if result["clear_of_targets"] else
               "PASS on the pooled medians; an interval reaches below its target" if result["ok"] else "BELOW TARGET")
    Console().print("pooled: every repetition of every run; the interval resamples runs, then their "
                    f"repetitions. Verdict: {verdict}")
    return result


__all__ = ["NotATiersRun", "add_arguments", "load_run", "pool", "run"]
