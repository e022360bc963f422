"""``kvtier bench {tiers,...}``: benchmark registry."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

# bench name -> module with ``add_arguments(p)`` and ``run(args) -> dict``
BENCHES: dict[str, str] = {
    "tiers": "kvtier.daemon.bench.tiers",
    "rpc": "kvtier.daemon.bench.rpc",
    "e2e": "kvtier.daemon.bench.e2e",
}


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("bench", help="benchmarks against a raw baseline measured in the same run")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH")
    for name, modname in BENCHES.items():
        mod = importlib.import_module(modname)
        bp = bsub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0])
        bp.add_argument("--json", metavar="PATH", help="write the results as JSON here")
        mod.add_arguments(bp)
        bp.set_defaults(func=lambda a, m=mod: _run(m, a))
    p.set_defaults(func=lambda a: p.print_help() or 2)


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)


def _run(mod: Any, args: argparse.Namespace) -> int:
    result = mod.run(args)
    write_json(args.json, result)
    return 0  # below-target ratios are reported (JSON "ok", table verdict), not errors
