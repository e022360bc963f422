import numpy as np
import pytest

from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import BlockState, Tier

from ..conftest import assert_same, pattern, snapshot

BB = 12_000


def _new_sealed(m: TierManager, tag: int) -> int:
    b = int(m.alloc(1)[0])
    m.write(b, pattern(tag, BB))
    return m.seal(b, key=tag)


def test_demote_promote_bytes_and_copies(manager):
    m = manager
    b = _new_sealed(m, 11)
    o = int(m.alloc(1)[0])
    m.write(o, pattern(99, 5000))
    assert m.demote([b, o], "hbm", "dram") > 0
    m.wait()
    assert m.table.copies[b] == 0b010 and m.table.copies[o] == 0b010
    assert m.read(b) == pattern(11, BB).tobytes() and m.read(o) == pattern(99, 5000).tobytes()
    m.demote([b, o], Tier.DRAM, Tier.NVME); m.wait()
    assert m.table.copies[b] == 0b100 and m.read(b) == pattern(11, BB).tobytes()
    m.promote([b, o]); m.wait()
    # sealed keeps its clean NVMe copy, open moved (exactly one copy)
    assert m.table.copies[b] == 0b101 and m.table.copies[o] == 0b001
    assert m.read(o) == pattern(99, 5000).tobytes()
    before = m.counters["moves_hbm->nvme"]
    assert m.demote([b], Tier.HBM, Tier.NVME) == 0  # clean: no I/O
    assert m.counters["moves_hbm->nvme"] == before and m.table.copies[b] == 0b100
    m.check_invariants()


def test_prefix_sharing_refcounts(manager):
    m = manager
    a = _new_sealed(m, 5)
    b = int(m.alloc(1)[0])
    m.write(b, pattern(5, BB))
    assert m.seal(b, key=5) == a  # same prefix key -> shared block
    assert m.table.refcount[a] == 2 and m.table.state[b] == BlockState.FREE
    assert m.ref(5) == a and m.table.refcount[a] == 3
    for _ in range(3):
        m.free(a)
    assert m.table.state[a] == BlockState.SEALED and m.table.refcount[a] == 0  # cached
    m.drop(a)
    assert m.lookup(5) == -1
    m.check_invariants()


@pytest.mark.parametrize("misuse", [
    lambda m, b, o: m.free(999),
    lambda m, b, o: m.promote([b]),                     # already in HBM
    lambda m, b, o: m.promote([12345]),                 # unknown block
    lambda m, b, o: m.demote([b], "dram", "nvme"),      # no DRAM copy
    lambda m, b, o: m.demote([b, b], "hbm", "dram"),    # named twice
    lambda m, b, o: m.demote([b], "nvme", "dram"),      # not downward
    lambda m, b, o: m.demote([b], "hbm", "tape"),       # unknown tier
    lambda m, b, o: m.write(b, b"x"),                   # sealed is immutable
    lambda m, b, o: m.write(o, b"x" * (BB + 1)),        # wrong size
    lambda m, b, o: m.seal(b, 7),                       # sealed twice
    lambda m, b, o: m.drop(o),                          # live block
    lambda m, b, o: m.unpin(o),                         # not pinned
    lambda m, b, o: m.ref(424242),                      # unknown key
    lambda m, b, o: m.drop_copy(o, "hbm"),              # only copy
])
def test_misuse_raises_and_changes_nothing(manager, misuse):
    m = manager
    b = _new_sealed(m, 3)
    o = int(m.alloc(1)[0])
    m.write(o, b"abc")
    before = snapshot(m)
    with pytest.raises(ValueError):
        misuse(m, b, o)
    assert_same(before, snapshot(m))
    m.check_invariants()


def test_pinned_and_double_free(manager):
    m = manager
    b = _new_sealed(m, 8)
    m.pin(b)
    before = snapshot(m)
    for bad in (lambda: m.demote([b], "hbm", "dram"), lambda: m.free(b), lambda: m.drop(b)):
        with pytest.raises(ValueError):
            bad()
        assert_same(before, snapshot(m))
    m.unpin(b)
    m.free(b)
    with pytest.raises(ValueError, match="double free"):
        m.free(b)


def test_full_tier_returns_none(manager):
    m = manager
    blocks = m.alloc(6)
    assert m.alloc(1) is None  # HBM full: "does not fit", nothing changes
    for i, b in enumerate(blocks.tolist()):
        m.write(b, pattern(i, 100))
    m.demote(blocks, "hbm", "dram"); m.wait()
    more = m.alloc(6)
    before = snapshot(m)
    assert m.demote(more, "hbm", "dram") is None
    assert_same(before, snapshot(m))


def test_randomized_operations_keep_bytes_and_invariants(nvme_dir):
    rng = np.random.default_rng(2024)
    m = TierManager(BB, 8, 10, 24, nvme_dir=nvme_dir, io_backend="posix", io_threads=3, max_blocks=64)
    expected: dict[int, bytes] = {}
    try:
        for step in range(400):
            live = [b for b in expected]
            op = rng.integers(0, 9)
            try:
                if op == 0:
                    got = m.alloc(int(rng.integers(1, 3)))
                    if got is not None:
                        for b in got.tolist():
                            tag = int(rng.integers(0, 1 << 20))
                            m.write(b, pattern(tag, BB))
                            expected[b] = pattern(tag, BB).tobytes()
                elif op == 1 and live:
                    b = int(rng.choice(live))
                    if m.table.state[b] == BlockState.OPEN and m.table.has_copy(b, 0) and not m.table.busy[b]:
                        tag = int(rng.integers(0, 12))  # few keys: dedupe happens
                        m.write(b, pattern(tag, BB))
                        expected[b] = pattern(tag, BB).tobytes()  # written, even where the seal is refused
                        c = m.seal(b, key=tag)  # (a pinned block is not folded into another)
                        if c != b:
                            del expected[b]
                        expected[c] = pattern(tag, BB).tobytes()
                elif op in (2, 3) and live:
                    pick = rng.choice(live, size=min(len(live), int(rng.integers(1, 4))), replace=False)
                    home = m.table.home_tiers()[pick]
                    src = int(home[0])
                    pick = pick[home == src]
                    if op == 2 and src < 2:  # keep_source keeps a sealed block's source copy only
                        m.demote(pick, src, int(rng.integers(src + 1, 3)), keep_source=bool(rng.integers(0, 2)))
                    elif op == 3 and src > 0:
                        m.promote(pick, int(rng.integers(0, src)))
                elif op == 4 and live:
                    b = int(rng.choice(live))
                    if m.table.refcount[b] > 0:
                        m.free(b)
                        if m.table.refcount[b] == 0 and m.table.state[b] != BlockState.SEALED:
                            del expected[b]  # open block dies (deferred while it moves)
                elif op == 5 and live:
                    b = int(rng.choice(live))
                    if m.table.refcount[b] == 0 and not m.table.busy[b]:
                        m.drop(b)
                        del expected[b]
                elif op == 6:
                    m.poll()
                elif op == 7 and live:  # an engine pins: its HBM slot must hold the block while pinned
                    m.pin(int(rng.choice(live)))
                elif op == 8 and m.table.pins.any():
                    m.unpin(int(rng.choice(np.flatnonzero(m.table.pins))))
            except ValueError:
                pass  # misuse of a busy/pinned block is rejected; state checked below
            if step % 10 == 0:
                m.wait()
                m.check_invariants()
                assert not m.last_errors
                for b, data in expected.items():
                    assert m.table.state[b] != BlockState.FREE
                    assert m.read(b) == data, f"block {b} bytes changed at step {step}"
                    if m.table.pins[b]:  # what the pinning engine reads in place
                        view = m.hbm.host_view(int(m.table.slot[Tier.HBM, b]))
                        assert bytes(view[:BB]) == data, f"pinned block {b}'s slot changed at step {step}"
        m.wait()
        m.check_invariants()
        assert m.counters["moves_dram->nvme"] > 0 and m.counters["moves_nvme->hbm"] + m.counters["moves_nvme->dram"] > 0
    finally:
        m.close()


def test_adopt_sealed_is_all_or_nothing(manager):
    """Batch adoption of NVMe contents (a restart): bad input changes no state;
    good input gives cached sealed blocks, indexed, evictable, in their slots."""
    m = manager
    b = _new_sealed(m, 5)
    m.demote([b], "hbm", "nvme"); m.wait()
    taken = int(m.table.slot[Tier.NVME, b])
    before = snapshot(m)
    bad = [
        ([taken, 3], [901, 902]),  # a slot another block owns
        ([3, 3], [901, 902]),  # a slot twice
        ([3, 4], [901, 901]),  # a key twice
        ([3, 4], [5, 902]),  # a key already indexed
        (list(range(m.table.max_blocks + 1)), list(range(1000, 1001 + m.table.max_blocks))),  # too many
    ]
    for slots, keys in bad:
        with pytest.raises(ValueError):
            m.table.adopt_sealed(Tier.NVME, np.array(slots), np.array(keys), np.full(len(slots), 7),
                                 np.arange(len(slots)))
        assert_same(before, snapshot(m))
    got = m.table.adopt_sealed(Tier.NVME, np.array([3, 4]), np.array([901, 902]), np.array([7, 8]), np.array([1, 2]))
    for blk, slot, key, n in zip(got.tolist(), (3, 4), (901, 902), (7, 8)):
        assert m.table.state[blk] == BlockState.SEALED and m.table.refcount[blk] == 0
        assert m.table.slot[Tier.NVME, blk] == slot and m.table.copies[blk] == 1 << Tier.NVME
        assert m.lookup(key) == blk and m.table.nbytes[blk] == n
        assert m.table.nvme_idle.contains(blk)
    m.check_invariants()


def test_a_completion_that_raises_does_not_strand_the_ones_polled_with_it(manager):
    """Completions the mover hands over together are applied path group by path group:
    when applying one group raises (here an event listener), that group is still applied
    in full and the groups after it are applied by the next poll, so no block stays busy
    forever and ``wait`` returns."""
    m = manager
    a, b = _new_sealed(m, 21), _new_sealed(m, 22)
    c = _new_sealed(m, 23)
    m.demote([c], "hbm", "dram")
    m.wait()
    boom = {"armed": True}

    def listener(kind: str, blk: int, tier: int) -> None:
        if boom["armed"] and kind == "stored":
            boom["armed"] = False
            raise RuntimeError("listener failed")

    m.listeners.append(listener)
    m.demote([a], "hbm", "dram")
    m.demote([b], "hbm", "dram")
    m.promote([c], "hbm")  # another path: its own group, after the one that raises
    m.mover.drain()  # all three completions are waiting: one poll takes them together
    with pytest.raises(RuntimeError, match="listener failed"):
        m.poll()
    assert len(m._unapplied) == 1 and int(m.table.busy[c]) == 1  # the promotion waits for the next poll
    # the group whose listener raised was applied in full all the same
    for blk, tag in ((a, 21), (b, 22)):
        assert int(m.table.busy[blk]) == 0 and m.table.copies[blk] == 0b010
        assert int(m.table.slot[Tier.HBM, blk]) == -1 and m.read(blk) == pattern(tag, BB).tobytes()
    assert m.counters["moves_hbm->dram"] == 3
    m.wait(timeout=5)
    assert int(m.table.busy[c]) == 0 and m.table.copies[c] == 0b011 and m.counters["moves_dram->hbm"] == 1
    m.check_invariants()


def test_completions_applied_as_one_group_leave_the_state_of_one_by_one(nvme_dir):
    """Memory-copy completions of one path polled together are applied in one pass; every
    table column, list and counter ends as if each had been applied on its own, a failed
    block included."""
    def run(together: bool, sub: str):
        m = TierManager(block_bytes=12_000, hbm_slots=8, dram_slots=8, nvme_slots=12,
                        nvme_dir=f"{nvme_dir}/{sub}", io_backend="posix", io_threads=2)
        try:
            blocks = [_new_sealed(m, 40 + i) for i in range(6)]
            stored: list[tuple[str, int, int]] = []
            m.listeners.append(lambda kind, blk, tier: stored.append((kind, blk, tier)))
            m.mover.start_early = False  # through the lane, whose completions the fault is injected in
            real = m.mover._execute

            def failing(batch):  # the third block's copy fails: its DRAM slot must be given back
                out = real(batch)
                for comp in out:
                    comp.ok[comp.blocks == blocks[2]] = False
                    if blocks[2] in comp.blocks:
                        comp.errors[blocks[2]] = "injected"
                return out

            m.mover._execute = failing
            passes = []
            apply_one = m._apply_completion
            m._apply_completion = lambda p, c: (passes.append(p.blocks.size), apply_one(p, c))
            for lo in (0, 2, 4):
                m.demote(blocks[lo: lo + 2], "hbm", "dram")
                if not together:
                    m.wait()
            m.mover.drain()  # every completion is waiting: one poll takes them all
            m.wait()
            assert passes == ([6] if together else [2, 2, 2])
            m.check_invariants()
            per_tier = {t: [e for e in stored if e[2] == t] for t in (0, 1)}  # the order each tier sees
            counters = {k: v for k, v in m.counters.items() if not k.startswith("busy_ns")}  # time, not state
            return snapshot(m), counters, per_tier, [m.read(b) for b in blocks]
        finally:
            m.close()

    one, grouped = run(False, "a"), run(True, "b")
    assert_same(one[0], grouped[0])
    assert one[1] == grouped[1] and one[1]["moves_hbm->dram"] == 5 and one[1]["errors_hbm->dram"] == 1
    assert one[2] == grouped[2] and one[3] == grouped[3]


def test_an_interrupt_in_a_listener_still_applies_the_whole_group(manager, caplog):
    """A listener that raises an interrupt (not an ``Exception``) mid-group: every
    completion of the group is still applied (a failed block's reserved slot comes back,
    its error is counted), the interrupt is raised once that is done, and the group's
    other listener errors are logged, not dropped."""
    m = manager
    blocks = [_new_sealed(m, 60 + i) for i in range(3)]
    m.mover.start_early = False  # through the lane, whose completions the fault is injected in
    real = m.mover._execute

    def failing(batch):  # the last block's copy fails: its DRAM slot must be given back
        out = real(batch)
        for comp in out:
            if blocks[2] in comp.blocks:
                comp.ok[comp.blocks == blocks[2]] = False
                comp.errors[blocks[2]] = "injected"
        return out

    def listener(kind: str, blk: int, tier: int) -> None:
        if kind == "stored":
            raise KeyboardInterrupt if blk == blocks[0] else RuntimeError(f"listener failed on {blk}")

    m.mover._execute = failing
    m.listeners.append(listener)
    for b in blocks:
        m.demote([b], "hbm", "dram")
    m.mover.drain()  # the three completions are polled together: one group
    with caplog.at_level("ERROR", logger="kvtier.tiers"), pytest.raises(KeyboardInterrupt):
        m.poll()
    assert f"listener failed on {blocks[1]}" in caplog.text  # the other error is logged
    assert not m._pending and not m._unapplied and not m.table.busy[blocks].any()
    assert m.table.copies[blocks[0]] == 0b010 and m.table.copies[blocks[1]] == 0b010
    assert m.table.copies[blocks[2]] == 0b001 and int(m.table.slot[Tier.DRAM, blocks[2]]) == -1
    assert m.counters["moves_hbm->dram"] == 2 and m.counters["errors_hbm->dram"] == 1
    assert m.last_errors[blocks[2]] == "injected"
    m.check_invariants()
    m.listeners.clear()
    m.mover._execute = real
    m.demote([blocks[2]], "hbm", "dram")  # the failed block moves again: no slot leaked
    m.wait(timeout=5)
    assert m.table.copies[blocks[2]] == 0b010 and m.read(blocks[2]) == pattern(62, BB).tobytes()
    m.check_invariants()


def test_a_read_hold_keeps_every_copy_but_lets_the_block_be_pinned_and_promoted(manager):
    """A remote write reads a sealed block's bytes: nothing may drop or reuse a copy meanwhile,
    but an engine's acquire (a pin, or a promotion, which only reads its source) does not wait."""
    m = manager
    b = _new_sealed(m, 21)
    m.demote([b], "hbm", "dram"); m.wait()  # DRAM only: the remote write reads the DRAM slot
    held = [np.array([b])]
    m.held_elsewhere.append(lambda: (held[0], held[0]))  # the holder's account, which the invariants check
    m.hold(held[0])
    assert m.table.busy[b] == 1 and m.table.readers[b] == 1
    m.check_invariants()
    m.held_elsewhere[-1] = lambda: (held[0], np.zeros(0, np.int64))  # a holder that says it only moves
    with pytest.raises(RuntimeError, match="read holds"):
        m.check_invariants()
    m.held_elsewhere[-1] = lambda: (held[0], held[0])
    before = snapshot(m)
    for drops in (lambda: m.demote([b], "dram", "nvme"), lambda: m.drop(b),
                  lambda: m.drop_copy(b, "dram")):
        with pytest.raises(ValueError):
            drops()
        assert_same(before, snapshot(m))
    assert m.promote([b], Tier.HBM) > 0  # keeps the source: allowed
    assert m.table.busy[b] == 2 and m.table.readers[b] == 1
    m.check_invariants()
    m.wait()
    assert m.table.copies[b] == 0b011 and m.table.busy[b] == 1
    slot = m.pin(b)
    assert m.hbm.host_view(slot)[:BB].tobytes() == pattern(21, BB).tobytes()
    m.unpin(b)
    before = snapshot(m)
    with pytest.raises(ValueError, match="being read"):
        m.demote([b], "hbm", "dram")  # would drop the HBM copy: refused while held
    assert_same(before, snapshot(m))
    m.unhold(held[0])
    held[0] = np.zeros(0, np.int64)
    assert m.table.busy[b] == 0 and m.table.readers[b] == 0
    assert m.demote([b], "hbm", "dram") == 0 and m.table.copies[b] == 0b010  # now it may go
    with pytest.raises(ValueError):
        m.unhold(np.array([b]))  # not held
    o = int(m.alloc(1)[0])
    with pytest.raises(ValueError, match="sealed"):
        m.hold(np.array([o]))  # an open block's bytes still change: never read by a remote write
    m.check_invariants()

