"""Telemetry read after the block it names was freed and its id taken by another: a report
travels on its own socket, so it can arrive after the engine's ``free`` (or a folding
``seal``, or another engine's, or an eviction) let the id go and an alloc took it again.
Each report is stamped with its session's tag and the daemon's count of frees in the last
reply the engine had; the daemon skips the ids freed since. Blocks let go of but still
cached are the same blocks: their reports still count."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.protocol import wire as P

from .service_calls import call, hbm_only_service, ids
from .test_server import wait_for

BB = 4096
KEY = np.array([7], "<u8").tobytes()


@pytest.fixture
def svc(tmp_path):
    s = hbm_only_service(tmp_path, 8, block_bytes=BB)
    s.tag = call(s, "register", "e", pid=0, block_bytes=BB)["session_tag"]
    yield s
    s.close()


def _report(svc, blocks, at, kind="attention", engine="e"):
    msg = {"v": P.VERSION, "engine": engine, "kind": kind, "blocks": P.id_bytes(np.array(blocks))}
    msg |= {"mass": np.ones(len(blocks), "<f4").tobytes()} if kind == "attention" else {"tag": "system"}
    return svc.ingest(msg if at is None else {**msg, "at": at})


def _recycled(svc):
    """Every id allocated, four freed and allocated again (the same ids); the stamp of a report
    built before the free."""
    held = ids(call(svc, "alloc", "e", n=8, seq=1)["blocks"])
    before = [svc.tag, svc.frees()]
    call(svc, "free", "e", blocks=held[:4])
    new = ids(call(svc, "alloc", "e", n=4, seq=2)["blocks"])
    assert sorted(new) == sorted(held[:4])  # the test needs the recycling it guards against
    return new, before


def test_a_report_built_before_a_free_does_not_credit_the_recycled_ids(svc):
    new, before = _recycled(svc)
    imp = svc.node.mgr.table.importance
    assert _report(svc, new, before) == 0 and svc.counters["telemetry_skipped"] == 4
    assert np.all(imp[new] == 0.5) and np.all(svc.node.scores.reports[new] == 0)  # neutral, unreported
    assert _report(svc, new, [svc.tag, svc.frees()]) == 4  # built after the new alloc: the new blocks' own
    assert np.all(svc.node.scores.reports[new] == 1)


def test_an_unstamped_report_is_applied_as_before(svc):
    """The control: a client that does not stamp gets the old behaviour, so the test above
    can fail (the recycled ids are credited)."""
    new, _ = _recycled(svc)
    assert _report(svc, new, None) == 4 and np.all(svc.node.scores.reports[new] == 1)


def test_only_the_ids_freed_since_the_stamp_are_skipped(svc):
    a = ids(call(svc, "alloc", "e", n=4, seq=1)["blocks"])
    before = [svc.tag, svc.frees()]
    call(svc, "free", "e", blocks=a[:2])
    assert _report(svc, a[2:] + a[:2], before) == 2  # the two still held count, the freed not
    assert np.all(svc.node.scores.ema_value[a[2:]] > 0.0)


def test_blocks_let_go_of_but_still_cached_keep_their_reports(svc):
    """vLLM's worker seals, releases, reports and frees at once: the free is often read first,
    and the sealed blocks stay cached, the same blocks: the reports count."""
    a = ids(call(svc, "alloc", "e", n=1, seq=1)["blocks"])
    call(svc, "seal", "e", blocks=P.id_bytes(np.array(a)), keys=KEY)
    before = [svc.tag, svc.frees()]
    call(svc, "free", "e", blocks=a)
    assert _report(svc, a, before, kind="segment") == 1


def test_a_fold_at_seal_skips_the_folded_id(svc):
    first = ids(call(svc, "alloc", "e", n=1, seq=1)["blocks"])
    call(svc, "seal", "e", blocks=P.id_bytes(np.array(first)), keys=KEY)
    dup = ids(call(svc, "alloc", "e", n=1, seq=2)["blocks"])
    call(svc, "alloc", "e", n=6, seq=3)  # every other id taken: the next alloc gets the folded one
    before = [svc.tag, svc.frees()]
    assert ids(call(svc, "seal", "e", blocks=P.id_bytes(np.array(dup)), keys=KEY)["blocks"]) == first
    again = ids(call(svc, "alloc", "e", n=1, seq=4)["blocks"])
    assert again == dup
    assert _report(svc, again, before) == 0
    assert _report(svc, again, [svc.tag, svc.frees()]) == 1


def test_an_id_another_engine_got_after_an_eviction_is_skipped(svc):
    """A scheduler reports on blocks it only looked up (it holds no reference): the block is
    dropped from the cache and its id goes to the worker's next alloc."""
    call(svc, "register", "s", pid=0, block_bytes=BB, refs_only=True)
    s_tag = svc.engines["s"].tag
    a = ids(call(svc, "alloc", "e", n=1, seq=1)["blocks"])
    call(svc, "seal", "e", blocks=P.id_bytes(np.array(a)), keys=KEY)
    call(svc, "free", "e", blocks=a)  # cached, held by no one
    call(svc, "alloc", "e", n=7, seq=2)  # every other id taken
    assert ids(call(svc, "lookup", "s", keys=KEY)["blocks"]) == a
    before = [s_tag, svc.frees()]
    assert call(svc, "clear", "e")["dropped"] == 1
    assert ids(call(svc, "alloc", "e", n=1, seq=3)["blocks"]) == a  # the worker's open block now
    assert _report(svc, a, before, kind="segment", engine="s") == 0
    assert svc.node.scores.segment[a[0]] == 0  # no tag
    assert _report(svc, a, [s_tag, svc.frees()], kind="segment", engine="s") == 1  # a report of now counts
    assert svc.node.scores.segment[a[0]] != 0


def test_a_report_of_another_session_or_from_a_count_not_reached_is_dropped(svc):
    new, _ = _recycled(svc)
    assert _report(svc, new, [svc.tag ^ 1, svc.frees()]) == 0
    assert _report(svc, new, [svc.tag, svc.frees() + 1]) == 0
    assert svc.counters["telemetry_stale"] == 2 and np.all(svc.node.mgr.table.importance[new] == 0.5)


@pytest.mark.parametrize("at", [[1], "x", [1, "2"], [True, 2], [1, 2, 3], {"a": 1}, [1, -1]])
def test_a_malformed_stamp_is_rejected_and_changes_nothing(svc, at):
    blocks = ids(call(svc, "alloc", "e", n=2, seq=1)["blocks"])
    assert _report(svc, blocks, at) == 0 and svc.counters["telemetry_rejected"] == 1
    assert np.all(svc.node.mgr.table.importance[blocks] == 0.5)


def test_the_free_count_tells_a_block_freed_since_across_the_wrap():
    """``generation`` holds the count mod 2^32: a stamp just before the wrap still finds the
    blocks freed after it, and not those freed before."""
    from kvtier.tiers.block_table import BlockTable

    t = BlockTable(4, (4, 0, 0))
    t.releases = (1 << 32) - 2
    old = t.new_block()
    t.release_block(old)  # count 2^32 - 1
    g = t.releases
    a, b = t.new_block(), t.new_block()
    t.release_block(a)  # 2^32: generation 0
    t.release_block(b)  # 2^32 + 1: generation 1
    assert t.freed_since(np.array([old, a, b]), g).tolist() == [False, True, True]
    assert t.freed_since(np.array([old, a, b]), g + 1).tolist() == [False, False, True]


# -- a real daemon process and its clients -----------------------------------------------
def test_a_late_report_does_not_credit_an_id_the_engine_got_back(daemon):
    """A report built before a free and read after the id came back to the same engine (its
    telemetry and requests travel on separate sockets) skips that id: the client stamps each
    report with its session and the daemon's count of frees in the last reply it had."""
    with daemon.client(heartbeat_s=None) as c:
        c.register(block_bytes=4096)
        first, _ = c.alloc(4, seq=1)
        built_before_the_free = c.telemetry.freed
        c.free(first)
        for seq in range(2, 400):  # until the daemon hands one of those ids out again
            again, _ = c.alloc(4, seq=seq)
            if set(again.tolist()) & set(first.tolist()):
                break
            c.free(again)
        else:
            pytest.fail("no id came back")
        fresh, _ = c.alloc(10, seq=1000)
        now, c.telemetry.freed = c.telemetry.freed, built_before_the_free
        c.report_attention(first, np.ones(4))  # late: at most 4 updates, if any were applied
        c.telemetry.freed = now
        c.report_attention(fresh, np.ones(10))  # after it on the same socket: 10 updates
        wait_for(lambda: c.stats()["service"].get("telemetry_block_updates", 0) >= 10)
        assert c.stats()["service"]["telemetry_block_updates"] == 10


def test_only_the_engine_s_own_replies_move_its_telemetry_stamp(daemon):
    """A heartbeat's reply (another thread, another socket) names no ids: its count could
    postdate the free of an id the engine looked up and is about to report on."""
    with daemon.client(engine_id="a", heartbeat_s=None) as a, daemon.client(engine_id="b", heartbeat_s=None) as b:
        a.register(block_bytes=4096)
        b.register(block_bytes=4096)
        before = b.telemetry.freed
        blocks, _ = a.alloc(4, seq=1)
        a.free(blocks)  # four frees
        assert a.telemetry.freed == before + 4
        sock = b._dealer()
        try:
            b._call("heartbeat", sock=sock)
        finally:
            sock.close(0)
        assert b.telemetry.freed == before
        b.ping()
        assert b.telemetry.freed == before + 4
