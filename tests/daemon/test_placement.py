"""The daemon's placement over a real TierManager (in process): exact victims and accounting."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.daemon.config import load_config
from kvtier.daemon.service import Service
from kvtier.protocol import wire as P

from .service_calls import call as call_now
from .service_calls import ids


@pytest.fixture
def svc(tmp_path):
    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=0", 'policy.name="lru"',
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false", "tiers.high_watermark=1.0",
        "tiers.low_watermark=1.0"])
    s = Service(cfg)
    yield s
    s.close()


def call(svc, op, engine="e", **args):
    out = call_now(svc, op, engine, **args)
    svc.background()
    svc.node.mgr.wait(timeout=10)
    svc.background()
    return out


def test_lru_victim_is_demoted_first(svc):
    call(svc, "register", pid=0, block_bytes=4096)
    blocks = ids(call(svc, "alloc", n=4, seq=1)["blocks"])  # HBM holds exactly 4
    call(svc, "seal", blocks=P.id_bytes(blocks), keys=P.id_bytes([11, 12, 13, 14], np.uint64))
    for b in (blocks[2], blocks[0], blocks[3], blocks[1]):  # access order: block 2 is now least recent
        call(svc, "acquire", blocks=P.id_bytes([b]))
        call(svc, "release", blocks=P.id_bytes([b]))
        svc.node.placement.drain(1000)
        svc.node.placement.logged_epoch[:] = -1  # count every access in this test
    with pytest.raises(P.ProtocolError) as e:  # the demotion it started is a transfer: retry after it lands
        call(svc, "alloc", n=1, seq=2)
    assert e.value.code == P.NO_SPACE
    svc.node.mgr.wait(timeout=10)
    svc.background()
    more = ids(call(svc, "alloc", n=1, seq=2)["blocks"])
    t = svc.node.mgr.table
    assert t.copies[blocks[2]] == 0b010  # demoted to DRAM
    assert all(t.copies[b] & 1 for b in (blocks[0], blocks[1], blocks[3], more[0]))
    c = call(svc, "check")
    assert c == {"ok": True}


def test_pinned_blocks_are_never_victims(svc):
    call(svc, "register", pid=0, block_bytes=4096)
    blocks = ids(call(svc, "alloc", n=4, seq=1)["blocks"])
    call(svc, "acquire", blocks=P.id_bytes(blocks))
    with pytest.raises(P.ProtocolError) as e:
        call(svc, "alloc", n=1, seq=2)
    assert e.value.code == P.NO_SPACE
    assert all(svc.node.mgr.table.copies[b] == 1 for b in blocks)


def test_failed_ops_change_nothing(svc):
    call(svc, "register", pid=0, block_bytes=4096)
    blocks = ids(call(svc, "alloc", n=2, seq=1)["blocks"])
    snap = (svc.node.mgr.table.refcount.copy(), svc.node.mgr.table.pins.copy(), svc.node.mgr.table.state.copy())
    bad = [("free", dict(blocks=P.id_bytes([blocks[0], 99]))), ("release", dict(blocks=P.id_bytes(blocks))),
           ("seal", dict(blocks=P.id_bytes(blocks), keys=P.id_bytes([1], np.uint64))),
           ("acquire", dict(keys=P.id_bytes([12345], np.uint64))), ("free", dict(seqs=[77]))]
    for op, args in bad:
        with pytest.raises(P.ProtocolError):
            call(svc, op, **args)
        after = (svc.node.mgr.table.refcount, svc.node.mgr.table.pins, svc.node.mgr.table.state)
        assert all(np.array_equal(x, y) for x, y in zip(snap, after)), op


def test_idle_hbm_is_filled_from_dram_by_value(tmp_path):
    now = [100.0]
    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=32768", "tiers.dram_bytes=32768", "tiers.nvme_bytes=0", "policy.speculate=true",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg, clock=lambda: now[0])
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        blocks = ids(call(svc, "alloc", n=8, seq=1, pin=True)["blocks"])  # HBM (8 slots) full
        call(svc, "seal", blocks=P.id_bytes(blocks), keys=P.id_bytes(list(range(1, 9)), np.uint64))
        call(svc, "release", blocks=P.id_bytes(blocks))
        svc.node.mgr.demote(blocks[:6], "hbm", "dram")
        svc.node.mgr.wait(timeout=10)
        svc.background()
        t = svc.node.mgr.table
        assert t.used_slot_count(0) == 2
        svc.maintain()  # first call only starts the bandwidth clock
        now[0] += 1.0
        svc.maintain()
        svc.node.mgr.wait(timeout=10)
        svc.background()
        assert svc.node.prefetcher.speculated == 5  # up to the high watermark: int(0.95 * 8) - 2
        assert t.used_slot_count(0) == 7 and all(t.copies[b] & 0b10 for b in blocks[:6])
        pf = svc.node.prefetcher
        spec = [b for b in blocks[:6] if t.copies[b] & 1]
        assert len(spec) == 5 and pf.speculative_used == pf.speculative_wasted == 0
        call(svc, "acquire", blocks=P.id_bytes(spec[:2]))  # read while in HBM: worth the copy
        call(svc, "release", blocks=P.id_bytes(spec[:2]))
        call(svc, "acquire", blocks=P.id_bytes(spec[:1]))  # counted once
        call(svc, "release", blocks=P.id_bytes(spec[:1]))
        svc.node.mgr.drop_copy(spec[2], "hbm")  # left HBM unread: a copy for nothing
        assert (pf.speculative_used, pf.speculative_wasted) == (2, 1)
        stats = call(svc, "stats")["prefetch"]
        assert (stats["speculated"], stats["speculative_used"], stats["speculative_wasted"]) == (5, 2, 1)
        call(svc, "hint", blocks=P.id_bytes(blocks[:1]), deadline_s=1.0)
        now[0] += 1.0
        before = svc.node.prefetcher.speculated
        svc.maintain()  # something is hinted: no speculation while hints wait
        assert svc.node.prefetcher.speculated == before
        assert call(svc, "check") == {"ok": True}
    finally:
        svc.close()


def test_write_back_sends_blocks_dram_declines_to_nvme(tmp_path):
    """DRAM admits an HBM victim only if its policy finds it worth a slot: a block of
    a class DRAM has learned is never reused goes straight to NVMe, and the DRAM
    blocks worth their slots stay."""
    from kvtier.predictor.cells import N_IRR
    from kvtier.predictor.classes import N_STAGES

    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=65536",
        f'tiers.nvme_dir="{tmp_path}/nvme"', "policy.samples=2",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg)
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        blocks = ids(call(svc, "alloc", n=4, seq=1, pin=True)["blocks"])
        call(svc, "seal", blocks=P.id_bytes(blocks), keys=P.id_bytes(list(range(1, 5)), np.uint64))
        call(svc, "release", blocks=P.id_bytes(blocks))
        call(svc, "free", blocks=P.id_bytes(blocks))  # cached now: free to skip DRAM
        pl, t = svc.node.placement, svc.node.mgr.table
        dram = pl.policies[1]
        model = dram.model
        model.reuses[0, 6] = 500.0  # class 0 (first access of feature class 0) is read again soon...
        model.accesses[0] = 600.0
        model.accesses[1 * N_STAGES * N_IRR] = 600.0  # ...feature class 1 never is
        model.refresh()
        pl.feature_class[blocks[:2]] = 0
        pl.feature_class[blocks[2:]] = 1
        started, stuck = pl._write_back(0, blocks[:2])  # worth DRAM: admitted
        svc.node.mgr.wait(timeout=10)
        assert started == 2 and not stuck and all(t.has_copy(b, 1) for b in blocks[:2])
        started, stuck = pl._write_back(0, blocks[2:])
        svc.node.mgr.wait(timeout=10)
        assert started == 2 and not stuck and pl.declined == 2
        assert all(t.has_copy(b, 2) and not t.has_copy(b, 1) for b in blocks[2:])  # straight to NVMe
        assert all(t.has_copy(b, 1) for b in blocks[:2])  # nothing worth its slot was pushed out
        svc.node.mgr.wait(timeout=10)
        svc.background()
        assert call(svc, "check") == {"ok": True}
    finally:
        svc.close()


@pytest.mark.parametrize("policy", ["kvtier", "lru", "s3fifo"])
def test_make_room_over_a_pinned_hbm_changes_no_policy_state(tmp_path, policy):
    """Victim search skips pinned blocks without evicting and re-inserting them: no
    phantom evictions, no extra accesses, every policy array byte-identical."""
    from ..policy.test_contract import _arrays, _scalars

    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=0", f'policy.name="{policy}"',
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg)
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        blocks = ids(call(svc, "alloc", n=4, seq=1, pin=True)["blocks"])  # HBM full, all pinned
        pl = svc.node.placement
        pol = pl.policies[0]
        before, scalars = _arrays(pol), _scalars(pol)
        for _ in range(3):
            assert pl.make_room(0, 2, urgent=True) == 0
        assert _arrays(pol) == before and _scalars(pol) == scalars
        assert pl.tracked[0, blocks].all() and pl.demoted == pl.dropped == 0
        call(svc, "release", blocks=P.id_bytes(blocks))
        assert pl.make_room(0, 1) == 1  # unpinned: the policy's victim really goes
        assert pol.size == 3
    finally:
        svc.close()


def test_a_freed_block_id_comes_back_fresh(tmp_path):
    """Importance, policy weight and history of a freed block do not pass to the next
    block that gets its id."""
    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=0",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg)  # the default policy: importance-weighted, with a predictor
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        node = svc.node
        blocks = ids(call(svc, "alloc", n=2, seq=1)["blocks"])
        b = blocks[1]  # a tenth of the attention: weight below 1
        node.scores.report(np.array(blocks), np.array([0.9, 0.1], dtype=np.float32))
        node.set_importance(np.array(blocks))
        pol = node.placement.policies[0]
        assert node.scores.reports[b] == 1 and pol.weight[b] != 1.0 and pol.model.count[b] == 1
        call(svc, "free", blocks=P.id_bytes(blocks))  # open blocks: gone at once
        assert node.mgr.table.state[b] == 0  # FREE: the id may be handed out again
        assert node.scores.reports[b] == 0 and node.scores.ema_value[b] == 0
        assert node.placement.feature_class[b] == 0 and not node.placement.tracked[:, b].any()
        assert pol.weight[b] == 1.0 and pol.model.count[b] == 0 and pol.model.last[b] == 0
        assert pol.calib is not None and np.isnan(pol.calib.pred[b])
    finally:
        svc.close()


def test_importance_decides_which_block_is_demoted(tmp_path):
    """Four idle blocks of one class and age: without importance the first would go;
    the one the engine's attention ignores goes instead."""
    cfg = load_config(environ={}, overrides=[
        "tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=0",
        f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"])
    svc = Service(cfg)
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        blocks = ids(call(svc, "alloc", n=4, seq=1, pin=True)["blocks"])
        call(svc, "seal", blocks=P.id_bytes(blocks), keys=P.id_bytes([1, 2, 3, 4], np.uint64))
        call(svc, "release", blocks=P.id_bytes(blocks))
        pl, node = svc.node.placement, svc.node
        assert pl._victims(0, 1) == [blocks[0]]  # equal value: the first resident
        node.scores.report(np.array(blocks), np.array([0.4, 0.3, 0.01, 0.29], dtype=np.float32))
        node.set_importance(np.array(blocks))
        assert pl._victims(0, 1) == [blocks[2]]
        assert pl.make_room(0, 1) == 1
        svc.node.mgr.wait(timeout=10)
        t = svc.node.mgr.table
        assert t.copies[blocks[2]] == 0b10 and all(t.copies[b] & 1 for b in (blocks[0], blocks[1], blocks[3]))
    finally:
        svc.close()


def test_class_telemetry_sets_the_class_of_sealed_blocks_only(svc):
    """An engine that does not alloc by sequence reports a request's features: its sealed
    blocks take the class, open ones keep theirs, bad features change nothing."""
    from collections import Counter

    from kvtier.daemon.telemetry import ingest
    from kvtier.predictor.classes import block_class

    call(svc, "register", pid=0, block_bytes=4096)
    blocks = ids(call(svc, "alloc", n=3, seq=1)["blocks"])
    call(svc, "seal", blocks=P.id_bytes(blocks[:2]), keys=P.id_bytes([11, 12], np.uint64))
    fc = svc.node.placement.feature_class
    before = fc[blocks].copy()
    counters: Counter = Counter()
    bad = {"v": P.VERSION, "engine": "e", "kind": "class", "blocks": P.id_bytes(blocks), "cont": 1, "span": 7}
    ingest(svc.node, counters, bad, svc.engines["e"])  # cont must be a bool
    assert fc[blocks].tolist() == before.tolist() and counters["telemetry_rejected"] == 1
    ingest(svc.node, counters, {**bad, "cont": True}, svc.engines["e"])
    assert fc[blocks[:2]].tolist() == [block_class(False, True, 7)] * 2
    assert fc[blocks[2]] == before[2]  # still open: its class is the engine's at alloc


def test_a_reloaded_predictor_section_reaches_the_policies(tmp_path):
    """``[predictor]`` is a hot section: a reload that changes it is applied, not only reported."""
    base = ["tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=0",
            f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"]
    svc = Service(load_config(environ={}, overrides=base))
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        pols = [p for p in svc.node.placement.policies.values() if hasattr(p, "set_calibration")]
        assert pols and all(p.calib.recal is not None and p.calibration_sample == 8 for p in pols)
        kept = [p.calib for p in pols]
        svc.apply_hot(load_config(environ={}, overrides=base + ["predictor.calibration_sample=2"]), ["predictor"])
        assert [p.calib for p in pols] == kept and all(p.calibration_sample == 2 for p in pols)
        svc.apply_hot(load_config(environ={}, overrides=base + ["predictor.recalibrate=false"]), ["predictor"])
        assert all(p.calib is not None and p.calib.recal is None and p.calibration_sample == 8 for p in pols)
        svc.apply_hot(load_config(environ={}, overrides=base + ["predictor.track_calibration=false"]), ["predictor"])
        assert all(p.calib is None for p in pols)
        call(svc, "alloc", n=2, seq=1)  # and the policies still serve
    finally:
        svc.close()


def test_reloaded_policy_parameters_reach_the_running_model(tmp_path):
    """Each hot [policy] key a reload reports as applied is in effect: the dedup window, the
    victim sample, admission and its evidence floor, and the model's shrinkage and memory."""
    base = ["tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=0",
            f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"]
    svc = Service(load_config(environ={}, overrides=base))
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        new = load_config(environ={}, overrides=base + [
            "policy.epoch_s=0.25", "policy.samples=4", "policy.admission=false", "policy.prior_strength=5.0",
            "policy.memory_horizons=8.0", "policy.evidence_floor=0.2"])
        svc.apply_hot(new, ["policy"])
        pl = svc.node.placement
        assert pl.epoch_s == 0.25
        pols = [p for p in pl.policies.values() if hasattr(p, "model")]
        assert pols and all(p.samples == 4 and p.admission is False and p.model.m == 5.0
                            and p.model.memory_horizons == 8.0 and p.evidence_floor == 0.2 for p in pols)
        call(svc, "alloc", n=2, seq=1)
    finally:
        svc.close()


def test_a_reload_that_fails_halfway_puts_back_what_it_applied(tmp_path, monkeypatch):
    """A reload is all or nothing: the daemon says it keeps its running config, so a section
    that fails must not leave the sections before it applied."""
    base = ["tiers.hbm_bytes=16384", "tiers.dram_bytes=16384", "tiers.nvme_bytes=0",
            f'server.runtime_dir="{tmp_path}/run"', "metrics.enabled=false"]
    svc = Service(load_config(environ={}, overrides=base))
    try:
        call(svc, "register", pid=0, block_bytes=4096)
        running = svc.cfg
        new = load_config(environ={}, overrides=base + ["scoring.ema=0.5", "predictor.calibration_sample=2"])
        calls = []

        def fail_once(*args):  # the fault: the last section's reconfiguration raises
            calls.append(args)
            if len(calls) == 1:
                raise RuntimeError("injected")
        monkeypatch.setattr(svc.node.placement, "configure_predictor", fail_once)
        with pytest.raises(RuntimeError):
            svc.apply_hot(new, ["scoring", "predictor"])
        assert svc.cfg is running and svc.node.scores.ema == running.scoring.ema != 0.5
        assert calls[-1][1] == running.predictor.calibration_bins  # put back, too
        call(svc, "alloc", n=2, seq=1)
    finally:
        svc.close()
