"""``kvtier replay TRACE...``: policies vs LRU and Belady on real traces."""

from __future__ import annotations

import argparse
import tomllib
from typing import Any

from .bench import write_json


def register(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    p = sub.add_parser("replay", help="replay traces through policies; compare with LRU and Belady")
    p.add_argument("traces", nargs="+", metavar="TRACE", help="Mooncake or Qwen-Bailian JSONL trace")
    p.add_argument("--capacity", default="1%,2%,5%,10%,20%", help="capacities as %% of unique blocks")
    p.add_argument("--policy", default="lru,s3fifo,kvtier,belady", help="comma-separated policy names")
    p.add_argument("--config", help="TOML file; its [policy.params.NAME] tables are passed to policy NAME")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG")
    p.set_defaults(func=run)


def _params(path: str | None) -> dict[str, Any]:
    if not path:
        return {}
    with open(path, "rb") as f:
        try:
            cfg = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: {e}") from None
    params = cfg.get("policy", {}).get("params", {})
    if not isinstance(params, dict):
        raise ValueError(f"{path}: [policy.params] must be a table of tables")
    return params


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn
    from rich.table import Table

    from kvtier.daemon.policy import POLICIES
    from kvtier.daemon.replay.report import parse_fractions, plot, replay
    from kvtier.daemon.replay.traces import load_trace

    fractions = parse_fractions(args.capacity)
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; choose from {sorted(POLICIES)}")
    params = _params(args.config)
    console = Console()
    reports = []
    for path in args.traces:
        trace = load_trace(path)
        total = trace.n_accesses * len(fractions) * len(policies)
        with Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                      TimeRemainingColumn(), console=Console(stderr=True), transient=True) as prog:
            task = prog.add_task(f"replay {trace.name}", total=total)
            rep = replay(trace, fractions, policies, params, lambda n: prog.advance(task, n))
        reports.append(rep)
        table = Table(title=f"{trace.name}: block hit ratio ({trace.n_accesses:,} accesses, "
                            f"{trace.n_unique:,} unique, max {rep['max_hit_ratio']:.4f})")
        table.add_column("capacity", justify="right")
        table.add_column("blocks", justify="right")
        for p in policies:
            table.add_column(p, justify="right")
        for row in rep["rows"]:
            table.add_row(f"{row['fraction']*100:g}%", f"{row['capacity_blocks']:,}",
                          *[f"{row['hit'][p]:.4f}" for p in policies])
        if rep["gap_closed"]:
            table.add_row("gap closed", "", *[f"{rep['gap_closed'][p]:.3f}" for p in policies])
        table.add_row("accesses/s", "", *[f"{rep['accesses_per_s'][p]:,.0f}" for p in policies])
        console.print(table)
        if rep["calibration"]:
            console.print(f"predictor calibration: Brier {rep['calibration']['brier']:.4f}, "
                          f"ECE {rep['calibration']['ece']:.4f}")
        if args.plot:
            plot(rep, args.plot if len(args.traces) == 1 else args.plot.replace(".png", f"-{trace.name}.png"))
    write_json(args.json, reports[0] if len(reports) == 1 else {"traces": reports})
    return 0
