"""``kvtier serve``, ``stats``, ``reload`` and ``clear``: run, watch and steer a daemon."""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
from typing import Any, Callable, Optional, Sequence

from kvtier.cli.output import CliError


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", metavar="FILE",
                   help="TOML config (see daemon/defaults/kvtier.toml); default: the first that exists of "
                        "$KVTIER_CONFIG, $XDG_CONFIG_HOME/kvtier/kvtier.toml (~/.config/...), /etc/kvtier/kvtier.toml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override one config field (repeatable; beats file and environment)")


def _serve_args(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    p.add_argument("--runtime-dir", help="socket directory (shortcut for --set server.runtime_dir=...)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                   help="threshold of the daemon log (the start and stop summary lines are always written)")
    p.add_argument("--log-format", default="text", choices=["text", "json"],
                   help="json: one object a line with time, level, logger and message")
    p.set_defaults(func=cmd_serve)


def _stats_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", help="socket directory of the daemon (default: the per-user one)")
    p.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    p.set_defaults(func=cmd_stats)


def _reload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", help="socket directory of the daemon (default: the per-user one)")
    p.set_defaults(func=cmd_reload)


def _clear_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime-dir", help="socket directory of the daemon (default: the per-user one)")
    p.set_defaults(func=cmd_clear)


ARGUMENTS: dict[str, Callable[[argparse.ArgumentParser], None]] = {
    "serve": _serve_args, "stats": _stats_args, "reload": _reload_args, "clear": _clear_args}


def configure(name: str, p: argparse.ArgumentParser, rest: Optional[Sequence[str]] = None) -> None:
    ARGUMENTS[name](p)


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message (and exc when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        import datetime

        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def _setup_logging(level: str, fmt: str) -> logging.Logger:
    """The root handler at ``level``; returns the logger of the start/stop summaries, which passes
    every record whatever ``level`` says (a supervisor's journal always shows what started and stopped)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=level, handlers=[handler])
    summary = logging.getLogger("kvtier.lifecycle")
    summary.setLevel(logging.INFO)
    summary.propagate = False
    summary.addHandler(handler)  # the handler has no level of its own: INFO goes out under --log-level WARNING
    return summary


def cmd_serve(args: argparse.Namespace) -> int:
    from kvtier.daemon.allocator import pin_malloc_thresholds
    from kvtier.daemon.config import config_sources, load_config, resolve_config_path
    from kvtier.daemon.server import Server

    pin_malloc_thresholds()  # before the daemon allocates: its RSS must follow what it holds
    overrides = list(args.overrides) + (  # a relative --runtime-dir is the shell's: made absolute here
        [f"server.runtime_dir={json.dumps(os.path.abspath(args.runtime_dir))}"] if args.runtime_dir else [])
    config_path = resolve_config_path(args.config)
    cfg = load_config(config_path, overrides=overrides)
    summary = _setup_logging(args.log_level, getattr(args, "log_format", "text"))
    server = Server(cfg, config_path=config_path, overrides=overrides, discovered=args.config is None)
    server.install_signals()
    summary.info("%s", server.start_summary(config_sources(config_path, overrides=overrides)))
    # what is built by now (torch, the modules, the server) lives as long as the process. Out of the
    # cyclic collector's reach, a full collection on the owner loop no longer walks it (~85 ms with
    # torch imported), nor does the exit's last one (~0.45 s of every stop)
    gc.freeze()
    server.serve_forever()
    summary.info("%s", server.stop_summary())
    return 0


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or a pid we cannot judge: let the socket decide
    return True


def _ask(runtime_dir: "str | None", op: str, args: "dict | None" = None, timeout_s: float = 10.0,
         rejected: str = "") -> dict:
    """One call to a live daemon. A daemon.json whose process is gone (a crash left it) is
    answered at once instead of waiting out the timeout on a socket nobody reads."""
    from kvtier.client.tier_client import RequestRejected, TierClient
    from kvtier.protocol.runtime import INFO_FILE, default_runtime_dir, read_info

    rt = runtime_dir or default_runtime_dir()
    try:
        info = read_info(rt)
        pid = int(info.get("pid") or 0) if isinstance(info, dict) else -1
    except FileNotFoundError:
        raise CliError(f"no kvtier daemon in {rt} (start one with `kvtier serve`)") from None
    except (OSError, ValueError, TypeError) as e:
        raise CliError(f"cannot read {os.path.join(rt, INFO_FILE)}: {e}") from None
    if pid < 0:  # a JSON list or string: not a file the daemon wrote
        raise CliError(f"cannot read {os.path.join(rt, INFO_FILE)}: not a daemon info file")
    if pid > 0 and not _pid_alive(pid):
        raise CliError(f"the kvtier daemon is not running: pid {pid} in {os.path.join(rt, INFO_FILE)} is gone "
                       "(it did not stop cleanly; `kvtier serve` replaces its files)")
    with TierClient(runtime_dir=rt, engine_id="kvtier-cli", heartbeat_s=None, timeout_s=timeout_s) as c:
        try:
            # no public TierClient method for every node op (clear): the generic call is the RPC itself
            result: dict[str, Any] = c._call(op, args)
        except RequestRejected as e:
            raise CliError(f"{op} rejected: {e.message}{rejected}") from None
    return result


def cmd_stats(args: argparse.Namespace) -> int:
    s = _ask(args.runtime_dir, "stats")
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
    rem = s.get("remote") or {}
    if rem.get("enabled"):  # shared by the fleet: its size is the cluster's, hits are lookups found there
        t.add_row(f"remote ({rem['state']})", "-", f"{rem['published']} published", "-", "-", str(rem["hits"]))
    con.print(t)
    if rem.get("enabled"):
        con.print(f"remote: {rem['state']}  hits {rem['hits']}  misses {rem['misses']}  corrupt {rem['corrupt']}  "
                  f"published {rem['published']}  put/get MiB {rem['put_bytes'] / 2**20:.1f}/{rem['get_bytes'] / 2**20:.1f}"
                  f"  errors put/get {rem['errors']['put']}/{rem['errors']['get']}"
                  + (f"  last error: {rem['last_error']}" if rem.get("last_error") else ""))
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
    on_time = f"{s['prefetch_on_time_ratio']:.3f}" if svc.get("acquires") else "-"
    con.print(f"blocks: {s.get('blocks', {})}  acquires: {svc.get('acquires', 0)}  "
              f"on-time: {on_time}  stall: {s.get('acquire_stall_s_total', 0):.3f} s  "
              f"calibration: {s.get('calibration') or '-'}")
    pf = s.get("prefetch", {})
    if pf:
        con.print(f"prefetch: hinted {pf['hinted']}  started {pf['started']}  queued {pf['queued']}  "
                  f"speculative used/wasted/started {pf['speculative_used']}/{pf['speculative_wasted']}/{pf['speculated']}")
    events = events_line(s)
    if events:
        con.print(events)
    return 0


def events_line(stats: dict) -> str:
    """The data plane's nonzero event counts (corrupt copies, keys detached, read retries, ...)
    on one line; empty when there are none, the healthy answer."""
    events = {k: v for k, v in (stats.get("io") or {}).get("events", {}).items() if v}
    return "data-plane events: " + "  ".join(f"{k} {v}" for k, v in events.items()) if events else ""


def cmd_reload(args: argparse.Namespace) -> int:
    """Every changed key, and whether it took effect or waits for a restart."""
    r = _ask(args.runtime_dir, "reload", rejected="; the daemon keeps its running config")
    applied, restart = r.get("keys") or [], r.get("restart") or []
    if not applied and not restart:
        print("reloaded: no changes")
    for key in applied:
        print(f"{key}: applied")
    for key in restart:
        print(f"{key}: needs a restart (the daemon keeps running with the old value)")
    for note in r.get("notes", []):
        print(f"note: {note}")
    return 0


def cmd_clear(args: argparse.Namespace) -> int:
    """Drop every cached block; a daemon no engine has registered with holds none."""
    if not _ask(args.runtime_dir, "stats").get("tiers"):
        print("cleared 0 cached blocks (no engine has registered yet)")
        return 0
    n = int(_ask(args.runtime_dir, "clear").get("dropped", 0))
    print(f"cleared {n} cached block{'s' if n != 1 else ''}")
    return 0
