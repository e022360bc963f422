import numpy as np
import pytest

from kvtier.tiers.key_index import KeyIndex


def test_randomized_against_dict():
    rng = np.random.default_rng(3)
    idx = KeyIndex(500)
    ref: dict[int, int] = {}
    keys = rng.integers(0, 2**64 - 1, 800, dtype=np.uint64).tolist() + [0, 2**64 - 1]
    for step in range(20000):
        k = keys[int(rng.integers(0, len(keys)))]
        if rng.random() < 0.55 and k not in ref and len(ref) < 500:
            v = int(rng.integers(0, 1 << 30))
            idx.insert(k, v); ref[k] = v
        elif k in ref:
            assert idx.pop(k) == ref.pop(k)
        else:
            assert idx.pop(k) == -1
        if step % 1000 == 0:
            q = np.array(keys, dtype=np.uint64)
            exp = np.array([ref.get(x, -1) for x in keys])
            assert np.array_equal(idx.get_many(q), exp)
    assert len(idx) == len(ref)
    for k, v in ref.items():
        assert idx.get(k) == v


def test_duplicate_and_full():
    idx = KeyIndex(2)
    idx.insert(5, 1)
    with pytest.raises(ValueError):
        idx.insert(5, 2)
    idx.insert(6, 2)
    with pytest.raises(ValueError):
        idx.insert(7, 3)
    assert idx.get(5) == 1 and idx.get(6) == 2 and 7 not in idx


def test_insert_many_matches_one_by_one_after_churn():
    """Batch inserts (a restart's adoption) land where single inserts and pops can find them,
    tombstones included; colliding homes within one batch all get a place."""
    rng = np.random.default_rng(7)
    idx = KeyIndex(3000)
    ref: dict[int, int] = {}
    pool = np.unique(rng.integers(0, 2**64 - 1, 7000, dtype=np.uint64))[:6000]
    rng.shuffle(pool)
    for k in pool[:1500].tolist():  # churn: leaves tombstones behind
        idx.insert(k, 1)
        ref[k] = 1
    for k in pool[:1000].tolist():
        assert idx.pop(k) == ref.pop(k)
    batch = pool[1500:3500]
    idx.insert_many(batch, np.arange(batch.size))
    ref.update(zip(batch.tolist(), range(batch.size)))
    q = pool
    assert np.array_equal(idx.get_many(q), np.array([ref.get(k, -1) for k in q.tolist()]))
    assert len(idx) == len(ref)
    for k in batch[:50].tolist():
        assert idx.pop(k) == ref.pop(k)
    assert np.array_equal(idx.get_many(q), np.array([ref.get(k, -1) for k in q.tolist()]))


def test_insert_many_refuses_without_changing_anything():
    idx = KeyIndex(4)
    idx.insert(5, 1)
    before = (idx.keys.copy(), idx.vals.copy(), len(idx))
    for keys in ([6, 6], [7, 5], [1, 2, 3, 4]):  # repeated, present, too many
        with pytest.raises(ValueError):
            idx.insert_many(np.array(keys, dtype=np.uint64), np.arange(len(keys)))
        assert np.array_equal(idx.keys, before[0]) and np.array_equal(idx.vals, before[1]) and len(idx) == before[2]
    idx.insert_many(np.array([6, 7, 8], dtype=np.uint64), np.array([2, 3, 4]))
    assert idx.get_many(np.array([5, 6, 7, 8, 9], dtype=np.uint64)).tolist() == [1, 2, 3, 4, -1]
