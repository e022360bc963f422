"""Moves that do nothing or are refused: the reason named, the first block it applies to,
and nothing changed."""

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


def test_empty_moves_are_no_ops(manager):
    m = manager
    b = _new_sealed(m, 41)
    before = snapshot(m)
    assert m.promote([]) == 0 and m.promote([], Tier.DRAM) == 0  # an IndexError before
    assert m.demote([], "hbm", "dram") == 0
    assert_same(before, snapshot(m))
    assert m.table.copies[b] == 0b001
    m.check_invariants()
