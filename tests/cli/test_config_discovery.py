"""With no --config: $KVTIER_CONFIG, then $XDG_CONFIG_HOME/kvtier/kvtier.toml, then /etc/kvtier/kvtier.toml."""

from __future__ import annotations

import tomllib

import pytest

from kvtier.cli.main import main
from kvtier.daemon.config import SYSTEM_CONFIG, ConfigError, discover_config, discovery_candidates, load_config


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No config of this machine: an empty XDG dir and HOME; KVTIER_* unset."""
    import os

    for k in list(os.environ):
        if k.startswith("KVTIER_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return tmp_path


def _write(path, body):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return path


def _shown(capsys, *args) -> str:
    assert main(["config", "show", *args]) == 0
    return capsys.readouterr().out


def test_candidates_in_order(clean_env, monkeypatch):
    monkeypatch.setenv("KVTIER_CONFIG", "/x/k.toml")
    assert discovery_candidates() == ["/x/k.toml", str(clean_env / "xdg" / "kvtier" / "kvtier.toml"), SYSTEM_CONFIG]
    monkeypatch.delenv("KVTIER_CONFIG")
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert discovery_candidates()[0] == str(clean_env / "home" / ".config" / "kvtier" / "kvtier.toml")


@pytest.mark.skipif(__import__("os").path.exists(SYSTEM_CONFIG), reason=f"{SYSTEM_CONFIG} exists on this machine")
def test_nothing_found_is_the_shipped_default(clean_env, capsys):
    assert discover_config() is None
    out = _shown(capsys, "--sources")
    assert out.splitlines() == ["field defaults", "shipped default (kvtier/daemon/defaults/kvtier.toml)"]


def test_found_via_kvtier_config(clean_env, monkeypatch, capsys):
    f = _write(clean_env / "a" / "k.toml", "[policy]\nname = \"lru\"\n")
    _write(clean_env / "xdg" / "kvtier" / "kvtier.toml", "[policy]\nname = \"s3fifo\"\n")  # loses to KVTIER_CONFIG
    monkeypatch.setenv("KVTIER_CONFIG", str(f))
    out = _shown(capsys)
    assert f"# source: file {f}" in out
    assert tomllib.loads(out)["policy"]["name"] == "lru"


def test_found_via_xdg_config_home(clean_env, capsys):
    f = _write(clean_env / "xdg" / "kvtier" / "kvtier.toml", "[policy]\nname = \"lru\"\n")
    out = _shown(capsys)
    assert f"# source: file {f}" in out and tomllib.loads(out)["policy"]["name"] == "lru"


def test_config_flag_wins_over_discovery(clean_env, monkeypatch, capsys):
    monkeypatch.setenv("KVTIER_CONFIG", str(_write(clean_env / "env.toml", "[policy]\nname = \"lru\"\n")))
    flag = _write(clean_env / "flag.toml", "[policy]\nname = \"s3fifo\"\n")
    out = _shown(capsys, "--config", str(flag))
    assert tomllib.loads(out)["policy"]["name"] == "s3fifo"
    assert "env.toml" not in out


def test_env_and_set_still_beat_the_discovered_file(clean_env, monkeypatch, capsys):
    body = "[policy]\nname = \"lru\"\n[server]\nheartbeat_timeout_s = 7.0\n"
    monkeypatch.setenv("KVTIER_CONFIG", str(_write(clean_env / "k.toml", body)))
    monkeypatch.setenv("KVTIER_SERVER__HEARTBEAT_TIMEOUT_S", "9.0")
    out = _shown(capsys, "--set", "policy.name=\"s3fifo\"")
    data = tomllib.loads(out)
    assert data["policy"]["name"] == "s3fifo" and data["server"]["heartbeat_timeout_s"] == 9.0
    assert "# source: environment KVTIER_SERVER__HEARTBEAT_TIMEOUT_S" in out and "# source: --set policy.name=" in out


def test_discovered_file_errors_keep_line_numbers(clean_env, monkeypatch):
    f = _write(clean_env / "xdg" / "kvtier" / "kvtier.toml", "[policy]\n\nbogus = 1\n")
    with pytest.raises(ConfigError, match=rf"{f}:3: policy.bogus: unknown key"):
        load_config(discover_config())
    assert main(["config", "show"]) == 1


def test_kvtier_config_naming_a_missing_file_is_an_error(clean_env, monkeypatch):
    monkeypatch.setenv("KVTIER_CONFIG", str(clean_env / "nope.toml"))
    with pytest.raises(ConfigError, match="KVTIER_CONFIG=.*nope.toml: no such file"):
        discover_config()
