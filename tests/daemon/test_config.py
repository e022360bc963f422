"""Config sources, precedence, validation errors and hot reload."""

from __future__ import annotations

import pytest

from kvtier.daemon.config import ConfigError, load_config
from kvtier.daemon.reload import reload_hot


def write(tmp_path, text: str):
    p = tmp_path / "kvtier.toml"
    p.write_text(text)
    return p


def test_embedded_default_is_valid_and_documented():
    cfg = load_config(environ={})
    assert cfg.policy.name == "kvtier"
    schema = cfg.model_json_schema()
    props = schema["$defs"]["TiersConfig"]["properties"]
    assert all(p.get("description") for p in props.values())  # every field has a docstring


def test_precedence_file_env_cli(tmp_path):
    p = write(tmp_path, '[policy]\nname = "lru"\n[tiers]\nhbm_bytes = 1000\ndram_bytes = 2000\n')
    cfg = load_config(p, environ={"KVTIER_TIERS__DRAM_BYTES": "3000", "KVTIER_TIERS__HBM_BYTES": "4000"},
                      overrides=["tiers.hbm_bytes=5000"])
    assert cfg.policy.name == "lru"  # file beats default
    assert cfg.tiers.dram_bytes == 3000  # env beats file
    assert cfg.tiers.hbm_bytes == 5000  # CLI beats env


@pytest.mark.parametrize("text, needle", [
    ('[policy]\nname = "kvtier"\nbogus = 1\n', ":3: policy.bogus: unknown key"),
    ('[tiers]\n\nhbm_bytes = -5\n', ":3: tiers.hbm_bytes: Input should be greater than or equal to 0"),
    ('[policy]\nname = "belady"\n', ":2: policy.name: Value error, policy 'belady' needs the future"),
    ('[policy]\nname = "nope"\n', "unknown policy 'nope'"),
    ('[nosuch]\nx = 1\n', ":1: nosuch: unknown key"),
    ('[policy\nname = 1\n', "TOML syntax error"),
    ('[tiers.remote]\nenabled = "maybe"\n', ":2: tiers.remote.enabled: Input should be a valid boolean"),  # nested
    ('[scoring]\n\nsegment_weights = {system = -1.0}\n', ":3: scoring.segment_weights.system:"),  # in a value
])
def test_validation_errors_name_key_and_line(tmp_path, text, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(p, environ={})
    assert needle in str(e.value)


def test_bad_env_and_cli_values():
    with pytest.raises(ConfigError, match="tiers.hbm_bytes"):
        load_config(environ={"KVTIER_TIERS__HBM_BYTES": "lots"})
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config(environ={}, overrides=["nonsense"])


def test_hot_reload_takes_only_hot_sections(tmp_path):
    p = write(tmp_path, "[scoring]\nema = 0.5\n[tiers]\nhbm_bytes = 4096\n")
    cur = load_config(environ={})
    new, changed = reload_hot(cur, p, environ={})
    assert changed == ["scoring"]
    assert new.scoring.ema == 0.5
    assert new.tiers.hbm_bytes == cur.tiers.hbm_bytes  # cold section: needs a restart


def test_invalid_reload_raises_and_keeps_current(tmp_path):
    cur = load_config(environ={})
    before = cur.model_dump()
    p = write(tmp_path, "[scoring]\nema = 7\n")
    with pytest.raises(ConfigError, match="scoring.ema"):
        reload_hot(cur, p, environ={})
    assert cur.model_dump() == before


@pytest.mark.parametrize("override, needle", [
    ("policy.prefetch_budget_bytes_per_s=inf", "finite number"),  # int(inf // block) broke every maintain
    ("policy.epoch_s=nan", "finite number"),
    ("policy.memory_horizons=inf", "finite number"),
    ("tiers.remote.timeout_s=inf", "finite number"),
    ("scoring.segment_weights={system=nan}", "finite number"),  # NaN weights never evicted, NaN metrics
    ("scoring.segment_weights={system=inf}", "finite number"),
    ("scoring.segment_weights={system=-3.0}", "greater than or equal to 0"),
    ("tiers.low_watermark=0.96", "above tiers.high_watermark"),  # demotion stopped above high
    ("policy.default_candidate=99", "less than or equal to"),  # validated, then every register refused
    ("tiers.remote.nodes=[]", "at least one startup node"),
    ('tiers.remote.nodes=["nohostport"]', "is not host:port"),
    ('server.runtime_dir="relative/run"', "must be an absolute path"),  # clients elsewhere never found it
    ('tiers.nvme_dir="~/nvme"', "must be an absolute path"),
    # telemetry.sock past a unix socket path's 107 bytes: serve bound rpc.sock, then failed with a traceback
    ('server.runtime_dir="/' + "r" * 92 + '"', "too long for its socket files: 108 bytes"),
    ("server.max_message_bytes=4611686018427387904", "less than or equal to"),  # setsockopt overflowed at serve
    ("policy.prior_strength=0", "greater than 0"),  # 0/0 in a cell without evidence: NaN values, never evicted
])
def test_non_finite_negative_and_crossed_values_are_refused(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(environ={}, overrides=[override])


def test_a_reload_with_an_infinite_budget_is_refused_and_keeps_current(tmp_path):
    cur = load_config(environ={})
    before = cur.model_dump()
    p = write(tmp_path, "[policy]\nprefetch_budget_bytes_per_s = inf\n")
    with pytest.raises(ConfigError, match="finite number"):
        reload_hot(cur, p, environ={})
    assert cur.model_dump() == before
