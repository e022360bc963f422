"""The layering is pydantic-settings' own: its env source (``KVTIER_`` prefix, ``__`` nesting,
JSON for table values, case-insensitive names) between the TOML files and ``--set``."""

from __future__ import annotations

import pytest
from pydantic_settings import EnvSettingsSource, InitSettingsSource, TomlConfigSettingsSource

from kvtier.daemon.config import ConfigError, KvtierConfig, load_config
from kvtier.daemon.config_sources import layers, settings_class

FILE = '[tiers]\nhbm_bytes = 1000\ndram_bytes = 2000\n[scoring.segment_weights]\nsystem = 0.9\nuser = 0.1\n'


def test_sources_are_pydantic_settings_ones_in_precedence_order(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text(FILE)
    got = layers(settings_class(KvtierConfig), [(p, str(p))], {"KVTIER_TIERS__HBM_BYTES": "1"}, ["tiers.hbm_bytes=2"])
    assert [type(s).__mro__[1] for s in got] == [InitSettingsSource, EnvSettingsSource, TomlConfigSettingsSource]


def test_nested_env_beats_the_file_and_set_beats_env(tmp_path):
    p = tmp_path / "k.toml"
    p.write_text(FILE)
    env = {"KVTIER_TIERS__HBM_BYTES": "4096", "kvtier_tiers__dram_bytes": "8192",  # names are case-insensitive
           "KVTIER_SCORING__SEGMENT_WEIGHTS": '{"user": 0.5}'}  # a table value is JSON, merged key by key
    cfg = load_config(p, environ=env)
    assert (cfg.tiers.hbm_bytes, cfg.tiers.dram_bytes) == (4096, 8192)
    assert cfg.scoring.segment_weights == {"system": 0.9, "user": 0.5, "assistant": 0.7, "document": 0.6}
    cfg = load_config(p, environ=env, overrides=["tiers.hbm_bytes=5000"])
    assert (cfg.tiers.hbm_bytes, cfg.tiers.dram_bytes) == (5000, 8192)
    assert load_config(p, environ={}).tiers.hbm_bytes == 1000  # environ={}: the file alone


def test_process_env_is_read_unless_an_environ_is_given(monkeypatch):
    monkeypatch.setenv("KVTIER_METRICS__PORT", "9555")
    assert load_config().metrics.port == 9555
    assert load_config(environ={}).metrics.port == 9464


@pytest.mark.parametrize("env, overrides, line", [
    ({"KVTIER_TIERS__HBM_BYTES": "lots"}, [], "environment KVTIER_TIERS__HBM_BYTES: tiers.hbm_bytes: Input should be"),
    ({"KVTIER_TIERS__BOGUS": "1"}, [], "environment KVTIER_TIERS__BOGUS: tiers.bogus: unknown key"),
    ({"KVTIER_TEIRS__HBM_BYTES": "1"}, [], "environment KVTIER_TEIRS__HBM_BYTES: unknown section 'teirs'"),
    ({"KVTIER_TIERS__HBM_BYTES": "1"}, ["tiers.hbm_bytes=-1"], "--set tiers.hbm_bytes=-1: tiers.hbm_bytes: Input"),
])
def test_errors_name_the_variable_or_flag_that_set_the_key(env, overrides, line):
    with pytest.raises(ConfigError) as e:
        load_config(environ=env, overrides=overrides)
    assert line in str(e.value)


def test_a_password_given_with_set_is_never_printed_in_an_error():
    from kvtier.daemon.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(environ={}, overrides=["tiers.remote.password=hunter2", "tiers.remote.timeout_s=-1"])
    assert "hunter2" not in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, overrides=["tiers.remote.password.x=hunter2"])
    assert "hunter2" not in str(e.value)
    table = 'tiers.remote={enabled=false, password="hunter2", bogus=1}'  # the key names the table only
    with pytest.raises(ConfigError) as e:
        load_config(environ={}, overrides=[table])
    assert "hunter2" not in str(e.value) and "--set tiers.remote=(hidden)" in str(e.value)
    from kvtier.daemon.config import config_sources

    shown = config_sources(None, {}, ['tiers.remote={enabled=false, password="hunter2"}'])  # config show, the start log
    assert shown[-1] == "--set tiers.remote=(hidden)"


@pytest.mark.parametrize("name,value", [("KVTIER_SCORING__SEGMENT_WEIGHTS", "system=2"),
                                        ("KVTIER_TIERS__REMOTE__NODES", "redis-0:6379")])
def test_a_table_or_list_variable_that_is_not_json_is_named(name, value):
    valid_sibling = {"KVTIER_SCORING__EMA": "0.5", "KVTIER_TIERS__REMOTE__TIMEOUT_S": "2.0"}
    with pytest.raises(ConfigError) as e:
        load_config(environ={name: value, "KVTIER_POLICY__SAMPLES": "8", **valid_sibling})
    assert f"environment {name}:" in str(e.value)
    assert not any(v in str(e.value) for v in ["KVTIER_POLICY__SAMPLES", *valid_sibling])


def test_a_config_file_that_is_not_utf8_is_a_config_error_naming_its_line(tmp_path):
    p = tmp_path / "k.toml"
    p.write_bytes(b"[scoring]\nema = 0.5 # caf\xe9\n")
    with pytest.raises(ConfigError, match=rf"{p}:2: not UTF-8 \(byte 0xe9\)"):
        load_config(p, environ={})
    p.write_bytes("[scoring]\nema = 0.5 # café\n".encode())
    assert load_config(p, environ={}).scoring.ema == 0.5  # UTF-8 whatever the locale


@pytest.mark.parametrize("text, line", [
    ("[tiers]\nlow_watermark = 0.99\n", ":2: tiers.low_watermark: "),  # the file's low mark
    ("[tiers]\nhigh_watermark = 0.8\n", ":2: tiers.low_watermark: "),  # the file's high mark, not the default's low
    ('[tiers]\nio_threads = 4\nnvme_dir = ""\n', ":3: tiers.nvme_dir: "),
])
def test_a_cross_field_error_names_the_source_that_set_one_of_its_keys(tmp_path, text, line):
    """The deploy units pass --set tiers.nvme_dir: an error in the file's [tiers] had been blamed
    on that flag (the checks were on the whole section), and on no line of the file."""
    p = tmp_path / "kvtier.toml"
    p.write_text(text)
    overrides = [] if "nvme_dir" in text else ['tiers.nvme_dir="/var/lib/kvtier/nvme"']
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={"KVTIER_TIERS__IO_THREADS": "2"}, overrides=overrides)
    assert f"{p}{line}" in str(e.value), str(e.value)
