"""``kvtier demo``: the main job. A real model, a real daemon, bit-exact outputs under memory pressure."""

from __future__ import annotations

import argparse
from typing import Optional, Sequence


def configure(name: str, p: argparse.ArgumentParser, rest: Optional[Sequence[str]] = None) -> None:
    from kvtier.bench.demo_report import add_demo_arguments

    add_demo_arguments(p)
    p.add_argument("--keep", action="store_true", help="leave the daemon running afterwards (see `kvtier stats`)")
    p.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    p.set_defaults(func=cmd_demo)


def cmd_demo(args: argparse.Namespace) -> int:
    from kvtier.bench.demo_report import options_from, print_summary, run_with_progress
    from kvtier.cli.output import check_output, write_json

    check_output(args.json)
    r = run_with_progress(options_from(args), keep=args.keep)
    print_summary(r)
    write_json(args.json, r)
    return 0 if r["bit_exact"] else 1

