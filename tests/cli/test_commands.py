"""``kvtier clear``, ``config show`` round trips, and commands leave no temp directories behind."""

from __future__ import annotations

import json
import os

import numpy as np

from kvtier.bench.spawn import DaemonProcess
from kvtier.cli.main import main
from kvtier.daemon.config import load_config
from kvtier.tiers.types import DATA_PLANE_EVENTS

from .helpers import kvtier

SMALL = ("tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0")


def test_clear_drops_every_cached_block_of_a_live_daemon(tmp_path):
    d = DaemonProcess(tmp_path, *SMALL)
    try:
        rt = str(d.runtime_dir)
        r = kvtier("clear", "--runtime-dir", rt, timeout=30)
        assert (r.returncode, r.stdout) == (0, "cleared 0 cached blocks (no engine has registered yet)\n"), r.stderr
        with d.client(heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            cached, _ = c.alloc(3, seq=1)
            c.seal(cached, np.array([11, 12, 13], dtype=np.uint64), seq=1)
            c.free(seqs=[1])
            live, _ = c.alloc(2, seq=2)  # referenced: clear leaves it
            assert c.stats()["blocks"]["cached"] == 3
            r = kvtier("clear", "--runtime-dir", rt, timeout=30)
            assert (r.returncode, r.stdout) == (0, "cleared 3 cached blocks\n"), r.stderr
            blocks = c.stats()["blocks"]
            assert blocks["cached"] == 0 and blocks["live"] == 2
    finally:
        assert d.stop() == 0


def test_stats_names_the_data_plane_s_events_once_there_are_some(tmp_path):
    d = DaemonProcess(tmp_path, *SMALL)
    try:
        rt = str(d.runtime_dir)
        with d.client(heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            first, _ = c.alloc(1, seq=1)
            c.seal(first, np.array([11], dtype=np.uint64), seq=1)
            r = kvtier("stats", "--runtime-dir", rt, timeout=30)
            assert r.returncode == 0 and "data-plane events" not in r.stdout, r.stderr
            assert c.stats()["io"]["events"] == dict.fromkeys(sorted(DATA_PLANE_EVENTS), 0)  # scraped from the start
            second, _ = c.alloc(1, seq=2)
            assert c.seal(second, np.array([11], dtype=np.uint64), seq=2).tolist() == first.tolist()
            r = kvtier("stats", "--runtime-dir", rt, timeout=30)
            assert r.returncode == 0 and "data-plane events: seal_dedup 1" in r.stdout, r.stderr
    finally:
        assert d.stop() == 0


def test_config_show_toml_round_trips(tmp_path, capsys, monkeypatch):
    for name in [n for n in os.environ if n.startswith("KVTIER_")]:
        monkeypatch.delenv(name)
    overrides = ["scoring.segment_weights={system = 1.0, \"tool call\" = 0.25}", "tiers.dram_numa_node=1",
                 'policy.name="lru"', "policy.prefetch_budget_bytes_per_s=1.5e9"]
    assert main(["config", "show", *[x for o in overrides for x in ("--set", o)]]) == 0
    text = capsys.readouterr().out
    assert "tcp_port" not in text  # unset: TOML has no null, and a set tcp_port is refused
    path = tmp_path / "shown.toml"
    path.write_text(text)
    assert main(["config", "validate", str(path)]) == 0
    assert capsys.readouterr().out == f"{path}: ok\n"
    assert load_config(path, environ={}) == load_config(overrides=overrides)  # KVTIER_* unset above
    assert main(["config", "show", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["server"]["tcp_port"] is None


def test_config_validate_reports_one_line(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[scoring]\nema = 7\n[tiers]\nbogus = 1\n")
    r = kvtier("config", "validate", str(bad))
    assert r.returncode == 1 and "Traceback" not in r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("kvtier: error: invalid configuration") and f"{bad}:2: scoring.ema" in line
    assert f"{bad}:4: tiers.bogus" in line


def test_config_validate_ignores_the_environment(tmp_path):
    """validate checks the file alone: a variable it ignores cannot fail it (a relative runtime dir)."""
    good = tmp_path / "good.toml"
    good.write_text("[scoring]\nema = 0.5\n")
    r = kvtier("config", "validate", str(good), env={"KVTIER_RUNTIME_DIR": "relative/run"})
    assert r.returncode == 0 and r.stdout == f"{good}: ok\n", r.stderr


def test_demo_removes_its_temp_dir(tmp_path):
    r = kvtier("demo", "--sessions", "1", "--turns", "1", "--gen-tokens", "2", env={"TMPDIR": str(tmp_path)},
               timeout=300)
    assert r.returncode == 0, r.stderr
    assert "PASS" in r.stdout
    assert not list(tmp_path.glob("kvtier-demo-*"))


def test_bench_rpc_removes_its_temp_dir(tmp_path):
    r = kvtier("bench", "rpc", "--iters", "5", "--telemetry-messages", "2", env={"TMPDIR": str(tmp_path)},
               timeout=120)
    assert r.returncode == 0, r.stderr
    assert not list(tmp_path.glob("kvtier-bench-rpc-*"))


def test_bench_tiers_leaves_nothing_in_the_nvme_dir(tmp_path):
    given = tmp_path / "given"
    given.mkdir()
    args = ["bench", "tiers", "--block-kib", "64", "--total-mib", "1", "--reps", "1", "--copy-rounds", "1",
            "--metadata-blocks", "100"]
    assert main([*args, "--nvme-dir", str(given)]) == 0
    assert list(given.iterdir()) == []
    assert main([*args, "--nvme-dir", str(tmp_path / "made")]) == 0
    assert not (tmp_path / "made").exists()
    assert main([*args, "--nvme-dir", str(given), "--keep"]) == 0
    (kept,) = given.iterdir()
    assert kept.name.startswith("kvtier-bench-") and any(kept.iterdir())
