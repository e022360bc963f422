"""An engine's references and pins: one byte a block for both, exact past the nibble's
limit, indexed like the int arrays they replaced, with their sums kept as they change."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.engine_counts import BIG, EngineCounts


@pytest.mark.parametrize("nibble", ["pins", "refs"])
def test_random_updates_match_int_arrays_across_the_limit_and_leave_the_other_nibble_alone(nibble):
    """Vectorised += and -= on unique ids, add/sub, add_many with repeats, scalar updates,
    reads of ids, masks and scalars: always equal to a plain int64 array, with counts pushed
    well past the limit and back down to 0 (the overflow dict empties again). The other
    count sharing the byte is updated at random all along and never disturbed."""
    rng = np.random.default_rng(3)
    n = 64
    both = EngineCounts(n)
    counts, other = getattr(both, nibble), both.refs if nibble == "pins" else both.pins
    ref, ref_other = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    hot = np.array([5, 9])  # held from hundreds of sequences at once
    for step in range(20000):
        if step < 2000:
            blocks = np.unique(np.concatenate([hot, rng.integers(0, n, size=int(rng.integers(0, 8)))]))
            if step % 3 == 0:
                counts[blocks] += 1
            elif step % 3 == 1:
                counts.add(blocks)
            else:
                counts.add_many(np.concatenate([blocks, blocks[:1]]))
                ref[blocks[:1]] += 1
            ref[blocks] += 1
        else:
            blocks = np.flatnonzero(ref)[: int(rng.integers(1, 10))]
            if blocks.size == 0:
                break
            if step % 97 == 0:
                continue
            if step % 2:
                counts[blocks] -= 1
            else:
                counts.sub(blocks)
            ref[blocks] -= 1
        if step % 97 == 0 and step < 2000:
            b = int(rng.integers(0, n))
            counts[b] = counts[b] + 3
            ref[b] += 3
        o = np.unique(rng.integers(0, n, size=3))
        if step % 2 or not (ref_other[o] > 0).all():
            other.add(o)
            ref_other[o] += 1
        else:
            other.sub(o)
            ref_other[o] -= 1
        probe = rng.integers(0, n, size=12)
        assert counts[probe].tolist() == ref[probe].tolist()
        assert counts[ref > 2].tolist() == ref[ref > 2].tolist()
        assert [counts[int(b)] for b in probe] == ref[probe].tolist()
        assert counts.sum() == int(ref.sum()) and (not counts.count_held or counts.held == int(np.count_nonzero(ref)))
        assert counts.pinned(probe).tolist() == (ref[probe] > 0).tolist()
        assert np.asarray(other).tolist() == ref_other.tolist()
        assert other.sum() == int(ref_other.sum())
        assert both.refs.held == int(np.count_nonzero(ref if nibble == "refs" else ref_other))
    assert ref.max() == 0 and step > 2000  # every count was dropped again
    assert np.asarray(counts).tolist() == ref.tolist() and not counts
    assert counts.nonzero_ids().tolist() == np.flatnonzero(ref).tolist()
    assert max(ref[hot]) == 0 and not counts.big  # back below the limit: nothing left in the dict


def test_counts_past_the_limit_are_exact():
    both = EngineCounts(4)
    pins = both.pins
    for _ in range(BIG + 45):
        pins[np.array([1, 2])] += 1
    both.refs.add(np.array([1, 3]))
    assert pins[np.array([0, 1, 2])].tolist() == [0, BIG + 45, BIG + 45]
    assert pins[1] == BIG + 45 and pins.big == {1: BIG + 45, 2: BIG + 45}
    pins[np.array([1])] -= 46
    assert pins[1] == BIG - 1 and 1 not in pins.big
    assert pins.sum() == (BIG - 1) + (BIG + 45)
    assert both.refs[np.arange(4)].tolist() == [0, 1, 0, 1] and dict(both.refs.items()) == {1: 1, 3: 1}
    assert both.packed.dtype == np.uint8 and both.packed.nbytes == 4  # one byte a block for both counts


def test_a_negative_count_is_refused_and_changes_nothing():
    both = EngineCounts(8)
    pins = both.pins
    pins[np.array([1, 2, 3])] += 1
    both.refs.add(np.array([1, 2, 3, 4]))
    before = both.packed.copy()
    with pytest.raises(ValueError, match="negative"):
        pins[np.array([1, 4])] -= 1  # block 4 holds no pin
    with pytest.raises(ValueError, match="negative"):
        pins[6] = -1
    with pytest.raises(ValueError, match="negative"):
        pins.sub(np.array([2, 5]))
    assert both.packed.tolist() == before.tolist() and pins.sum() == 3 and both.refs.held == 4


def test_one_engine_pins_one_block_from_300_sequences_through_the_daemon(tmp_path):
    """Past the one-byte limit through the service: 300 acquires of one shared prefix
    block by one engine, then 300 releases; the engine's count and the table's agree
    at every step the invariant check looks, and the block is unpinned at the end."""
    from kvtier.daemon.config import load_config
    from kvtier.daemon.service import Service
    from kvtier.protocol import wire as P

    from .service_calls import call, ids

    bb = 4096
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={4 * bb}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0", 'policy.name="lru"',
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg)
    try:
        call(svc, "register", "e", pid=0, block_bytes=bb)
        b = ids(call(svc, "alloc", "e", n=1, seq=1, pin=True)["blocks"])[0]
        c = ids(call(svc, "seal", "e", blocks=[b], keys=P.id_bytes(np.array([42], np.uint64), np.uint64),
                     seq=1)["blocks"])[0]
        call(svc, "release", "e", blocks=[c])
        for i in range(300):
            assert call(svc, "acquire", "e", blocks=[c], timeout_s=1.0)["done"]
            if i in (253, 254, 255, 299):
                assert svc.engines["e"].pins[c] == i + 1 == int(svc.node.mgr.table.pins[c])
                assert call(svc, "check", "e")["ok"]
        for _ in range(300):
            call(svc, "release", "e", blocks=[c])
        assert svc.engines["e"].pins[c] == 0 == int(svc.node.mgr.table.pins[c])
        assert not svc.engines["e"].pins.big
        assert call(svc, "check", "e")["ok"]
        with pytest.raises(P.ProtocolError):  # one release too many: refused, counts unchanged
            call(svc, "release", "e", blocks=[c])
        assert svc.engines["e"].pins[c] == 0 == int(svc.node.mgr.table.pins[c])
    finally:
        svc.close()


def test_pins_of_an_unfinished_acquire_are_not_the_engines_to_release(tmp_path):
    """Engine a's acquire of [X, Y] waits for Y (in DRAM) while holding its pin on X, which
    engine b pins too. a releasing X would take a pin its own waiter still owns (and, at
    the waiter's end, b's): it is refused and nothing changes; when the waiter ends, its
    pins go, b's stays, and the daemon's loop keeps running."""
    import time

    from kvtier.daemon.config import load_config
    from kvtier.daemon.service import Service
    from kvtier.protocol import wire as P
    from kvtier.tiers.types import Tier

    from .service_calls import call, ids

    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=32768", "tiers.dram_bytes=32768", "tiers.nvme_bytes=65536",
        f'tiers.nvme_dir="{tmp_path}/nvme"', f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg)
    try:
        for e in "ab":
            call(svc, "register", e, pid=0, block_bytes=4096)
        x, y = ids(call(svc, "alloc", "a", n=2, seq=0)["blocks"])
        call(svc, "seal", "a", blocks=[x, y], keys=P.id_bytes(np.array([11, 12], np.uint64), np.uint64))
        call(svc, "ref", "b", keys=P.id_bytes(np.array([11], np.uint64), np.uint64))
        assert call(svc, "acquire", "b", blocks=[x], timeout_s=1.0)["done"]
        mgr = svc.node.mgr
        mgr.demote([y], Tier.HBM, Tier.DRAM)
        mgr.wait()
        r = call(svc, "acquire", "a", blocks=[x, y], timeout_s=0.0, wait=False)
        assert not r["done"] and len(svc.residency.waiters) == 1
        pins = lambda: (int(mgr.table.pins[x]), svc.engines["a"].pins[x], svc.engines["b"].pins[x])
        assert pins() == (2, 1, 1)
        with pytest.raises(P.ProtocolError) as e:
            call(svc, "release", "a", blocks=[x])
        assert e.value.code == P.INVALID and "unfinished acquire" in e.value.message
        assert pins() == (2, 1, 1)
        for w in svc.residency.waiters.values():
            w.deadline -= 1000.0
        for _ in range(3):
            svc.residency.advance_waiters()
            time.sleep(0.01)
        assert not svc.residency.waiters
        assert pins() == (1, 0, 1)
        call(svc, "release", "b", blocks=[x])
        assert pins() == (0, 0, 0)
        assert call(svc, "check", "a")["ok"]
    finally:
        svc.close()
