"""The demo's arguments, progress bar and summary table: shared by ``kvtier demo`` and ``bench e2e``."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from kvtier.bench.args import positive_float, positive_int


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.bench.demo_options import MODEL_SIZES, WORKLOADS, DemoOptions

    d = DemoOptions()
    p.add_argument("--model", default=d.model, choices=sorted(MODEL_SIZES), help="model size (random weights, seed)")
    p.add_argument("--sessions", type=positive_int, default=d.sessions, help="chat sessions sharing a system prompt")
    p.add_argument("--turns", type=positive_int, default=d.turns, help="turns per session")
    p.add_argument("--system-tokens", type=positive_int, default=d.system_tokens)
    p.add_argument("--user-tokens", type=positive_int, default=d.user_tokens)
    p.add_argument("--gen-tokens", type=positive_int, default=d.gen_tokens, help="tokens generated per turn")
    p.add_argument("--budget", type=positive_float, default=d.budget, help="HBM budget as a fraction of the workload's KV")
    p.add_argument("--policy", default=d.policy, help="placement policy of the daemon")
    p.add_argument("--no-hints", action="store_true", help="do not tell the daemon the schedule (no prefetch)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--workload", default=d.workload, choices=sorted(WORKLOADS),
                   help="node: >= 1 GiB of KV in 512 KiB blocks, HBM and DRAM 25%% each, the rest on NVMe "
                        "(flags left at their defaults take the preset's values)")


def options_from(args: argparse.Namespace):
    from kvtier.bench.demo_options import WORKLOADS, DemoOptions

    d = DemoOptions()
    for name, value in WORKLOADS[getattr(args, "workload", "demo")].items():  # a preset fills flags left at default
        if getattr(args, name, getattr(d, name)) == getattr(d, name):
            setattr(args, name, value)

    for name in ("sessions", "turns", "system_tokens", "user_tokens", "gen_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.gen_tokens < 2:
        raise ValueError("--gen-tokens must be >= 2 (decode speed is measured over steps after the first)")
    if not 0 < args.budget <= 1:
        raise ValueError("--budget must be in (0, 1]")
    return DemoOptions(sessions=args.sessions, turns=args.turns, system_tokens=args.system_tokens,
                       user_tokens=args.user_tokens, gen_tokens=args.gen_tokens, seed=args.seed, model=args.model,
                       budget=args.budget, hints=not args.no_hints, policy=args.policy,
                       dram_budget=getattr(args, "dram_budget", None), workload=getattr(args, "workload", "demo"))


def run_with_progress(opts, keep: bool = False) -> dict:
    from kvtier.bench.demo import run_demo

    con = Console(stderr=True)
    with Progress(TextColumn("[bold]kvtier demo"), BarColumn(), TextColumn("{task.completed}/{task.total} turns"),
                  TextColumn("{task.description}"), TimeElapsedColumn(), console=con, transient=True) as prog:
        task = prog.add_task("starting", total=opts.sessions * opts.turns)

        def progress(done: int, total: int, what: str) -> None:
            prog.update(task, completed=done, total=total, description=what)

        return run_demo(opts, progress, keep=keep)


def format_ratio(x: "float | None") -> str:
    """A ratio to 3 places, or "-" where nothing was there to count (no acquires)."""
    return "-" if x is None else f"{x:.3f}"


def print_summary(r: dict) -> None:
    con = Console()
    plan = r["plan"]
    con.print(f"model [bold]{r['options']['model']}[/], {r['options']['sessions']} sessions x {r['options']['turns']} turns, "
              f"{plan['total_blocks']} KV blocks of {r['block_bytes'] // 1024} KiB ({r['kv_bytes'] / 2**20:.0f} MiB); "
              f"HBM {plan['hbm_blocks']} blocks, DRAM {plan['dram_blocks']} "
              f"({plan['hbm_blocks'] / plan['total_blocks']:.0%} of the KV"
              + (", raised to fit one session" if plan["hbm_raised"] else "") + ")")
    t = Table(title="tiers")
    for col in ("tier", "slots", "used", "hits"):
        t.add_column(col, justify="right")
    for row in r["tiers"]:
        t.add_row(row["tier"], str(row["slots"]), str(row["used"]), str(row.get("hits", 0)))
    rem = r.get("remote") or {}
    if rem.get("enabled"):  # the shared tier: hits are keys found there on a local miss
        t.add_row(f"remote ({rem['state']})", "-", f"{rem['published']} published", str(rem["hits"]))
    con.print(t)
    p = Table(title="moves")
    for col in ("path", "blocks", "MiB"):
        p.add_column(col, justify="right")
    for path, row in sorted(r["paths"].items()):
        p.add_row(path, str(int(row.get("moves", 0))), f"{row.get('bytes', 0) / 2**20:.1f}")
    con.print(p)
    s = Table(title="run")
    s.add_column("metric")
    s.add_column("value", justify="right")
    s.add_row("whole-turn tokens/s untiered (DynamicCache) / tiered (kvtier)",
              f"{r['tokens_per_s_untiered']:.1f} / {r['tokens_per_s_tiered']:.1f}")
    s.add_row("prefill tokens/s untiered / tiered", f"{r['prefill_tokens_per_s_untiered']:.1f} / "
                                                     f"{r['prefill_tokens_per_s_tiered']:.1f}")
    s.add_row("decode tokens/s untiered / tiered", f"{r['decode_tokens_per_s_untiered']:.1f} / "
                                                    f"{r['decode_tokens_per_s_tiered']:.1f}")
    s.add_row("ratio tiered / untiered: whole turn (prefill, decode)",
              f"{r['ratio']:.2f} ({r['prefill_ratio']:.2f}, {r['decode_ratio']:.2f})")
    s.add_row("TTFT p50 untiered / tiered", f"{r['ttft_s_untiered']['p50'] * 1e3:.1f} / "
                                             f"{r['ttft_s_tiered']['p50'] * 1e3:.1f} ms")
    s.add_row("prefetch on-time (acquires finding all blocks in HBM)",
              f"{format_ratio(r['prefetch_on_time'])} of {r['acquires']}")
    s.add_row("acquire stall", f"{r['stall_s']:.3f} s")
    pf = r.get("prefetch", {})
    if pf.get("speculated"):
        s.add_row("speculative promotions: used / wasted / started",
                  f"{pf['speculative_used']} / {pf['speculative_wasted']} / {pf['speculated']}")
    s.add_row("turns / steps compared", f"{r['turns_checked']} / {r['steps_checked']}")
    con.print(s)
    verdict = "[bold green]PASS: tokens and logits bit-identical (torch.equal) in every turn[/]" if r["bit_exact"] \
        else f"[bold red]FAIL: outputs differ in turns {r['mismatched_turns']}[/]"
    con.print(verdict)
    if r["daemon"]["kept"]:
        con.print(f"daemon left running (pid {r['daemon']['pid']}): "
                  f"kvtier stats --runtime-dir {r['daemon']['runtime_dir']}")
