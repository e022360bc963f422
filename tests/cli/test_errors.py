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


def test_serve_with_kvikio_where_it_cannot_run_says_why_at_start(tmp_path):
    from kvtier.tiers.io_backends import kvikio_status, select_backend

    if kvikio_status()[0]:
        pytest.skip("kvikio runs here")
    with pytest.raises(ValueError, match="'kvikio' cannot run here"):  # a register answers invalid, not internal
        select_backend("kvikio")
    rt = tmp_path / "run"
    r = kvtier("serve", "--runtime-dir", str(rt), "--set", f"tiers.nvme_dir={json.dumps(str(tmp_path / 'nvme'))}",
               "--set", "metrics.port=0", "--set", 'tiers.io_backend="kvikio"', timeout=60)
    line = one_error_line(r)  # at start: it had passed until the first register failed with a traceback
    assert "tiers.io_backend = 'kvikio' cannot run here" in line and kvikio_status()[1] in line
    assert not [p.name for p in rt.iterdir() if p.suffix == ".sock" or p.name == "daemon.json"]


def test_serve_with_a_copy_loop_the_cpu_lacks_says_why_at_start(tmp_path):
    from kvtier.tiers.copy_tuning import LOOPS, runnable_loops

    lacking = [k for k in LOOPS if k not in runnable_loops()]
    if not lacking:
        pytest.skip("this CPU runs every copy loop")
    rt = tmp_path / "run"
    r = kvtier("serve", "--runtime-dir", str(rt), "--set", f"tiers.nvme_dir={json.dumps(str(tmp_path / 'nvme'))}",
               "--set", "metrics.port=0", "--set", f'tiers.copy_loop="{lacking[-1]}"', timeout=60)
    line = one_error_line(r)
    assert f"tiers.copy_loop = '{lacking[-1]}' cannot run here" in line
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


def test_stats_with_a_live_pid_and_a_stale_socket_answers_at_once(tmp_path):
    """A daemon killed while its pid lives on (a zombie its parent has not reaped, a reused pid,
    another pid namespace) left a socket file nobody listens on: stats waited out 10 s on it."""
    rt = tmp_path / "run"
    rt.mkdir()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(rt / "rpc.sock"))
    stale.close()
    (rt / "daemon.json").write_text(json.dumps({"pid": 1, "rpc": f"ipc://{rt / 'rpc.sock'}",
                                                "telemetry": f"ipc://{rt / 'telemetry.sock'}",
                                                "events": f"ipc://{rt / 'events.sock'}", "metrics_port": None}))
    line = one_error_line(kvtier("stats", "--runtime-dir", str(rt), timeout=8))
    assert "nobody listens on" in line and "rpc.sock" in line


def test_every_expected_error_class_exists():
    """A class that moved (KvtierError went to ``client.replies``) made every daemon-connection
    failure (no reply, no socket) a traceback."""
    import importlib

    from kvtier.cli.main import EXPECTED

    for name in EXPECTED:
        module, _, qualname = name.rpartition(".")
        cls = getattr(importlib.import_module(module), qualname)
        assert f"{cls.__module__}.{cls.__qualname__}" == name  # matched by its defining module's name


def test_stats_with_a_live_pid_and_no_socket_is_one_line(tmp_path):
    rt = tmp_path / "run"
    rt.mkdir()  # pid 1 is alive (a reused pid after a crash); the socket is gone
    (rt / "daemon.json").write_text(json.dumps({"pid": 1, "rpc": f"ipc://{rt / 'rpc.sock'}"}))
    line = one_error_line(kvtier("stats", "--runtime-dir", str(rt), timeout=30))
    assert "no daemon socket" in line


@pytest.mark.parametrize("info", [[1], {"pid": 1}, "x"])
def test_stats_with_a_malformed_info_file_is_one_line(tmp_path, info):
    rt = tmp_path / "run"
    rt.mkdir()
    (rt / "daemon.json").write_text(json.dumps(info))
    line = one_error_line(kvtier("stats", "--runtime-dir", str(rt), timeout=30))
    assert "daemon" in line


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


def _tiny_trace(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "hash_ids": [i % 7]}) + "\n" for i in range(40)))
    return p


@pytest.mark.parametrize("flag, target, needle", [
    ("--json", "adir", "is a directory"),
    ("--json", "afile/out.json", "cannot write there"),
    ("--plot", "out.xyz", "name a file ending in one of"),
])
def test_replay_refuses_an_unwritable_output_before_it_runs(tmp_path, flag, target, needle):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    line = one_error_line(kvtier("replay", str(_tiny_trace(tmp_path)), "--policy", "lru", "--capacity", "10%",
                                 flag, str(tmp_path / target)))
    assert needle in line
    assert sorted(x.name for x in tmp_path.iterdir()) == ["adir", "afile", "t.jsonl"]  # nothing left behind
    assert not list((tmp_path / "adir").iterdir())


def test_replay_checks_every_trace_before_the_first(tmp_path):
    line = one_error_line(kvtier("replay", str(_tiny_trace(tmp_path)), "synthetic:nope", "--policy", "lru",
                                 "--capacity", "10%", "--json", str(tmp_path / "r.json")))
    assert "unknown synthetic family 'nope'" in line and not (tmp_path / "r.json").exists()
    line = one_error_line(kvtier("replay", str(_tiny_trace(tmp_path)), str(tmp_path / "missing.jsonl"),
                                 "--policy", "lru", "--capacity", "10%"))
    assert "missing.jsonl" in line


@pytest.mark.parametrize("body, needle", [
    (b'{"timestamp":0,"hash_ids":[]}\n{"timestamp":1,"hash_ids":[]}\n', "no request names a block"),
    (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", "not UTF-8"),  # a gzipped trace
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "nested too deeply"),
])
def test_replay_of_a_trace_it_cannot_use_is_one_line(tmp_path, body, needle):
    p = tmp_path / "bad.jsonl"
    p.write_bytes(body)
    line = one_error_line(kvtier("replay", str(p), "--policy", "lru", "--capacity", "10%"))
    assert needle in line


def test_replay_tiers_with_offline_policies_only_is_one_line(tmp_path):
    line = one_error_line(kvtier("replay", str(_tiny_trace(tmp_path)), "--policy", "belady", "--capacity", "10%",
                                 "--tiers", "10%,20%"))
    assert "needs an online policy" in line


@pytest.mark.parametrize("argv, needle", [
    (["bench", "tiers", "--block-kib", "0"], "must be at least 1"),  # a ZeroDivisionError traceback before
    (["bench", "tiers", "--total-mib", "-1"], "must be at least 1"),  # ran, on nothing
    (["bench", "tiers", "--reps", "0"], "must be at least 1"),
    (["bench", "tiers", "--io-backend", "bogus"], "invalid choice"),  # refused after shared memory was made
    (["bench", "scale", "--seconds", "inf"], "positive finite number"),
    (["demo", "--budget", "0"], "positive finite number"),
])
def test_bench_sizes_counts_and_durations_must_be_positive(argv, needle):
    r = kvtier(*argv, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr and needle in r.stderr, r.stderr


def test_serve_whose_second_socket_cannot_bind_leaves_nothing_behind(tmp_path):
    """The rpc socket binds, the telemetry one cannot (a directory holds its path): the
    start fails in one line, and removes the rpc socket file it had made; the metrics
    port and the runtime directory's lock go with the process."""
    rt = tmp_path / "run"
    rt.mkdir(mode=0o700)
    (rt / "telemetry.sock").mkdir()
    r = kvtier("serve", "--runtime-dir", str(rt), "--set", f"tiers.nvme_dir={json.dumps(str(tmp_path / 'nvme'))}",
               "--set", "metrics.port=0", timeout=60)
    line = one_error_line(r)
    assert "telemetry.sock" in line
    assert sorted(p.name for p in rt.iterdir() if not p.name.startswith(".")) == ["telemetry.sock"]


def test_a_server_whose_socket_cannot_bind_releases_its_port_and_lock(tmp_path):
    """In one process (an embedding, a test): the failed start's exporter thread and
    runtime lock are given back, so a second start in the same directory succeeds."""
    from kvtier.daemon.config import load_config
    from kvtier.daemon.server import Server

    rt = tmp_path / "run"
    rt.mkdir(mode=0o700)
    (rt / "events.sock").mkdir()
    cfg = load_config(environ={}, overrides=[f"server.runtime_dir={json.dumps(str(rt))}",
                                             f"tiers.nvme_dir={json.dumps(str(tmp_path / 'nvme'))}",
                                             "metrics.port=0"])
    with pytest.raises(IsADirectoryError):
        Server(cfg)
    assert sorted(p.name for p in rt.iterdir() if not p.name.startswith(".")) == ["events.sock"]
    (rt / "events.sock").rmdir()
    second = Server(cfg)  # the lock is free again
    try:
        assert (rt / "rpc.sock").exists() and (rt / "events.sock").exists()
    finally:
        second.shutdown()
