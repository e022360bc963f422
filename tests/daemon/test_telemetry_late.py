"""Telemetry read after the request that let its blocks go: a report travels on its own
socket, so it can arrive after a ``free`` (or a folding ``seal``) the engine sent after
building it, when the id may name another block, the engine's own next alloc included.
Each report names its session and the last request sent before it; the daemon skips ids
that later requests dropped, and a report older than its log covers is dropped whole."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P

from .service_calls import Clock, call, ids

BB = 4096


@pytest.fixture
def svc(tmp_path):
    cfg = load_config(environ={}, overrides=[
        f"tiers.hbm_bytes={8 * BB}", "tiers.dram_bytes=0", "tiers.nvme_bytes=0",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    s = Service(cfg, clock=Clock())
    s.tag = call(s, "register", "e", rid=1, pid=0, block_bytes=BB)["session_tag"]
    yield s
    s.close()


def _report(svc, blocks, at, mass=None):
    mass = np.full(len(blocks), 1.0) if mass is None else mass
    msg = {"v": P.VERSION, "engine": "e", "kind": "attention", "blocks": P.id_bytes(np.array(blocks)),
           "mass": np.asarray(mass, "<f4").tobytes()}
    return svc.ingest(msg if at is None else {**msg, "at": at})


def _recycled(svc):
    """Every id allocated (request 2), four freed (4) and allocated again (5): the same ids."""
    held = ids(call(svc, "alloc", "e", rid=2, n=8, seq=1)["blocks"])
    call(svc, "free", "e", rid=4, blocks=held[:4])
    new = ids(call(svc, "alloc", "e", rid=5, n=4, seq=2)["blocks"])
    assert sorted(new) == sorted(held[:4])  # the test needs the recycling it guards against
    return new


def test_a_report_built_before_a_free_does_not_credit_the_recycled_ids(svc):
    new = _recycled(svc)
    imp = svc.node.mgr.table.importance
    assert _report(svc, new, [svc.tag, 2]) == 0  # built after the alloc, before the free
    assert np.all(imp[new] == 0.0) and np.all(svc.node.scores.ema_value[new] == 0.0)
    assert _report(svc, new, [svc.tag, 5]) == 4  # built after the new alloc: the new blocks' own
    assert np.all(imp[new] > 0.0)


def test_an_unstamped_report_is_applied_as_before(svc):
    """The control: a client that does not stamp gets the old behaviour, so the test above
    can fail (the recycled ids are credited)."""
    new = _recycled(svc)
    assert _report(svc, new, None) == 4 and np.all(svc.node.mgr.table.importance[new] > 0.0)


def test_only_the_ids_dropped_after_the_stamp_are_skipped(svc):
    a = ids(call(svc, "alloc", "e", rid=2, n=4, seq=1)["blocks"])
    call(svc, "free", "e", rid=4, blocks=a[:2])
    assert _report(svc, a[2:] + a[:2], [svc.tag, 3]) == 2  # the two still held count, the freed not
    assert np.all(svc.node.scores.ema_value[a[2:]] > 0.0)


def test_a_report_of_another_session_is_dropped(svc):
    new = _recycled(svc)
    before = svc.counters["telemetry_stale"]
    assert _report(svc, new, [svc.tag ^ 1, 5]) == 0
    assert svc.counters["telemetry_stale"] == before + 1 and np.all(svc.node.mgr.table.importance[new] == 0.0)


def test_a_report_older_than_the_log_is_dropped_whole(svc):
    new = _recycled(svc)
    svc.clock.t += 60.0  # past the log's keep time: the next request that drops ids trims it
    call(svc, "free", "e", rid=7, blocks=new[:1])
    assert _report(svc, new[1:], [svc.tag, 3]) == 0 and svc.counters["telemetry_stale"] == 1
    assert _report(svc, new[1:], [svc.tag, 7]) == 3


def test_a_fold_at_seal_skips_the_folded_id(svc):
    first = ids(call(svc, "alloc", "e", rid=2, n=1, seq=1)["blocks"])
    call(svc, "seal", "e", rid=3, blocks=P.id_bytes(np.array(first)), keys=np.array([7], "<u8").tobytes())
    dup = ids(call(svc, "alloc", "e", rid=4, n=1, seq=2)["blocks"])
    call(svc, "alloc", "e", rid=5, n=6, seq=3)  # every other id taken: the next alloc gets the folded one
    out = ids(call(svc, "seal", "e", rid=6, blocks=P.id_bytes(np.array(dup)), keys=np.array([7], "<u8").tobytes())["blocks"])
    assert out == first  # folded: ``dup`` is free again
    again = ids(call(svc, "alloc", "e", rid=7, n=1, seq=4)["blocks"])
    assert again == dup
    assert _report(svc, again, [svc.tag, 5]) == 0
    assert _report(svc, again, [svc.tag, 7]) == 1


@pytest.mark.parametrize("at", [[1], "x", [1, "2"], [True, 2]])
def test_a_malformed_stamp_is_rejected_and_changes_nothing(svc, at):
    blocks = ids(call(svc, "alloc", "e", rid=2, n=2, seq=1)["blocks"])
    assert _report(svc, blocks, at) == 0 and svc.counters["telemetry_rejected"] == 1
    assert np.all(svc.node.mgr.table.importance[blocks] == 0.0)
