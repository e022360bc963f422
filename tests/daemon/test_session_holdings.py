"""An engine's references and sequences, held as packed counts and int32 arrays, behave
exactly as the Counter of references and lists of block ids they replaced: a reference
model of the old bookkeeping is driven beside the daemon through random allocs, lookups,
folding seals and frees (by id, by sequence, both, a sequence named twice), and the two
agree after every step, as does the table's reference count."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvtier.protocol import wire as P

from .service_calls import call, hbm_only_service, ids


class OldBookkeeping:
    """The per-engine state as it was kept before (a Counter and lists), op by op."""

    def __init__(self) -> None:
        self.refs: Counter = Counter()
        self.seqs: dict[int, list[int]] = {}

    def add(self, blocks: list[int], seq: "int | None") -> None:
        self.refs.update(blocks)
        if seq is not None:
            self.seqs.setdefault(seq, []).extend(blocks)

    def fold(self, old: int, new: int) -> None:
        self.refs[old] -= 1
        if not self.refs[old]:
            del self.refs[old]
        self.refs[new] += 1
        for lst in self.seqs.values():
            lst[:] = [new if b == old else b for b in lst]

    def free(self, named: list[int], seqs: list[int]) -> "str | None":
        if any(s not in self.seqs for s in seqs):
            return "unknown sequence"
        blocks = sorted(set(named) | {b for s in seqs for b in self.seqs[s]})
        drops: Counter = Counter()
        for s in dict.fromkeys(seqs):
            drops.update(self.seqs[s])
        for b in blocks:
            drops[b] = max(1, min(drops[b], self.refs.get(b, 0)))
        if any(self.refs.get(b, 0) < n for b, n in drops.items()):
            return "held"
        for b, n in drops.items():
            self.refs[b] -= n
            if not self.refs[b]:
                del self.refs[b]
        for s in seqs:
            self.seqs.pop(s, None)
        gone = set(blocks)
        for s, lst in list(self.seqs.items()):
            keep = [b for b in lst if b not in gone or self.refs.get(b, 0) > 0]
            if keep:
                self.seqs[s] = keep
            else:
                del self.seqs[s]
        return None


def _keys(ks: list[int]) -> bytes:
    return P.id_bytes(np.asarray(ks, dtype=np.uint64), np.uint64)


@pytest.mark.parametrize("seed, by_id", [(0, True), (1, True), (2, True), (3, False), (4, False)])
def test_random_holdings_match_the_old_bookkeeping(tmp_path, seed, by_id):
    """``by_id`` False: frees name sequences only, so the engine's sequences never list a
    block more often than it references it and no free scans them (``loose`` stays unset)."""
    rng = np.random.default_rng(seed)
    svc = hbm_only_service(tmp_path, 256, 'policy.name="lru"')
    try:
        call(svc, "register", "e", pid=0, block_bytes=4096)
        model, sealed_keys, fresh = OldBookkeeping(), [], iter(range(1, 10**6))
        open_blocks: set[int] = set()
        seen = Counter()  # what the run went through: folds, refused frees, counts past a nibble
        t = svc.node.mgr.table
        for step in range(700):
            op = rng.choice(["alloc", "ref", "seal", "free_ids", "free_seqs", "free_both"], p=[.25, .2, .2, .15, .1, .1]
                            if by_id else [.25, .2, .2, 0, .35, 0])
            seq = int(rng.integers(6)) if rng.random() < 0.8 else None
            err = None
            try:
                if op == "alloc":
                    args = {"n": int(rng.integers(1, 4))} | ({"seq": seq} if seq is not None else {})
                    got = ids(call(svc, "alloc", "e", **args)["blocks"])
                    model.add(got, seq)
                    open_blocks.update(got)
                elif op == "ref" and sealed_keys:
                    pool = sealed_keys[:2] if rng.random() < 0.6 else sealed_keys  # a few hot prefix keys
                    ks = rng.choice(pool, size=int(rng.integers(1, 4))).tolist()  # a key twice at times
                    args = {"keys": _keys(ks)} | ({"seq": seq} if seq is not None else {})
                    got = ids(call(svc, "ref", "e", **args)["blocks"])
                    model.add([b for b in got if b >= 0], seq)
                elif op == "seal" and open_blocks:
                    bs = rng.choice(sorted(open_blocks), size=min(len(open_blocks), int(rng.integers(1, 4))),
                                    replace=False).tolist()
                    ks = [int(rng.choice(sealed_keys)) if sealed_keys and rng.random() < 0.4 else next(fresh)
                          for _ in bs]
                    args = {"seq": seq} if seq is not None else {}  # its own sequence, another or none
                    cs = ids(call(svc, "seal", "e", blocks=bs, keys=_keys(ks), **args)["blocks"])
                    open_blocks.difference_update(bs)
                    sealed_keys += ks
                    for b, c in zip(bs, cs):
                        if c != b:
                            model.fold(b, c)
                            seen["folds"] += 1
                elif op.startswith("free"):
                    named = rng.choice(sorted(model.refs), size=int(rng.integers(1, 3))).tolist() \
                        if op != "free_seqs" and model.refs else []
                    names = [int(s) for s in rng.integers(6, size=int(rng.integers(1, 3)))] if op != "free_ids" else []
                    if not named and not names:
                        continue
                    expect = model.free(named, names) if names or named else None
                    try:
                        call(svc, "free", "e", **({"blocks": sorted(set(named))} if named else {}),
                             **({"seqs": names} if names else {}))
                    except P.ProtocolError as e:
                        err = e
                    assert (err is None) == (expect is None), (op, named, names, expect, err)
                    seen["refused frees"] += err is not None
                    open_blocks = {b for b in open_blocks if model.refs.get(b, 0) > 0}
            except P.ProtocolError as e:  # NO_SPACE and the like: nothing changed on either side
                assert op in ("alloc", "ref"), e.message
            sess = svc.engines["e"]
            assert dict(sess.refs.items()) == dict(model.refs), (step, op)
            assert {s: list(a) for s, a in sess.seqs.items()} == model.seqs, (step, op)
            assert sess.refs.held == len(model.refs) and sess.refs.sum() == sum(model.refs.values())
            live = np.asarray(sorted(model.refs), dtype=np.int64)
            assert t.refcount[live].tolist() == [model.refs[b] for b in live.tolist()]
            assert int(t.refcount.sum()) == sum(model.refs.values())
            seen["past the nibble"] += max(model.refs.values(), default=0) >= 15
            assert by_id or not sess.loose
        assert call(svc, "check", "e")["ok"]
        assert seen["folds"] and seen["refused frees"] and seen["past the nibble"], seen
        assert svc.reclaim("e", "unregistered") == len(model.refs)
        assert int(t.refcount.sum()) == 0
    finally:
        svc.close()


def test_a_free_that_fails_midway_leaves_the_engines_references_equal_to_the_tables(tmp_path):
    """The table's free of a block a sequence lists three times fails on its second drop
    (injected): the engine's count follows the table's, reference for reference, so the
    engine's teardown frees exactly what is left and the invariants hold."""
    svc = hbm_only_service(tmp_path, 16, 'policy.name="lru"')
    try:
        call(svc, "register", "e", pid=0, block_bytes=4096)
        b = int(ids(call(svc, "alloc", "e", n=1, seq=1)["blocks"])[0])
        call(svc, "seal", "e", blocks=[b], keys=_keys([77]), seq=1)
        call(svc, "ref", "e", keys=_keys([77, 77]), seq=1)  # sequence 1 lists b three times
        mgr, t = svc.node.mgr, svc.node.mgr.table
        real, calls = mgr.free, [0]

        def flaky(blk: int, allow_pinned: bool = False) -> None:
            calls[0] += 1
            if calls[0] == 2:
                raise ValueError("injected failure")
            real(blk, allow_pinned=allow_pinned)

        mgr.free = flaky
        with pytest.raises(P.ProtocolError):
            call(svc, "free", "e", seqs=[1])
        mgr.free = real
        assert int(t.refcount[b]) == svc.engines["e"].refs[b] == 2
        assert call(svc, "unregister", "e") == {"reclaimed": 1}
        assert int(t.refcount[b]) == 0
    finally:
        svc.close()
