"""Expected failures of every command end in one ``kvtier: error:`` line and a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys

import pytest

from kvtier.cli.bench import BENCHES
from kvtier.cli.main import COMMANDS, build_parser, main

from .helpers import kvtier, one_error_line


def test_bench_help_survives_a_percent_sign_in_a_docstring():
    r = kvtier("bench", "--help")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert "25% HBM budget" in r.stdout


def test_demo_with_an_unknown_policy():
    line = one_error_line(kvtier("demo", "--policy", "nonexistent"))
    assert "unknown policy 'nonexistent'" in line and "lru" in line


def test_serve_with_a_busy_metrics_port_leaves_nothing_behind(tmp_path):
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    rt = tmp_path / "run"
    try:
        r = kvtier("serve", "--runtime-dir", str(rt), "--set", f"tiers.nvme_dir={json.dumps(str(tmp_path / 'nvme'))}",
                   "--set", f"metrics.port={port}", timeout=60)
    finally:
        busy.close()
    line = one_error_line(r)
    assert f"127.0.0.1:{port}" in line and "in use" in line
    assert not [p.name for p in rt.iterdir() if p.suffix == ".sock" or p.name == "daemon.json"]


def test_serve_with_a_missing_config_file():
    line = one_error_line(kvtier("serve", "--config", "/nonexistent.toml"))
    assert "/nonexistent.toml" in line and "cannot read" in line


def test_stats_of_a_dead_daemon_answers_at_once(tmp_path):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    rt = tmp_path / "run"
    rt.mkdir()
    stale = socket.socket(socket.AF_UNIX)  # a crash leaves the socket file; nobody reads it
    stale.bind(str(rt / "rpc.sock"))
    stale.close()
    (rt / "daemon.json").write_text(json.dumps({"pid": gone.pid, "rpc": f"ipc://{rt / 'rpc.sock'}",
                                                "telemetry": f"ipc://{rt / 'telemetry.sock'}",
                                                "events": f"ipc://{rt / 'events.sock'}", "metrics_port": None}))
    line = one_error_line(kvtier("stats", "--runtime-dir", str(rt), timeout=5))
    assert "not running" in line and str(gone.pid) in line


def test_stats_without_a_daemon(tmp_path):
    line = one_error_line(kvtier("stats", "--runtime-dir", str(tmp_path / "none"), timeout=5))
    assert "no kvtier daemon" in line


def _subcommands(parser: argparse.ArgumentParser, prefix: list[str]) -> list[list[str]]:
    """Every command line under ``parser`` that has a --help of its own (sub-subcommands included)."""
    out = [prefix]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _subcommands(sub, [*prefix, name])
    return out


def _all_command_lines() -> list[list[str]]:
    lines = []
    for name in COMMANDS:
        parser = build_parser([name])
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        lines += _subcommands(sub, [name])
    return lines


def test_the_walk_finds_every_bench_and_config_action():
    lines = {" ".join(x) for x in _all_command_lines()}
    assert {f"bench {b}" for b in BENCHES} <= lines
    assert {"config show", "config validate", "config schema", "clear"} <= lines


@pytest.mark.parametrize("argv", _all_command_lines(), ids=" ".join)
def test_every_help_works(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main([*argv, "--help"])
    out = capsys.readouterr()
    assert e.value.code == 0 and "Traceback" not in out.err and out.out.startswith("usage: kvtier")
