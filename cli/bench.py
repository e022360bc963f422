"""``kvtier bench {tiers,tiers-runs,rpc,e2e,soak,scale,vllm,remote}``: benchmark registry."""

from __future__ import annotations

import argparse
import importlib
from typing import Any, Optional, Sequence

from kvtier.cli.output import check_output, write_json

# bench name -> (module with ``add_arguments(p)`` and ``run(args) -> dict``, the first line of its
# docstring: ``kvtier bench --help`` lists every bench without importing one; a test keeps them equal)
BENCHES: dict[str, tuple[str, str]] = {
    "tiers": ("kvtier.bench.tiers",
              "Tier data-plane throughput vs the fastest raw copies and O_DIRECT I/O this machine does."),
    "rpc": ("kvtier.bench.rpc", "RPC latency and telemetry rate vs a bare ZeroMQ round trip."),
    "e2e": ("kvtier.bench.e2e",
            "Whole-turn speed with kvtier under a 25% HBM budget vs the untiered engine, with and without hints."),
    "soak": ("kvtier.bench.soak",
             "Soak: N engine processes x M minutes of random ops on a real daemon, every byte verified."),
    "scale": ("kvtier.bench.scale",
              "How the daemon's per-op cost grows with the blocks it tracks (10^5 .. 10^7) and the engines attached."),
    "vllm": ("kvtier.bench.vllm_bench",
             "vLLM alone vs vLLM with its own CPU offloading vs vLLM on kvtier: same workload, same KV space."),
    "tiers-runs": ("kvtier.bench.tiers_runs", "Several saved bench tiers runs pooled: each headline's range, "
                                              "the runs that met it, and every repetition's median."),
    "remote": ("kvtier.bench.remote", "Remote tier put/get through kvtier vs raw redis-py cluster pipelines, "
                                      "and prefill saved on a second node."),
}


def configure(name: str, p: argparse.ArgumentParser, rest: Optional[Sequence[str]] = None) -> None:
    """A parser for every bench; only the bench named first in ``rest`` (every bench when None)
    imports its module for its arguments: most import torch, seconds that ``--help`` need not wait."""
    from kvtier.cli.main import chosen_word

    chosen = chosen_word(rest, BENCHES)[0] if rest is not None else None
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for bench, (modname, summary) in BENCHES.items():
        # argparse %-formats help strings: a literal "25%" in a summary would crash --help
        bp = bsub.add_parser(bench, help=summary.replace("%", "%%"), description=summary)
        if rest is not None and bench != chosen:
            continue
        mod = importlib.import_module(modname)
        bp.add_argument("--json", metavar="PATH", help="write the results as JSON here")
        mod.add_arguments(bp)
        bp.set_defaults(func=lambda a, m=mod: _run(m, a))

    def show_help(a: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=show_help)


def _run(mod: Any, args: argparse.Namespace) -> int:
    check_output(args.json)  # before the bench: a bad path must not cost its minutes and results
    result = mod.run(args)
    write_json(args.json, result)
    return 0  # below-target ratios are reported (JSON "ok", table verdict), not errors
