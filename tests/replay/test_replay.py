import json

import numpy as np
import pytest

from kvtier.policy import make_policy
from kvtier.replay.report import parse_fractions, replay
from kvtier.replay.sim import simulate
from kvtier.replay.traces import Trace, TraceError, load_trace

from ..conftest import traces_or_skip


def _trace(seq: list[int]) -> Trace:
    ids = np.array(seq, dtype=np.int64)
    uniq, dense = np.unique(ids, return_inverse=True)
    n = ids.size
    return Trace("t", "mooncake", dense, np.arange(n, dtype=float), np.zeros(n, np.int64),
                 np.arange(n), n, int(uniq.size))


def _evictions(name: str, seq: list[int], cap: int) -> list[int]:
    tr = _trace(seq)
    pol = make_policy(name, cap, tr.n_unique)
    out = []
    orig = pol.evict

    def spy(now: float) -> int:
        v = orig(now)
        out.append(v)
        return v

    pol.evict = spy  # type: ignore[method-assign]
    simulate(pol, tr, tr.next_use())
    return out


def test_exact_eviction_orders():
    seq = [0, 1, 2, 0, 3, 1, 4, 0, 2]
    assert _evictions("lru", seq, 3) == [1, 2, 0, 3, 1]
    # farthest next use; ties among never-reused blocks go to the lowest id
    assert _evictions("belady", seq, 3) == [2, 1, 0]
    # S3-FIFO: 0 is hit while in the small queue, so it is promoted, not evicted
    assert _evictions("s3fifo", seq, 3) == [1, 2, 3, 4]
    # oracle admission: 3 and 4 (never read again) stay out, so 0, 1, 2 are all kept
    assert _evictions("lru-oracle-admit", seq, 3) == []
    # ... and recency decides among the blocks it does admit
    assert _evictions("lru-oracle-admit", [0, 1, 2, 0, 1, 2], 2) == [0]  # 0 goes; its last read is a miss


def _opt_hits(seq: list[int], cap: int) -> int:
    """Exhaustive search over every eviction choice (no bypass)."""
    best = 0

    def go(i: int, cache: frozenset, hits: int) -> None:
        nonlocal best
        if i == len(seq):
            best = max(best, hits)
            return
        b = seq[i]
        if b in cache:
            go(i + 1, cache, hits + 1)
        elif len(cache) < cap:
            go(i + 1, cache | {b}, hits)
        else:
            for v in cache:
                go(i + 1, (cache - {v}) | {b}, hits)

    go(0, frozenset(), 0)
    return best


def test_belady_is_optimal_on_tiny_traces():
    rng = np.random.default_rng(5)
    for _ in range(25):
        seq = rng.integers(0, 5, 11).tolist()
        for cap in (1, 2, 3):
            tr = _trace(seq)
            hits = simulate(make_policy("belady", cap, tr.n_unique), tr, tr.next_use())
            assert hits == _opt_hits(seq, cap)


def test_online_policies_cannot_see_the_future():
    tr = _trace([0, 1, 2, 0, 1, 2])
    for name in ("lru", "s3fifo", "kvtier"):
        pol = make_policy(name, 2, tr.n_unique)
        seen = []
        orig = pol.on_hit
        pol.on_hit = lambda b, now, c, nu, o=orig: (seen.append(nu), o(b, now, c, nu))[1]  # type: ignore
        orig_admit = pol.admit
        pol.admit = lambda b, now, c, nu, o=orig_admit: (seen.append(nu), o(b, now, c, nu))[1]  # type: ignore
        simulate(pol, tr, tr.next_use())  # hooks overridden: kvtier's compiled loop steps aside
        assert set(seen) == {-1}
    with pytest.raises(ValueError, match="offline"):
        simulate(make_policy("belady", 2, tr.n_unique), tr, None)


@pytest.mark.parametrize("line,msg", [
    ("{not json", "invalid JSON"),
    ('{"timestamp": 5, "hash_ids": "x"}', "hash_ids"),
    ('{"timestamp": -1, "hash_ids": [1]}', "timestamp"),
    ('{"timestamp": 0}', "missing field"),
    ('{"timestamp": 0, "hash_ids": [1]}', "backwards"),
])
def test_bad_trace_lines_name_the_line(tmp_path, line, msg):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 1000, "hash_ids": [0, 1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=rf"t.jsonl:2: .*{msg}"):
        load_trace(str(p))


def test_bailian_format_and_capacity_parsing(tmp_path):
    p = tmp_path / "b.jsonl"
    recs = [{"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 40, "output_length": 3,
             "type": "text", "turn": 1, "hash_ids": [7, 8, 9]},
            {"chat_id": 2, "parent_chat_id": 1, "timestamp": 1.5, "input_length": 60, "output_length": 3,
             "type": "text", "turn": 2, "hash_ids": [7, 8, 9, 10]}]
    p.write_text("\n".join(json.dumps(r) for r in recs))
    tr = load_trace(str(p))
    assert tr.format == "bailian" and tr.n_accesses == 7 and tr.n_unique == 4
    assert tr.time_s.tolist() == [0.5] * 3 + [1.5] * 4
    assert parse_fractions("1%,0.2") == [0.01, 0.2]
    with pytest.raises(ValueError):
        parse_fractions("150%")


def test_reference_lru_and_belady_on_conversation_trace():
    path = traces_or_skip()
    ref = json.loads((path.parent / "baseline_results.json").read_text())
    tr = load_trace(str(path))
    rep = replay(tr, [0.01, 0.02, 0.05, 0.10, 0.20], ["lru", "belady"], {})
    expected = {0.01: (0.0523, 0.2464), 0.02: (0.0787, 0.3142), 0.05: (0.1954, 0.3664),
                0.10: (0.2784, 0.3664), 0.20: (0.3446, 0.3664)}
    for row in rep["rows"]:
        lru, bel = expected[row["fraction"]]
        assert round(row["hit"]["lru"], 4) == lru
        assert round(row["hit"]["belady"], 4) == bel
    assert ref  # the reference file is readable alongside the trace


def test_multi_tier_accounting():
    from kvtier.replay.tiered import TierSpec, simulate_tiers

    rng = np.random.default_rng(3)
    tr = _trace((rng.zipf(1.2, 4000) % 500).tolist())
    r = simulate_tiers("lru", TierSpec(20, 60, block_bytes=1000, dram_bytes_per_s=1e6, nvme_bytes_per_s=1e5), tr)
    assert abs(sum(r["hit"].values()) + r["miss"] - 1) < 1e-12
    assert r["miss"] == tr.n_unique / tr.n_accesses  # NVMe keeps everything: only first touches miss
    single = simulate(make_policy("lru", 20, tr.n_unique), tr, None)
    assert r["hit"]["hbm"] == single / tr.n_accesses  # HBM under LRU is exactly the single-tier LRU cache
    n = tr.n_accesses
    assert r["stall_s"] == pytest.approx(r["hit"]["dram"] * n * 1000 / 1e6 + r["hit"]["nvme"] * n * 1000 / 1e5)


def test_exclusive_lru_tiers_equal_one_lru_of_their_total_size():
    """Victims go one tier down and DRAM hits move up, so HBM holds the most recent
    blocks and DRAM the next: together exactly an LRU cache of HBM + DRAM slots."""
    from kvtier.replay.tiered import TierSpec, simulate_tiers

    rng = np.random.default_rng(4)
    tr = _trace((rng.zipf(1.2, 5000) % 700).tolist())
    r = simulate_tiers("lru", TierSpec(25, 75), tr)
    both = simulate(make_policy("lru", 100, tr.n_unique), tr, None)
    assert (r["hit"]["hbm"] + r["hit"]["dram"]) * tr.n_accesses == pytest.approx(both)


def test_multi_tier_kvtier_uses_dram_for_blocks_hbm_declines():
    from kvtier.replay.tiered import TierSpec, simulate_tiers

    rng = np.random.default_rng(5)
    tr = _trace((rng.zipf(1.1, 20000) % 3000).tolist())
    r = simulate_tiers("kvtier", TierSpec(30, 300), tr, {"track_calibration": False})
    assert abs(sum(r["hit"].values()) + r["miss"] - 1) < 1e-12
    single = simulate(make_policy("kvtier", 30, tr.n_unique, track_calibration=False), tr, None)
    assert round(r["hit"]["hbm"] * tr.n_accesses) == single  # same policy object, same decisions in HBM
    lru = simulate_tiers("lru", TierSpec(30, 300), tr)
    # DRAM's policy learns from its own hits, and blocks HBM declines may still take DRAM:
    # HBM + DRAM together serve more than under LRU (without either, fewer: 0.4245 < 0.4297)
    assert r["hit"]["hbm"] + r["hit"]["dram"] > lru["hit"]["hbm"] + lru["hit"]["dram"] + 0.01


def test_an_hbm_victim_is_offered_to_dram_as_the_daemon_values_it():
    """A block HBM evicts is valued by DRAM at its own class and real age (``admit_many``, as
    the daemon's demotion does), not as a block just read of the reader's class (``admit``);
    only a block just read that HBM declines goes through ``admit``."""
    from kvtier.replay.tiered import TierSpec, _Node

    rng = np.random.default_rng(7)
    tr = _trace((rng.zipf(1.1, 6000) % 900).tolist())
    tr.cls = rng.integers(0, 3, tr.n_accesses)
    node = _Node("kvtier", TierSpec(20, 200), tr.n_unique, {"track_calibration": False})
    last_cls = np.full(tr.n_unique, -1)
    offered: list[tuple[str, int, int]] = []
    victims = 0
    many, one = node.dram.admit_many, node.dram.admit

    def admit_many(blocks, classes):
        offered.extend(("victim", int(b), int(c)) for b, c in zip(blocks, classes))
        return many(blocks, classes)

    def admit(b, now, cls, next_use):
        offered.append(("read", b, cls))
        return one(b, now, cls, next_use)
    node.dram.admit_many, node.dram.admit = admit_many, admit
    for b, now, c in zip(tr.block.tolist(), tr.time_s.tolist(), tr.cls.tolist()):
        del offered[:]
        node.access(b, now, c, None)
        last_cls[b] = c
        for kind, x, cls in offered:
            assert cls == last_cls[x]  # the offered block's own class at its last access
            if kind == "read":
                assert x == b  # only the block being read is valued as just accessed
            else:
                assert x != b  # an HBM victim: another block than the one read
                victims += 1
    assert victims > 100 and node.dram.size > 0


def _fleet_reference(tr, nodes: int) -> dict[str, int]:
    """Brute force: requests round-robin over ``nodes``; a block a node reuses is published;
    an unbounded remote serves a node's first touch of a published block."""
    local = [set() for _ in range(nodes)]
    published: set[int] = set()
    out = {"local": 0, "remote": 0, "miss": 0}
    for b, req in zip(tr.block.tolist(), tr.request.tolist()):
        seen = local[req % nodes]
        if b in seen:
            out["local"] += 1
            published.add(b)
        elif b in published:
            out["remote"] += 1
        else:
            out["miss"] += 1
        seen.add(b)
    return out


@pytest.mark.parametrize("nodes", [2, 5])
def test_fleet_replay_counts_remote_hits_exactly(nodes):
    from kvtier.replay.tiered import TierSpec, simulate_tiers

    rng = np.random.default_rng(6)
    tr = _trace((rng.zipf(1.2, 6000) % 800).tolist())
    tr.request = np.arange(tr.n_accesses) // 3  # requests of three blocks each
    ref = _fleet_reference(tr, nodes)
    r = simulate_tiers("lru", TierSpec(10, 30, nodes=nodes, remote_blocks=tr.n_unique), tr)
    n = tr.n_accesses
    assert round(r["hit"]["remote"] * n) == ref["remote"] and round(r["miss"] * n) == ref["miss"]
    assert round((r["hit"]["hbm"] + r["hit"]["dram"] + r["hit"]["nvme"]) * n) == ref["local"]
    assert r["fleet_hit"] == pytest.approx(1 - ref["miss"] / n) and r["nodes"] == nodes
    # the same nodes without a remote tier: every remote hit becomes a miss
    alone = simulate_tiers("lru", TierSpec(10, 30, nodes=nodes), tr)
    assert round(alone["miss"] * n) == ref["miss"] + ref["remote"] and "remote" not in alone["hit"]
    # write-through (every computed block published): any block seen anywhere before is a fleet hit
    wt = simulate_tiers("lru", TierSpec(10, 30, nodes=nodes, remote_blocks=tr.n_unique, publish_min_shares=0), tr)
    assert round(wt["miss"] * n) == tr.n_unique and wt["hit"]["remote"] > r["hit"]["remote"]
    assert wt["remote_writes"] == tr.n_unique > r["remote_writes"]  # ... for a write of every block
    # a cluster of 20 blocks (LRU) serves fewer than an unbounded one, but some
    small = simulate_tiers("lru", TierSpec(10, 30, nodes=nodes, remote_blocks=20), tr)
    assert 0 < small["hit"]["remote"] < r["hit"]["remote"]


def test_hits_by_part_are_exact_and_independent_of_chunking():
    # LRU of 2 over this sequence hits at accesses 2, 5, 6 and 9 (0-based); 10 accesses in
    # 4 parts cut at 2, 5, 7: parts [0, 2), [2, 5), [5, 7), [7, 10)
    tr = _trace([0, 1, 0, 2, 3, 2, 3, 4, 1, 4])
    for chunk in (1, 3, 4, 1000):
        parts = [0] * 4
        hits = simulate(make_policy("lru", 2, tr.n_unique), tr, None, chunk=chunk, hits_by_part=parts)
        assert (hits, parts) == (4, [0, 1, 2, 1])
    # fewer accesses than parts: empty parts hold no hits
    parts = [0] * 8
    assert simulate(make_policy("lru", 2, 2), _trace([0, 0, 1]), None, hits_by_part=parts) == 1
    assert parts == [0, 0, 0, 0, 0, 1, 0, 0]


def test_learning_curve_in_the_report_matches_the_hits():
    from kvtier.replay.sim import PARTS

    rng = np.random.default_rng(5)
    tr = _trace((rng.zipf(1.3, 5000) % 700).tolist())
    rep = replay(tr, [0.05], ["lru", "kvtier"], {})
    row = rep["rows"][0]
    for name in ("lru", "kvtier"):
        curve = row["hit_by_part"][name]
        assert len(curve) == PARTS
        # equal parts of 625 accesses: the mean of the parts is the whole-trace hit ratio
        assert abs(float(np.mean(curve)) - row["hit"][name]) < 1e-12
    # the report's curve is each part's hits over its 625 accesses, in order
    cap = row["capacity_blocks"]
    for name in ("lru", "kvtier"):
        parts = [0] * PARTS
        simulate(make_policy(name, cap, tr.n_unique), tr, None, hits_by_part=parts)
        assert row["hit_by_part"][name] == [h / 625 for h in parts] and len(set(parts)) > 1
    # the compiled loop (at any chunk size) and the hooks split the same hits the same way
    parts_h = [0] * PARTS
    simulate(make_policy("kvtier", cap, tr.n_unique), tr, None, compiled=False, hits_by_part=parts_h)
    for chunk in (7, 20000):
        parts_c = [0] * PARTS
        simulate(make_policy("kvtier", cap, tr.n_unique), tr, None, chunk=chunk, hits_by_part=parts_c)
        assert parts_c == parts_h
    with pytest.raises(ValueError):
        simulate(make_policy("lru", cap, tr.n_unique), tr, None, chunk=0)
