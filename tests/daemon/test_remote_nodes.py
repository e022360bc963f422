"""Two daemons ("nodes") share one real three-shard Redis Cluster through the remote tier.

Sessions run on node A; the same prefix on node B is served from the cluster and the
transformers engine's outputs are bit-identical (``torch.equal``) to an untiered run.
Faults: a shard killed mid-run, a corrupt value, a wrong password.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("redis")

from transformers import DynamicCache  # noqa: E402

from kvtier.bench.spawn import DaemonProcess  # noqa: E402
from kvtier.bench.workload import build_model, run_turn  # noqa: E402
from kvtier.client.hf_cache import KVLayout, TieredCache, chain_key  # noqa: E402
from kvtier.tiers.remote_store import namespace_tag, value_name  # noqa: E402

PW = "kvtier-test-pw"
NS = b"kvtier-remote-test"
T = 16


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model("tiny", seed=0)


def node(tmp_path, name, cluster, layout, fleet, password=PW, **extra):
    (tmp_path / name).mkdir()
    sets = [f"tiers.hbm_bytes={layout.block_bytes * 48}", f"tiers.dram_bytes={layout.block_bytes * 32}",
            f"tiers.nvme_bytes={layout.block_bytes * 32}", "tiers.remote.enabled=true",
            f"tiers.remote.nodes={json.dumps(cluster.nodes)}", f"tiers.remote.namespace={json.dumps(fleet)}",
            "tiers.remote.backoff_s=0.1", "tiers.remote.backoff_max_s=0.4", "tiers.remote.timeout_s=0.5",
            "tiers.remote.connect_timeout_s=0.5", "tiers.remote.lookup_timeout_s=5.0",
            *[f"tiers.remote.{k}={v}" for k, v in extra.items()]]
    return DaemonProcess(tmp_path / name, *sets, env={"KVTIER_REMOTE_PASSWORD": password})


@contextlib.contextmanager
def two_nodes(tmp_path, cluster, layout, fleet) -> Iterator[tuple[Any, Any, DaemonProcess, DaemonProcess]]:
    """Nodes A and B on one fleet namespace, an engine registered on each; both must stop cleanly."""
    a, b = node(tmp_path, "a", cluster, layout, fleet), node(tmp_path, "b", cluster, layout, fleet)
    try:
        ca, cb = a.client(engine_id="a"), b.client(engine_id="b")
        for c in (ca, cb):
            c.register(block_bytes=layout.block_bytes, block_tokens=T, layout=layout.describe())
        yield ca, cb, a, b
        for c in (ca, cb):
            c.close()
    finally:
        assert a.stop() == 0 and b.stop() == 0


def geometry_of(layout, block_tokens: int) -> tuple[int, int, str]:
    """The geometry the daemon binds into the remote tag: bytes, tokens and the stated dtype."""
    return layout.block_bytes, block_tokens, layout.describe()["dtype"]


def prefix_keys(tokens: list[int]) -> list[int]:
    """The engine's chained keys of the full blocks of ``tokens`` (what TieredCache seals)."""
    keys, parent = [], 0
    for j in range(len(tokens) // T):
        parent = chain_key(parent, np.asarray(tokens[j * T:(j + 1) * T], dtype=np.int64).tobytes(), NS)
        keys.append(parent)
    return keys


def reference(model, system, user, gen=4):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=system, cache=cache)
    return run_turn(model, cache, user, gen)


def tiered_turn(model, client, layout, keys, system, user, gen=4, seq=1):
    """A session on ``client``: its prefix from the daemon (locally or remotely), else recomputed."""
    try:
        cache = TieredCache.from_prefix(client, layout, keys, system[0].tolist(), NS, seq_id=seq)
        recomputed = False
    except KeyError:  # a prefix block is nowhere: recompute it, as any engine does on a miss
        cache = TieredCache(client, layout, 1, NS, seq_ids=[seq])
        cache.feed_tokens(system)
        with torch.no_grad():
            model(input_ids=system, cache=cache)
        recomputed = True
    if not cache.active:
        cache.activate()
    res = run_turn(model, cache, user, gen, before=cache.feed_tokens)
    cache.close()
    return res, recomputed


def same(a, b) -> bool:
    return a.tokens == b.tokens and all(torch.equal(x, y) for x, y in zip(a.logits, b.logits))


def wait_stats(client, pred, timeout=20.0):
    end = time.monotonic() + timeout
    while True:
        s = client.stats()
        if pred(s["remote"]) or time.monotonic() > end:
            return s["remote"]
        time.sleep(0.05)


def publish_on_a(model, a, layout, system, user, sessions=2):
    """Sessions on node A share the system prompt; returns its keys once A has published them."""
    keys = prefix_keys(system[0].tolist())
    ref = reference(model, system, user)
    for s in range(sessions):
        res, _ = tiered_turn(model, a, layout, keys, system, user, seq=s + 1)
        assert same(res, ref)
    st = wait_stats(a, lambda r: r["published"] >= len(keys))
    assert st["published"] >= len(keys), st
    return keys, ref


def tokens(seed, n):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


def test_prefix_from_node_a_is_served_on_node_b_bit_exact(model, redis_cluster, tmp_path):
    layout = KVLayout.from_config(model.config, T)
    system, user = tokens(1, 5 * T), tokens(2, 9)
    with two_nodes(tmp_path, redis_cluster, layout, "fleet-1") as (ca, cb, a, b):
        keys, ref = publish_on_a(model, ca, layout, system, user)
        res, recomputed = tiered_turn(model, cb, layout, keys, system, user)
        assert not recomputed and same(res, ref)  # B never ran the system prompt: its KV came from A
        rb = cb.stats()["remote"]
        assert rb["hits"] == len(keys) and rb["corrupt"] == 0 and rb["state"] == "ok"
        assert rb["published"] == 0  # B read them: nothing of B's own is worth publishing yet
        out = subprocess.run([sys.executable, "-m", "kvtier.cli", "stats", "--runtime-dir", str(b.runtime_dir)],
                             capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"})
        assert out.returncode == 0 and "remote (ok)" in out.stdout and f"hits {len(keys)}  misses 0" in out.stdout
        cb.check()
        ca.check()


def test_a_killed_shard_degrades_then_recovers(model, redis_cluster, tmp_path):
    layout = KVLayout.from_config(model.config, T)
    system, user = tokens(3, 6 * T), tokens(4, 7)
    with two_nodes(tmp_path, redis_cluster, layout, "fleet-2") as (ca, cb, a, b):
        keys, ref = publish_on_a(model, ca, layout, system, user)
        shard = redis_cluster.shard_of(value_name(namespace_tag("fleet-2", "", geometry_of(layout, T)), keys[0]))
        redis_cluster.kill(shard)  # the shard holding the prefix's first block
        try:
            # no engine error: B misses, recomputes, and stays bit-exact; the tier says it is degraded
            res, recomputed = tiered_turn(model, cb, layout, keys, system, user, seq=1)
            assert recomputed and same(res, ref)
            rb = cb.stats()["remote"]
            assert rb["state"] == "degraded" and rb["errors"]["get"] >= 1 and rb["last_error"]
            cb.clear()  # forget B's own recomputed copy so the next lookup must go remote again
        finally:
            redis_cluster.restart(shard)
        # recovers: after the backoff a lookup succeeds again (the restarted shard lost its values:
        # A publishes again when its sessions share the prefix once more)
        ca.clear()
        keys, ref = publish_on_a(model, ca, layout, system, user)
        deadline = time.monotonic() + 20
        while True:
            res, recomputed = tiered_turn(model, cb, layout, keys, system, user, seq=2)
            assert same(res, ref)
            if not recomputed or time.monotonic() > deadline:
                break
            cb.clear()
            time.sleep(0.2)
        assert not recomputed and cb.stats()["remote"]["state"] == "ok"
        cb.check()


def test_a_corrupt_value_is_refused_deleted_and_recomputed(model, redis_cluster, tmp_path):
    from redis.cluster import ClusterNode, RedisCluster

    layout = KVLayout.from_config(model.config, T)
    system, user = tokens(5, 3 * T), tokens(6, 5)
    with two_nodes(tmp_path, redis_cluster, layout, "fleet-3") as (ca, cb, a, b):
        keys, ref = publish_on_a(model, ca, layout, system, user)
        rc = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", p) for p in redis_cluster.ports], password=PW)
        name = value_name(namespace_tag("fleet-3", "", geometry_of(layout, T)), keys[1], 0)  # its payload
        chunk = bytearray(rc.get(name))
        chunk[100] ^= 1
        rc.set(name, bytes(chunk))
        res, recomputed = tiered_turn(model, cb, layout, keys, system, user)
        assert recomputed and same(res, ref)  # never served: the engine recomputed the prefix
        rb = cb.stats()["remote"]
        assert rb["corrupt"] == 1 and rb["hits"] == len(keys) - 1
        assert rc.exists(name) == 0  # deleted from the cluster
        rc.close()
        cb.check()


def test_wrong_password_is_a_clear_error_at_start(model, redis_cluster, tmp_path):
    layout = KVLayout.from_config(model.config, T)
    with pytest.raises(RuntimeError) as e:
        node(tmp_path, "a", redis_cluster, layout, "fleet-4", password="not-the-password")
    text = str(e.value)
    assert "refused the default user: wrong user or password" in text and "kvtier: error: remote tier" in text
    assert "not-the-password" not in text
