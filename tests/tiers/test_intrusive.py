import numpy as np
import pytest

from kvtier.tiers.intrusive import NIL, IndexLists


def test_push_pop_order_and_sentinels():
    ls = IndexLists(5, n_lists=2)
    for e in (3, 1, 4):
        ls.push_back(e, 0)
    ls.push_front(0, 1)
    ls.push_back(2, 1)
    assert ls.to_array(0).tolist() == [3, 1, 4]
    assert ls.to_array(1).tolist() == [0, 2]
    ls.move_to_back(3, 0)
    assert ls.to_array(0).tolist() == [1, 4, 3]
    assert ls.pop_front(0) == 1
    assert ls.front(0) == 4 and ls.back(0) == 3
    assert ls.pop_front_n(5, 1).tolist() == [0, 2]
    assert ls.pop_front(1) == NIL
    ls.check()


def test_misuse_raises_and_keeps_state():
    ls = IndexLists(3)
    ls.push_back(1)
    with pytest.raises(ValueError):
        ls.push_back(1)
    with pytest.raises(ValueError):
        ls.remove(2)
    with pytest.raises(ValueError):
        ls.extend_back(np.array([0, 1]))
    assert ls.to_array().tolist() == [1]
    ls.check()


def test_randomized_against_reference():
    rng = np.random.default_rng(7)
    n, k = 200, 3
    ls = IndexLists(n, n_lists=k)
    ref: list[list[int]] = [[] for _ in range(k)]
    where = {}
    for step in range(5000):
        op = rng.integers(0, 6)
        e = int(rng.integers(0, n))
        lst = int(rng.integers(0, k))
        if op == 0 and e not in where:
            ls.push_back(e, lst); ref[lst].append(e); where[e] = lst
        elif op == 1 and e not in where:
            ls.push_front(e, lst); ref[lst].insert(0, e); where[e] = lst
        elif op == 2 and e in where:
            assert ls.remove(e) == where[e]; ref[where.pop(e)].remove(e)
        elif op == 3:
            got = ls.pop_front_n(int(rng.integers(0, 5)), lst).tolist()
            exp = ref[lst][: len(got)]
            assert got == exp and len(got) == min(len(ref[lst]), len(got))
            del ref[lst][: len(got)]
            for x in got:
                where.pop(x)
        elif op == 4 and e in where:
            ls.move_to_back(e, lst); ref[where[e]].remove(e); ref[lst].append(e); where[e] = lst
        elif op == 5:
            fresh = [x for x in rng.permutation(n)[:4].tolist() if x not in where]
            ls.extend_back(np.array(fresh, dtype=np.int64), lst); ref[lst].extend(fresh)
            for x in fresh:
                where[x] = lst
        if step % 250 == 0:
            ls.check()
    for i in range(k):
        assert ls.to_array(i).tolist() == ref[i]
        assert ls.length(i) == len(ref[i])
    ls.check()


def test_check_detects_corruption():
    ls = IndexLists(4)
    ls.extend_back(np.arange(4))
    ls.next[1] = 3  # skip element 2
    with pytest.raises(RuntimeError):
        ls.check()


def test_remove_many_equals_one_by_one_removal():
    """Batch unlinking across several lists, including long runs of adjacent
    elements (the pointer-doubling path) and whole lists, against a reference."""
    rng = np.random.default_rng(11)
    n, k = 300, 3
    for trial in range(200):
        ls = IndexLists(n, n_lists=k)
        ref: list[list[int]] = [[] for _ in range(k)]
        for e in rng.permutation(n)[: int(rng.integers(0, n))].tolist():
            lst = int(rng.integers(0, k))
            ls.push_back(e, lst)
            ref[lst].append(e)
        linked = [e for r in ref for e in r]
        if trial % 3 == 0 and ref[0]:  # a contiguous run, maybe the whole list
            a = int(rng.integers(0, len(ref[0])))
            gone = ref[0][a: a + int(rng.integers(1, len(ref[0]) + 1))]
        else:
            gone = rng.permutation(linked)[: int(rng.integers(0, len(linked) + 1))].tolist() if linked else []
        ls.remove_many(np.array(gone, dtype=np.int64))
        drop = set(gone)
        for i in range(k):
            assert ls.to_array(i).tolist() == [e for e in ref[i] if e not in drop]
        assert np.all(ls.owner[gone] == NIL) if gone else True
        ls.check()


def test_remove_many_of_runs_in_a_long_list_equals_one_by_one_removal():
    """One run of adjacent elements (the one-splice path, searched or tabled), at the
    front, middle or back, and two runs or a run with a gap (the doubling path)."""
    rng = np.random.default_rng(12)
    n = 5000
    for trial in range(120):
        ls = IndexLists(n, n_lists=2)
        order = rng.permutation(n)[: int(rng.integers(400, n))].tolist()
        half = len(order) // 2
        ls.extend_back(np.array(order[:half]), 0)
        ls.extend_back(np.array(order[half:]), 1)
        ref = [order[:half], order[half:]]
        r = ref[trial % 2]
        size = int(rng.integers(5, 400 if trial % 3 else len(r) + 1))
        a = [0, len(r) - size, int(rng.integers(0, len(r) - size + 1))][trial % 3] if size <= len(r) else 0
        gone = r[a: a + size]
        if trial % 4 == 3 and len(gone) > 6:
            gone = gone[:2] + gone[4:]  # two runs: not one splice
        ls.remove_many(np.array(rng.permutation(gone), dtype=np.int64))
        drop = set(gone)
        for i in range(2):
            assert ls.to_array(i).tolist() == [e for e in ref[i] if e not in drop]
        assert np.all(ls.owner[gone] == NIL)
        ls.check()


def test_remove_many_rejects_unlinked_or_repeated_and_keeps_state():
    ls = IndexLists(20)
    ls.extend_back(np.arange(10))
    for bad in ([1, 2, 3, 4, 5, 15], [1, 2, 3, 4, 5, 5]):
        with pytest.raises(ValueError):
            ls.remove_many(np.array(bad))
        assert ls.to_array().tolist() == list(range(10))
    ls.check()


def test_pop_front_n_in_id_order_and_shuffled():
    """A fresh list (ids in order) pops as one range; a shuffled one is walked; both in list order."""
    for order in (np.arange(50), np.random.default_rng(5).permutation(50)):
        ls = IndexLists(50, n_lists=2)
        ls.extend_back(order[:40], 1)
        ls.extend_back(order[40:], 0)
        assert ls.pop_front_n(25, 1).tolist() == order[:25].tolist()
        assert ls.to_array(1).tolist() == order[25:40].tolist() and ls.to_array(0).tolist() == order[40:].tolist()
        assert ls.pop_front_n(99, 1).tolist() == order[25:40].tolist() and ls.length(1) == 0
        ls.check()
