"""Whole-turn speed with kvtier under a 25% HBM budget vs the untiered engine, with and without hints.

Same run, same model, same workload, same forward calls: the untiered engine
keeps every session's KV in a DynamicCache; the tiered one keeps it in
kvtier's paged HBM slots with a real daemon demoting idle sessions to DRAM
and NVMe and prefetching them back. Every step of every turn is timed: the
prefill (for the tiered engine also the acquire, the allocation and the
gather from the slots), the decode steps, and the RPCs around them; JSON
``ratio`` is the whole-turn tokens/s ratio, with ``prefill_ratio`` and
``decode_ratio`` beside it. The workload runs twice, with schedule hints
(the headline) and without (prefetch has nothing to go on), and the prefetch
on-time figure of both is reported: no target is waived. Every turn is also
compared bit for bit.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.bench.demo_report import add_demo_arguments

    add_demo_arguments(p)


def _slowest_step(r: dict[str, Any]) -> str:
    """Which part of the turn the tiered engine pays for, in seconds over the whole run."""
    o = r["overhead_s"]
    parts = {"prefill step (acquire, alloc, gather, prompt)": o["prefill_s"], "decode steps": o["forward_s"],
             "outside the forward calls (hint, release, telemetry)": o["outside_forward_s"]}
    name, cost = max(parts.items(), key=lambda kv: kv[1])
    return f"{name}: +{cost:.3f} s of +{o['total_s']:.3f} s"


def run(args: argparse.Namespace) -> dict:
    from kvtier.bench.demo_report import format_ratio, options_from, print_summary, run_with_progress

    opts = options_from(args)
    runs: dict[str, dict[str, Any]] = {}
    for hints in ([True, False] if opts.hints else [False]):  # --no-hints: that run only, judged the same
        o = dataclasses.replace(opts, hints=hints)
        runs["hints" if hints else "no_hints"] = r = run_with_progress(o)
        print_summary(r)
    head = runs.get("hints") or runs["no_hints"]
    result = dict(head)
    result["prefetch_on_time_hints"] = runs["hints"]["prefetch_on_time"] if "hints" in runs else None
    result["prefetch_on_time_no_hints"] = runs["no_hints"]["prefetch_on_time"]
    result["no_hints"] = {k: runs["no_hints"][k] for k in (
        "ratio", "prefill_ratio", "decode_ratio", "prefetch_on_time", "stall_s", "bit_exact", "tokens_per_s_tiered",
        "tokens_per_s_untiered", "ttft_s_tiered", "overhead_s")}
    result["costliest_step"] = _slowest_step(head)
    result["targets"] = {"ratio_min": 0.8, "prefetch_on_time_min": 0.95, "bit_exact": True}
    result["ok"] = bool(all(r["bit_exact"] for r in runs.values()) and head["ratio"] >= 0.8
                        and (head["prefetch_on_time"] or 0.0) >= 0.95)
    print(f"whole-turn ratio {head['ratio']:.2f} (prefill {head['prefill_ratio']:.2f}, decode "
          f"{head['decode_ratio']:.2f}); on-time with hints {format_ratio(result['prefetch_on_time_hints'])}, "
          f"without {format_ratio(result['prefetch_on_time_no_hints'])}; "
          f"the tiered engine pays most in the {result['costliest_step']}; "
          f"verdict: {'PASS' if result['ok'] else 'BELOW TARGET'}")
    return result
