"""``kvtier replay TRACE...``: policies vs LRU and Belady on real traces."""

from __future__ import annotations

import argparse
import math
import os
from typing import Any, Optional, Sequence

from kvtier.cli.output import CliError, check_output, check_plot, write_json

PUBLISHED = ("arc", "lirs", "w-tinylfu", "s3fifo", "sieve", "2q", "lhd", "gdsf")
"""The published online policies ``kvtier replay`` ranks kvtier against (with LRU and Belady)."""


def expand_policies(text: str, registered: dict) -> list[str]:
    """Policy names from a comma list, with the groups expanded, duplicates dropped."""
    names: list[str] = []
    for p in (x.strip() for x in text.split(",")):
        group = PUBLISHED if p == "published" else sorted(registered) if p == "all" else (p,) if p else ()
        for name in group:
            if name not in registered:
                raise ValueError(f"unknown policy {name!r}; choose from {sorted(registered)} or published, all")
            if name not in names:
                names.append(name)
    if not names:
        raise ValueError("--policy names no policy")
    return names


def configure(name: str, p: argparse.ArgumentParser, rest: Optional[Sequence[str]] = None) -> None:
    p.add_argument("traces", nargs="+", metavar="TRACE",
                   help="Mooncake or Qwen-Bailian JSONL trace, or synthetic:FAMILY[:SEED] (zipf, scan, loop, "
                        "shifting, chat, agent; seed 0 by default)")
    p.add_argument("--part", choices=("all", "first", "second"), default="all",
                   help="replay only the first or second half of each trace's requests (tune on one, report the other)")
    p.add_argument("--capacity", default="1%,2%,5%,10%,20%", help="capacities as %% of unique blocks")
    p.add_argument("--policy", "--policies", dest="policy", default="lru,published,kvtier,belady",
                   help="comma-separated registered policy names; 'published' stands for the published "
                        f"references ({','.join(PUBLISHED)}), 'all' for every registered policy")
    p.add_argument("--config", help="kvtier config (TOML); its [policy] section parameterises the policies "
                                    "(default: the shipped daemon/defaults/kvtier.toml)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--plot", metavar="PNG")
    p.add_argument("--tiers", metavar="HBM,DRAM[,REMOTE]",
                   help="multi-tier mode: HBM and DRAM capacities per node (e.g. 1%%,5%%) over an NVMe tier that "
                        "holds everything, and optionally a remote tier shared by --nodes nodes (e.g. 1%%,5%%,20%%)")
    # the multi-tier options default to None: given without --tiers they would be ignored, an error
    p.add_argument("--nodes", type=int, help="multi-tier: nodes sharing the trace (requests round-robin; default 1)")
    p.add_argument("--remote-gbps", type=float, help="multi-tier: remote->node bandwidth, GB/s (default 2.5)")
    p.add_argument("--publish-min-shares", type=int, choices=(0, 1),
                   help="multi-tier: publish a block once a node reused it (1, the daemon's default) or every block (0)")
    p.add_argument("--block-mib", type=float, help="multi-tier: bytes of one block, MiB (default 2)")
    p.add_argument("--dram-gbps", type=float, help="multi-tier: DRAM->HBM bandwidth, GB/s (default 20)")
    p.add_argument("--nvme-gbps", type=float, help="multi-tier: NVMe->HBM bandwidth, GB/s (default 5)")
    p.set_defaults(func=run)


TIER_DEFAULTS: dict[str, float] = {"nodes": 1, "remote_gbps": 2.5, "publish_min_shares": 1, "block_mib": 2.0,
                                   "dram_gbps": 20.0, "nvme_gbps": 5.0}
REMOTE_ONLY = ("remote_gbps", "publish_min_shares")  # mean something only with a remote tier


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_tier_args(args: argparse.Namespace) -> list[float]:
    """The ``--tiers`` capacities (empty without it), after checking the multi-tier options:
    each needs ``--tiers`` (and the remote ones a remote tier), the bandwidths and block size
    are positive, ``--nodes`` at least 1; the defaults fill in what is not given."""
    from kvtier.replay.report import parse_fractions

    given = [d for d in TIER_DEFAULTS if getattr(args, d) is not None]
    if not args.tiers:
        if given:
            raise CliError(f"{_flag(given[0])} applies to the multi-tier replay only: add --tiers HBM,DRAM[,REMOTE]")
        return []
    fr = parse_fractions(args.tiers)
    if len(fr) not in (2, 3):
        raise CliError("--tiers takes two or three capacities: HBM,DRAM[,REMOTE] (e.g. 1%,5% or 1%,5%,20%)")
    for d in REMOTE_ONLY:
        if d in given and len(fr) == 2:
            raise CliError(f"{_flag(d)} applies to a remote tier: give --tiers HBM,DRAM,REMOTE")
    for d, v in TIER_DEFAULTS.items():
        if getattr(args, d) is None:
            setattr(args, d, v)
    if args.nodes < 1:
        raise CliError(f"--nodes must be at least 1, not {args.nodes}")
    for d in ("block_mib", "dram_gbps", "nvme_gbps", "remote_gbps"):
        v = getattr(args, d)
        if not (math.isfinite(v) and v > 0):
            raise CliError(f"{_flag(d)} must be a positive number, not {v:g}")
    return fr


def _params(path: str | None, policies: list[str]) -> dict[str, Any]:
    """Policy parameters from the same config the daemon reads: the shipped default
    file, or ``--config FILE`` on top of it ([policy] and [predictor] sections).
    The published references run as published: the daemon's knobs (some share a
    name, e.g. ``reconfigure_every``) are not theirs."""
    from kvtier.daemon.config import load_config
    from kvtier.policy import POLICIES

    cfg = load_config(path, environ={})
    base = cfg.policy.params() | {"track_calibration": cfg.predictor.track_calibration,
                                  "calibration_bins": cfg.predictor.calibration_bins,
                                  "calibration_sample": cfg.predictor.calibration_sample,
                                  "recalibrate": cfg.predictor.recalibrate}
    def takes_config(name: str) -> bool:  # a reference built on kvtier (``config_params``) takes them too
        cls = POLICIES[name]
        return bool(getattr(cls, "config_params", not getattr(cls, "replay_only", False)))

    return {name: dict(base) if takes_config(name) else {} for name in policies}


def _tiered(args: argparse.Namespace, fr: list[float], trace: Any, policies: list[str], params: dict[str, Any],
            console: Any) -> list[dict]:
    from rich.markup import escape
    from rich.table import Table

    from kvtier.replay.tiered import TierSpec, simulate_tiers

    remote = max(1, round(fr[2] * trace.n_unique)) if len(fr) == 3 else 0
    spec = TierSpec(max(1, round(fr[0] * trace.n_unique)), max(1, round(fr[1] * trace.n_unique)),
                    int(args.block_mib * 2**20), args.dram_gbps * 1e9, args.nvme_gbps * 1e9,
                    args.nodes, remote, args.remote_gbps * 1e9, args.publish_min_shares)
    with progress_bar() as prog:
        task = prog.add_task(f"tiers {escape(trace.name)}", total=trace.n_accesses * len(policies))
        rows = [simulate_tiers(p, spec, trace, params.get(p, {}), lambda n: prog.advance(task, n)) for p in policies]
    fleet = f"{spec.nodes} nodes: " if spec.nodes > 1 else ""
    shared = f", remote {remote:,} shared" if remote else ""
    t = Table(title=f"{escape(trace.name)}: {fleet}tiers HBM {spec.hbm_blocks:,} + DRAM {spec.dram_blocks:,} blocks "
                    f"over NVMe{' per node' if fleet else ''}{shared}")
    cols = ["policy", "hbm hit", "dram hit", "nvme hit", *(["remote hit"] if remote else []), "miss",
            *(["fleet hit"] if "fleet_hit" in rows[0] else []), "stall s (no prefetch)"]
    for col in cols:
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(r["policy"], f"{r['hit']['hbm']:.4f}", f"{r['hit']['dram']:.4f}", f"{r['hit']['nvme']:.4f}",
                  *([f"{r['hit']['remote']:.4f}"] if remote else []), f"{r['miss']:.4f}",
                  *([f"{r['fleet_hit']:.4f}"] if "fleet_hit" in r else []), f"{r['stall_s']:.1f}")
    console.print(t)
    return rows


def _num(v: float | None, fmt: str) -> str:
    """``v`` formatted, or a dash where there is none (no capacity or run to average)."""
    return "\u2014" if v is None else format(v, fmt)


def progress_bar() -> Any:
    """The bar on stderr every long step of a replay shows (transient: gone when it is done)."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

    return Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                    TimeRemainingColumn(), console=Console(stderr=True, emoji=False), transient=True)


def plot_path(path: str, trace: str) -> str:
    """One plot a trace when several are replayed: the trace's name, without its own
    extension and with ``:`` as ``-``, before the plot's extension (``out.png`` and
    ``conv.jsonl`` -> ``out-conv.png``; ``synthetic:loop:3`` -> ``out-synthetic-loop-3.png``),
    so none overwrites another."""
    stem, ext = os.path.splitext(path)
    name = os.path.splitext(trace)[0] if not trace.startswith("synthetic:") else trace
    return f"{stem}-{name.replace(':', '-').replace(os.sep, '-')}{ext}"


def check_traces(paths: list[str]) -> None:
    """Every trace named can be read, before the first is replayed (a missing third trace
    had cost the first two's replays and their JSON)."""
    from kvtier.replay.synthetic import PREFIX, check_synthetic_name

    for path in paths:
        if path.startswith(PREFIX):
            check_synthetic_name(path)
        elif not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise CliError(f"trace not found or not readable: {path}")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from kvtier.policy import POLICIES
    from kvtier.replay.report import parse_fractions, plot, replay
    from kvtier.replay.synthetic import PREFIX, synthetic_trace
    from kvtier.replay.traces import load_trace, split_trace

    fractions = parse_fractions(args.capacity)
    tier_fractions = check_tier_args(args)  # before any replay: a bad option fails at once
    policies = expand_policies(args.policy, POLICIES)
    params = _params(args.config, policies)
    tier_policies = [p for p in policies if p != "belady" and not getattr(POLICIES[p], "offline", False)]
    if args.tiers and not tier_policies:
        raise CliError("--tiers needs an online policy (offline ones, which know the future, are not tiered)")
    check_traces(args.traces)
    check_output(args.json)
    check_plot(args.plot)
    # no emoji codes: a title "synthetic:loop: ..." rendered ":loop:" as a picture
    console = Console(emoji=False)
    if not console.is_terminal:  # piped: rich would wrap at 80 columns and cut the table
        console = Console(width=132, emoji=False)
    reports = []
    for path in args.traces:
        trace = split_trace(synthetic_trace(path) if path.startswith(PREFIX) else load_trace(path), args.part)
        total = trace.n_accesses * len(fractions) * sum(getattr(POLICIES[p], "passes", 1) for p in policies)
        with progress_bar() as prog:
            task = prog.add_task(f"replay {escape(trace.name)}", total=total)
            rep = replay(trace, fractions, policies, params, lambda n, task=task: prog.advance(task, n))
        reports.append(rep)
        table = Table(title=f"{escape(trace.name)}: block hit ratio ({trace.n_accesses:,} accesses, "
                            f"{trace.n_unique:,} unique, max {rep['max_hit_ratio']:.4f})")
        table.add_column("policy")
        for row in rep["rows"]:  # one column per capacity, one row per policy: fits any number of policies
            table.add_column(f"{row['fraction']*100:g}% ({row['capacity_blocks']:,})", justify="right")
        if rep["gap_closed"]:
            table.add_column("gap closed", justify="right")
        table.add_column("accesses/s", justify="right")
        for p in policies:
            gap = [_num(rep["gap_closed"][p], ".3f")] if rep["gap_closed"] else []
            table.add_row(p, *[f"{row['hit'][p]:.4f}" for row in rep["rows"]], *gap,
                          f"{rep['accesses_per_s'][p]:,.0f}")
        console.print(table)
        if rep["calibration"]:
            c, runs = rep["calibration"], len(rep["calibration_per_run"])
            if not c["runs"]:
                console.print(f"predictor calibration: none of the {runs} runs scored a prediction")
            else:
                raw = f" (the model's own before recalibration: {_num(c['ece_raw'], '.4f')})" if "ece_raw" in c else ""
                console.print(f"predictor calibration, {c['runs']} of {runs} runs scored: "
                              f"Brier {_num(c['brier'], '.4f')}, ECE {_num(c['ece'], '.4f')}{raw}")
        if args.plot:
            plot(rep, args.plot if len(args.traces) == 1 else plot_path(args.plot, trace.name))
        if args.tiers:
            rep["tiers"] = _tiered(args, tier_fractions, trace, tier_policies, params, console)
    write_json(args.json, reports[0] if len(reports) == 1 else {"traces": reports})
    return 0
