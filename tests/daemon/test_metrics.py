"""The exporter: kvtier families from a snapshot, health checks, process collectors, and the dashboard."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvtier import __version__
from kvtier.bench.spawn import DaemonProcess
from kvtier.daemon.metrics import CLEARED_COUNTER, Exporter

DASHBOARD = Path(__file__).parents[2] / "daemon" / "grafana" / "kvtier.json"
# exported but on no panel, each for a reason
REMOTE_SNAPSHOT = {
    "enabled": True, "state": "ok", "hits": 3, "misses": 1, "corrupt": 0, "published": 2, "put_bytes": 8192,
    "get_bytes": 12288, "errors": {"put": 0, "get": 1},
    "latency_histogram": {op: {"le": [0.001, 0.01], "counts": [1, 1, 0], "sum": 0.005} for op in ("put", "get")},
}
ABSENT = {
    "kvtier_prefetch_on_time_ratio": "the panel divides the two acquire counters' rates over its window instead",
    "kvtier_tier_slots": "occupancy is shown in bytes", "kvtier_tier_used_slots": "occupancy is shown in bytes",
    "kvtier_predictor_scored": "how many predictions back ECE/Brier: for `kvtier stats`, not a trend",
    "process_virtual_memory_bytes": "RSS is the figure that matters", "process_start_time_seconds": "restarts: up{}",
    "process_open_fds": "stable", "process_max_fds": "a limit, not a trend", "python_info": "constant labels",
    "python_gc_objects_collected": "interpreter detail", "python_gc_objects_uncollectable": "interpreter detail",
    "python_gc_collections": "interpreter detail",
}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count", "_created"),
            "gauge": ("",), "info": ("_info",), "summary": ("_sum", "_count", "_created", "")}


def families(exporter: Exporter) -> dict[str, str]:
    """Family name -> type, as a scrape sees them."""
    text = generate_latest(exporter.registry).decode()
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def samples(exporter: Exporter) -> dict[str, float]:
    text = generate_latest(exporter.registry).decode()
    return {f"{s.name}{json.dumps(s.labels, sort_keys=True) if s.labels else ''}": s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


SNAPSHOT = {
    "tiers": [{"tier": "hbm", "capacity_bytes": 100, "used_bytes": 50, "slots": 10, "used": 5, "hits": 3}],
    "paths": {"hbm->dram": {"moves": 4, "bytes": 4096, "errors": 0, "busy_ns": 2_500_000_000,
                            "bandwidth_bytes_per_s": 1638.4}},
    "blocks": {"live": 2, "cached": 3, "pinned": 0, "max": 64},
    "service": {"acquires": 0, "acquires_on_time": 0, CLEARED_COUNTER: 5},
    "placement": {"dropped": 2}, "engines": [], "prefetch_on_time_ratio": None,
    "io": {"events": {"keys_detached": 2, "nvme_write_backoffs": 1}},
}


def test_snapshot_families():
    e = Exporter()
    e.publish(SNAPSHOT)
    s = samples(e)
    assert s['kvtier_mover_busy_seconds_total{"path": "hbm_to_dram"}'] == 2.5
    assert s['kvtier_moved_bytes_total{"path": "hbm_to_dram"}'] == 4096
    assert not any("bandwidth" in k for k in s)
    assert "kvtier_prefetch_on_time_ratio" not in s  # no acquires: no ratio, rather than a perfect 1.0
    assert s["kvtier_blocks_capacity"] == 64 and 'kvtier_blocks{"kind": "max"}' not in s
    assert s['kvtier_blocks{"kind": "cached"}'] == 3
    assert s["kvtier_blocks_dropped_total"] == 7  # evicted from the last tier + dropped by clear
    assert s['kvtier_tier_events_total{"event": "nvme_write_backoffs"}'] == 1
    assert s[f'kvtier_build_info{{"version": "{__version__}"}}'] == 1
    assert "process_cpu_seconds_total" in s and any(k.startswith("python_info") for k in s)
    e.publish(SNAPSHOT | {"service": {"acquires": 4, "acquires_on_time": 3}, "prefetch_on_time_ratio": 0.75})
    assert samples(e)["kvtier_prefetch_on_time_ratio"] == 0.75


def test_build_info_before_the_first_snapshot():
    s = samples(Exporter())
    assert s[f'kvtier_build_info{{"version": "{__version__}"}}'] == 1 and not any(k.startswith("kvtier_tier") for k in s)


def test_health_follows_the_owner_loop():
    now = [100.0]
    e = Exporter(stale_after_s=5.0, clock=lambda: now[0])
    assert not e.health()[0] and not e.ready()[0]  # not started
    e.publish({"engines": [{"engine": "a"}], "tiers": []})
    now[0] += 4.0
    assert e.health() == (True, {"ok": True, "snapshot_age_s": 4.0})
    assert e.ready() == (True, {"ok": True, "snapshot_age_s": 4.0, "engines": 1, "tiers_set_up": False})
    now[0] += 2.0
    ok, body = e.health()
    assert not ok and body["why"] == "the owner loop is stuck" and not e.ready()[0]


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_a_live_daemon_answers_healthz_readyz_and_metrics(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=0")
    try:
        port = d.info["metrics_port"]
        end = time.monotonic() + 10
        while _get(port, "/healthz")[0] != 200 and time.monotonic() < end:
            time.sleep(0.05)
        status, body = _get(port, "/healthz")
        assert status == 200 and json.loads(body)["ok"] is True
        status, body = _get(port, "/readyz")
        assert status == 200 and json.loads(body)["engines"] == 0
        status, text = _get(port, "/metrics")
        fams = {f.name for f in text_string_to_metric_families(text)}
        assert {"kvtier_build_info", "process_cpu_seconds", "process_resident_memory_bytes", "python_info"} <= fams
    finally:
        assert d.stop() == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict[str, str]:
    """Every family a busy daemon exports: a real snapshot after acquires and moves, plus calibration."""
    root = tmp_path_factory.mktemp("metrics")
    d = DaemonProcess(root, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144",
                      'tiers.io_backend="posix"')
    try:
        with d.client(heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            blocks, _ = c.alloc(4, seq=1)
            c.acquire(blocks=blocks)
            c.release(blocks=blocks)
            snap = c.stats()
    finally:
        assert d.stop() == 0
    snap["calibration"] = {"brier": 0.1, "ece": 0.05, "ece_raw": 0.08, "n": 10}
    assert snap["remote"] == {"enabled": False}  # the remote tier's families come from a node that has one:
    snap["remote"] = REMOTE_SNAPSHOT  # its stats' shape, as tests/daemon/test_remote_nodes.py reads them
    e = Exporter()
    e.publish(snap)
    fams = families(e)
    assert "kvtier_prefetch_on_time_ratio" in fams and "kvtier_nvme_direct_io" in fams
    return fams


def _queries() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    return exprs + [v["definition"] for v in dash["templating"]["list"] if v["type"] == "query"]


def _named(expr: str) -> list[str]:
    return re.findall(r"\b(?:kvtier|process|python)_[a-z_]+\b", expr)


def test_every_dashboard_query_names_an_exported_family(exported):
    sample_names = {name + sfx: name for name, kind in exported.items() for sfx in SUFFIXES[kind]}
    unknown = {n for q in _queries() for n in _named(q)} - set(sample_names)
    assert not unknown, f"queries name metrics nobody exports: {unknown}"


def test_every_exported_family_is_on_a_panel_or_listed_absent(exported):
    sample_names = {name + sfx: name for name, kind in exported.items() for sfx in SUFFIXES[kind]}
    shown = {sample_names[n] for q in _queries() for n in _named(q) if n in sample_names}
    assert set(exported) - shown - set(ABSENT) == set(), "families on no panel: add one, or list them in ABSENT"
    assert not set(ABSENT) & shown, "listed absent but on a panel"
    assert set(ABSENT) <= set(exported), "ABSENT names a family nobody exports"


def test_every_panel_query_selects_instance_and_job():
    selector = '{instance=~"$instance",job=~"$job"}'
    dash = json.loads(DASHBOARD.read_text())
    names = {v["name"] for v in dash["templating"]["list"]}
    assert {"instance", "job", "datasource"} <= names
    for p in dash["panels"]:
        for t in p["targets"]:
            for m in re.finditer(r"\b(?:kvtier|process|python)_[a-z_]+\b", t["expr"]):
                assert t["expr"][m.end():].startswith(selector), (p["title"], t["expr"])
            if "histogram_quantile" in t["expr"]:
                assert re.search(r"histogram_quantile\([0-9.]+, sum by \(le(, [a-z_]+)*\) \(rate\(", t["expr"]), t["expr"]
            if "kvtier_remote_latency_seconds" in t["expr"]:  # put and get merged made one meaningless quantile
                assert "sum by (le, op)" in t["expr"], t["expr"]


def test_stats_state_no_on_time_ratio_before_an_acquire():
    """A daemon nobody acquired from has no on-time ratio: null in the stats JSON, not 1.0."""
    from collections import Counter

    from kvtier.daemon.config import load_config
    from kvtier.daemon.stats import snapshot

    cfg = load_config(environ={})
    assert snapshot(cfg, Counter(), {}, None, None, time.monotonic)["prefetch_on_time_ratio"] is None
    counts = Counter(acquires=4, acquires_on_time=3)
    assert snapshot(cfg, counts, {}, None, None, time.monotonic)["prefetch_on_time_ratio"] == 0.75
