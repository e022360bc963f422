"""Reload names every changed key and says which ones wait for a restart."""

from __future__ import annotations

from kvtier.bench.spawn import DaemonProcess
from kvtier.daemon.config import load_config
from kvtier.daemon.reload import changed_keys, plan_reload
from kvtier.protocol.runtime import read_info

from .helpers import kvtier


def test_changed_keys_are_section_dot_field():
    a = load_config(environ={})
    b = load_config(environ={}, overrides=["tiers.dram_bytes=4096", "scoring.ema=0.5", "metrics.port=1234"])
    assert changed_keys(a, b) == ["tiers.dram_bytes", "scoring.ema", "metrics.port"]
    assert changed_keys(a, a) == []


def test_plan_reload_applies_hot_keys_and_names_restart_ones(tmp_path):
    cur = load_config(environ={})
    p = tmp_path / "k.toml"
    p.write_text("[scoring]\nema = 0.5\n[policy]\nsamples = 8\n[tiers]\nhbm_bytes = 4096\n"
                 "[server]\nheartbeat_timeout_s = 3.0\n[metrics]\nenabled = false\n")
    plan = plan_reload(cur, p, environ={})
    assert plan.applied == ["policy.samples", "scoring.ema"]
    assert plan.restart == ["server.heartbeat_timeout_s", "tiers.hbm_bytes", "metrics.enabled"]
    assert plan.sections == ["policy", "scoring"]
    assert plan.config.scoring.ema == 0.5 and plan.config.policy.samples == 8
    assert plan.config.tiers.hbm_bytes == cur.tiers.hbm_bytes and plan.config.metrics.enabled  # kept running


def test_kvtier_reload_lists_keys_against_a_live_daemon(tmp_path):
    cfg = tmp_path / "k.toml"
    cfg.write_text("[scoring]\nema = 0.3\n")
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0",
                      config=str(cfg))
    rt = str(d.runtime_dir)
    try:
        r = kvtier("reload", "--runtime-dir", rt, timeout=30)
        assert (r.returncode, r.stdout) == (0, "reloaded: no changes\n"), r.stderr
        cfg.write_text("[scoring]\nema = 0.6\n[tiers]\nio_threads = 3\n[metrics]\nhost = \"0.0.0.0\"\n")
        r = kvtier("reload", "--runtime-dir", rt, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == [
            "scoring.ema: applied",
            "tiers.io_threads: needs a restart (the daemon keeps running with the old value)",
            "metrics.host: needs a restart (the daemon keeps running with the old value)"]
        with d.client(heartbeat_s=None) as c:
            assert c.stats()["config_hot"]["scoring"]["ema"] == 0.6
        cfg.write_text("[scoring]\nema = 9\n")
        r = kvtier("reload", "--runtime-dir", rt, timeout=30)
        assert r.returncode == 1 and "Traceback" not in r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("kvtier: error: reload rejected: ") and "scoring.ema" in line
        assert line.endswith("the daemon keeps its running config")
    finally:
        assert d.stop() == 0


def test_reload_without_config_finds_a_file_created_after_the_start(tmp_path):
    """Without ``--config`` the daemon found no file at start: ``systemctl reload`` after
    writing one (the Deploy section's flow) must read it, not keep the shipped default."""
    xdg = tmp_path / "xdg"
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0",
                      env={"XDG_CONFIG_HOME": str(xdg), "KVTIER_CONFIG": ""})
    rt = str(d.runtime_dir)
    started = read_info(rt)["started"]
    try:
        assert read_info(rt)["config"] is None
        (xdg / "kvtier").mkdir(parents=True)
        path = xdg / "kvtier" / "kvtier.toml"
        path.write_text("[scoring]\nema = 9\n")  # rejected: the daemon keeps its config, and its file
        r = kvtier("reload", "--runtime-dir", rt, timeout=30)
        assert r.returncode == 1 and "scoring.ema" in r.stderr
        assert read_info(rt)["config"] is None
        path.write_text("[scoring]\nema = 0.6\n")
        r = kvtier("reload", "--runtime-dir", rt, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["scoring.ema: applied",
                                         f"note: config file is now {path} (none was found before)"]
        assert read_info(rt)["config"] == str(path) and read_info(rt)["started"] == started  # daemon.json follows
        with d.client(heartbeat_s=None) as c:
            assert c.stats()["config_hot"]["scoring"]["ema"] == 0.6
        path.unlink()  # gone: the reload says so, not a silent return to the defaults
        r = kvtier("reload", "--runtime-dir", rt, timeout=30)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines()[-1] == (f"note: config file {path} is gone: reloaded from the shipped "
                                              "default (and environment, --set)")
        assert "scoring.ema: applied" in r.stdout
        assert read_info(rt)["config"] is None
    finally:
        assert d.stop() == 0
