"""Dense resident arrays: removing many blocks at once leaves what one-by-one removal leaves."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policy.base import swap_remove, swap_remove_many
from kvtier.policy.lhd import LHDPolicy
from kvtier.policy.value import ValuePolicy


def _dense(n: int, residents: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    slots = np.full(n, -1, dtype=np.int64)
    where = np.full(n, -1, dtype=np.int64)
    slots[: residents.size] = residents
    where[residents] = np.arange(residents.size)
    return slots, where


def _consistent(slots: np.ndarray, where: np.ndarray, size: int) -> None:
    live = slots[:size]
    assert np.array_equal(where[live], np.arange(size))
    assert int((where >= 0).sum()) == size


@pytest.mark.parametrize("seed", range(6))
def test_many_at_once_leaves_the_residents_one_by_one_leaves(seed):
    rng = np.random.default_rng(seed)
    n = 500
    residents = rng.permutation(n)[: rng.integers(1, n)]
    slots, where = _dense(n, residents)
    ref_slots, ref_where = slots.copy(), where.copy()
    size = ref_size = residents.size
    for _ in range(20):
        if size == 0:
            break
        live = slots[:size]
        k = int(rng.integers(0, size + 1))
        pick = rng.choice(live, size=k, replace=False)
        if rng.random() < 0.3:  # the tail's blocks among them: their positions are no holes
            pick = np.unique(np.concatenate([pick, live[-min(size, 5):]]))
        size = swap_remove_many(slots, where, size, pick)
        for b in pick.tolist():
            ref_size = swap_remove(ref_slots, ref_where, ref_size, b)
        assert size == ref_size
        assert set(slots[:size].tolist()) == set(ref_slots[:ref_size].tolist())
        _consistent(slots, where, size)
        assert (where[pick] == -1).all()


def test_a_block_not_resident_is_refused_and_nothing_changes():
    slots, where = _dense(10, np.arange(6))
    before = slots.copy(), where.copy()
    with pytest.raises(ValueError, match="block 8 is not a resident"):
        swap_remove_many(slots, where, 6, np.array([2, 8]))
    assert np.array_equal(slots, before[0]) and np.array_equal(where, before[1])


@pytest.mark.parametrize("make", [lambda: ValuePolicy(64, 64), lambda: LHDPolicy(64, 64)])
def test_policies_remove_many_as_remove(make):
    a, b = make(), make()
    blocks = np.arange(40)
    for pol in (a, b):
        pol.insert_many(blocks, 0.0, np.zeros(40, dtype=np.int64))
    gone = np.array([0, 39, 7, 38, 20])
    a.remove_many(gone)
    for x in gone.tolist():
        b.remove(x)
    assert a.size == b.size == 35
    assert set(a.slots[: a.size].tolist()) == set(b.slots[: b.size].tolist())


def test_an_overridden_unlink_still_sees_every_block():
    seen: list[int] = []

    class Unlinks(ValuePolicy):
        def _unlink(self, b: int) -> None:
            seen.append(b)
            super()._unlink(b)

    pol = Unlinks(16, 16)
    pol.insert_many(np.arange(8), 0.0, np.zeros(8, dtype=np.int64))
    pol.remove_many(np.array([3, 5]))
    assert seen == [3, 5] and pol.size == 6
