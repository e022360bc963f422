"""Decode speed with kvtier under a 25% HBM budget vs the untiered engine.

Same run, same model, same workload, same forward calls: the untiered engine
keeps every session's KV in a DynamicCache; the tiered one keeps it in
kvtier's paged HBM slots with a real daemon demoting idle sessions to DRAM
and NVMe and prefetching them back from schedule hints. Every turn is also
compared bit for bit.
"""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.bench.demo_report import add_demo_arguments

    add_demo_arguments(p)


def run(args: argparse.Namespace) -> dict:
    from kvtier.bench.demo_report import options_from, print_summary, run_with_progress

    r = run_with_progress(options_from(args))
    print_summary(r)
    r["targets"] = {"ratio_min": 0.8, "prefetch_on_time_min": 0.95, "bit_exact": True}
    r["ok"] = bool(r["bit_exact"] and r["ratio"] >= 0.8 and (r["prefetch_on_time"] >= 0.95 or not r["options"]["hints"]))
    return r
