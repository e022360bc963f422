"""Moves that do nothing or are refused: the reason named, the first block it applies to,
and nothing changed."""

import numpy as np
import pytest

from kvtier.tiers.types import Tier

from ..conftest import assert_same, snapshot
from .test_manager import _new_sealed


def test_move_refusals_name_the_block_and_reason_in_order_and_change_nothing(manager):
    """Every reason a move is refused, each naming the first block it applies to, the
    first reason in a fixed order when several apply, and nothing changed by a refusal."""
    m = manager
    a, b = _new_sealed(m, 31), _new_sealed(m, 32)
    m.pin(a)
    cases = [
        (lambda: m.demote([b, a], "dram", "nvme"), f"block {b} has no valid copy in DRAM"),  # before "pinned"
        (lambda: m.demote([b, a], "hbm", "dram"), f"block {a} is pinned"),
    ]
    for call, message in cases:
        before = snapshot(m)
        with pytest.raises(ValueError, match=f"^{message}$"):
            call()
        assert_same(before, snapshot(m))
    m.unpin(a)
    assert m.demote([b], "hbm", "dram") > 0  # in flight until waited for
    before = snapshot(m)
    with pytest.raises(ValueError, match=f"^block {b} is already moving$"):
        m.demote([a, b], "hbm", "dram")
    assert_same(before, snapshot(m))
    m.wait()
    assert m.table.copies[b] == 0b010 and m.table.copies[a] == 0b001
    m.check_invariants()


def test_promote_refusals_name_the_block_and_change_nothing(manager):
    """A promotion reads from the fastest tier below its destination that holds a copy; one
    into a tier that already holds the block, of a block with nothing below, or of blocks
    whose fastest copies lie in different tiers is refused, naming the first such block."""
    m = manager
    a, b, c = _new_sealed(m, 51), _new_sealed(m, 52), _new_sealed(m, 53)
    m.demote([a, b], "hbm", "dram")
    m.wait()
    m.demote([a], "dram", "nvme")
    m.wait()  # a: NVMe only; b: DRAM only; c: HBM only
    cases = [
        (lambda: m.promote([b, c]), f"block {c} is already in HBM"),
        (lambda: m.promote([a, b], Tier.DRAM), f"block {b} is already in DRAM"),
        (lambda: m.promote([b, a]), "promote: blocks come from different tiers; split the request"),
        (lambda: m.promote([a, c], Tier.DRAM), f"block {c} has no copy below DRAM to promote"),
    ]
    for call, message in cases:
        before = snapshot(m)
        with pytest.raises(ValueError, match=f"^{message}$"):
            call()
        assert_same(before, snapshot(m))
    assert m.promote([a], Tier.DRAM) > 0 and m.promote([b]) > 0  # each from its own tier
    m.wait()
    assert [int(m.table.copies[x]) for x in (a, b, c)] == [0b110, 0b011, 0b001]
    m.check_invariants()


def test_empty_moves_are_no_ops(manager):
    m = manager
    b = _new_sealed(m, 41)
    before = snapshot(m)
    assert m.promote([]) == 0 and m.promote([], Tier.DRAM) == 0  # an IndexError before
    assert m.demote([], "hbm", "dram") == 0
    assert_same(before, snapshot(m))
    assert m.table.copies[b] == 0b001
    m.check_invariants()


@pytest.mark.parametrize("dst", ["dram", "nvme"])  # the compiled planner's path (arrays, memory) and numpy's
def test_a_pinned_block_moves_only_where_its_hbm_copy_stays(manager, dst):
    """``keep_source`` keeps only a sealed block's source copy (an open block has one copy,
    and it moves), so a pinned open block is refused with it as without it: its engine still
    reads and writes that HBM slot, which must not go to another block. A pinned sealed
    block may be copied down; its slot and bytes stay."""
    m = manager
    o = int(m.alloc(1)[0])
    m.write(o, b"\x5a" * 1000)
    slot_o = m.pin(o)
    s = _new_sealed(m, 61)
    slot_s = m.pin(s)
    for keep, named in ((False, s), (True, o)):  # with keep_source s passes, o does not
        before = snapshot(m)
        with pytest.raises(ValueError, match=f"^block {named} is pinned$"):
            m.demote(np.array([s, o]), "hbm", dst, keep_source=keep)
        with pytest.raises(ValueError, match=f"^block {o} is pinned$"):
            m.demote(np.array([o]), "hbm", dst, keep_source=keep)
        assert_same(before, snapshot(m))
    assert m.demote(np.array([s]), "hbm", dst, keep_source=True) > 0
    m.wait()
    assert m.table.slot[Tier.HBM, o] == slot_o and m.table.slot[Tier.HBM, s] == slot_s
    assert m.table.copies[s] == 0b001 | (1 << int(Tier[dst.upper()]))
    assert m.read(o)[:1000] == b"\x5a" * 1000
    m.check_invariants()
