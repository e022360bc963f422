"""``kvtier serve``, ``kvtier stats`` and ``kvtier reload``: run and watch a daemon."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE", help="TOML config (see daemon/defaults/kvtier.toml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable; beats file and environment)")


def _serve_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--runtime-dir", help="socket directory (shortcut for --set server.runtime_dir=...)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.set_defaults(func=cmd_serve)


def _stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", help="socket directory of the daemon (default: the per-user one)")
    p.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    p.set_defaults(func=cmd_stats)


def _reload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", help="socket directory of the daemon (default: the per-user one)")
    p.set_defaults(func=cmd_reload)


def configure(name: str, p: argparse.ArgumentParser) -> None:
    {"serve": _serve_args, "stats": _stats_args, "reload": _reload_args}[name](p)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvtier.daemon.config import load_config
    from kvtier.daemon.server import Server

    overrides = list(args.overrides) + ([f"server.runtime_dir={json.dumps(args.runtime_dir)}"] if args.runtime_dir else [])
    cfg = load_config(args.config, overrides=overrides)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = Server(cfg, config_path=args.config, overrides=overrides)
    server.install_signals()
    port = server.exporter.port if server.exporter else None
    logging.getLogger("kvtier").info("serving %s (metrics: %s), policy %s", server.endpoints["rpc"],
                                     f"http://{cfg.metrics.host}:{port}/metrics" if port else "off", cfg.policy.name)
    server.serve_forever()
    return 0


def _client(runtime_dir: "str | None"):
    from kvtier.client.tier_client import TierClient

    return TierClient(runtime_dir=runtime_dir, engine_id="kvtier-cli", heartbeat_s=None, timeout_s=10.0)


def _ask(runtime_dir: "str | None", op: str, failure: str) -> "dict | None":
    """One call to a live daemon; None (after a message) when it fails."""
    from kvtier.client.tier_client import KvtierError

    try:
        with _client(runtime_dir) as c:
            return getattr(c, op)()
    except KvtierError as e:
        print(f"kvtier: {failure}{e}", file=sys.stderr)
        return None


def cmd_stats(args: argparse.Namespace) -> int:
    s = _ask(args.runtime_dir, "stats", "")
    if s is None:
        return 1
    if args.json:
        print(json.dumps(s, indent=2, sort_keys=True, default=str))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    if not s.get("tiers"):
        con.print(f"kvtier daemon up (policy {s.get('policy')}, metrics port {s.get('metrics_port')}); "
                  "no engine has registered yet, so the block size and tiers are not set up")
        return 0
    t = Table(title=f"kvtier daemon — policy {s.get('policy')}, metrics port {s.get('metrics_port')}")
    for col in ("tier", "slots", "used", "used MiB", "capacity MiB", "hits"):
        t.add_column(col, justify="right")
    for row in s.get("tiers", []):
        t.add_row(row["tier"], str(row["slots"]), str(row["used"]), f"{row['used_bytes'] / 2**20:.1f}",
                  f"{row['capacity_bytes'] / 2**20:.1f}", str(row.get("hits", 0)))
    con.print(t)
    p = Table(title="mover paths")
    for col in ("path", "moves", "MiB", "errors", "GB/s"):
        p.add_column(col, justify="right")
    for path, row in sorted(s.get("paths", {}).items()):
        p.add_row(path, str(int(row.get("moves", 0))), f"{row.get('bytes', 0) / 2**20:.1f}",
                  str(int(row.get("errors", 0))), f"{row.get('bandwidth_bytes_per_s', 0) / 1e9:.2f}")
    con.print(p)
    e = Table(title="engines")
    for col in ("engine", "pid", "live blocks", "pins", "sequences"):
        e.add_column(col)
    for row in s.get("engines", []):
        e.add_row(row["engine"], str(row["pid"]), str(row["live_blocks"]), str(row["pins"]), str(row["sequences"]))
    con.print(e)
    svc = s.get("service", {})
    con.print(f"blocks: {s.get('blocks', {})}  acquires: {svc.get('acquires', 0)}  "
              f"on-time: {s.get('prefetch_on_time_ratio', 1.0):.3f}  stall: {s.get('acquire_stall_s_total', 0):.3f} s  "
              f"calibration: {s.get('calibration') or '-'}")
    pf = s.get("prefetch", {})
    if pf:
        con.print(f"prefetch: hinted {pf['hinted']}  started {pf['started']}  queued {pf['queued']}  "
                  f"speculative used/wasted/started {pf['speculative_used']}/{pf['speculative_wasted']}/{pf['speculated']}")
    return 0


def cmd_reload(args: argparse.Namespace) -> int:
    r = _ask(args.runtime_dir, "reload", "reload rejected, the daemon keeps its config: ")
    if r is None:
        return 1
    print(f"reloaded: {', '.join(r.get('changed') or []) or 'no changes'}")
    for note in r.get("notes", []):
        print(f"note: {note}")
    return 0

