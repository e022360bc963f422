"""``kvtier bench {tiers,rpc,e2e,soak,scale,vllm,remote}``: benchmark registry."""

from __future__ import annotations

import argparse
import importlib
from typing import Any

from kvtier.cli.output import check_output, write_json

# bench name -> module with ``add_arguments(p)`` and ``run(args) -> dict``
BENCHES: dict[str, str] = {
    "tiers": "kvtier.bench.tiers",
    "rpc": "kvtier.bench.rpc",
    "e2e": "kvtier.bench.e2e",
    "soak": "kvtier.bench.soak",
    "scale": "kvtier.bench.scale",
    "vllm": "kvtier.bench.vllm_bench",
    "remote": "kvtier.bench.remote",
}


def configure(name: str, p: argparse.ArgumentParser) -> None:
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for bench, modname in BENCHES.items():
        mod = importlib.import_module(modname)
        summary = (mod.__doc__ or "").strip().splitlines()[0]
        # argparse %-formats help strings: a literal "25%" in a docstring would crash --help
        bp = bsub.add_parser(bench, help=summary.replace("%", "%%"), description=summary)
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
