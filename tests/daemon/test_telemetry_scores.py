"""Attention telemetry through a real Service: the configured priors reach the table's
importance, and blocks a report may not touch still count in the others' shares."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.protocol import wire as P

from .service_calls import call, hbm_only_service, ids

BB = 4096


@pytest.fixture
def svc(tmp_path):
    s = hbm_only_service(tmp_path, 32, "scoring.sink_blocks=1", "scoring.recency_blocks=4",
                         "scoring.recency_floor=0.5", block_bytes=BB)
    call(s, "register", "e", pid=0, block_bytes=BB)
    yield s
    s.close()


def _attention(svc, blocks, mass) -> int:
    return svc.ingest({"v": P.VERSION, "engine": "e", "kind": "attention", "blocks": P.id_bytes(np.array(blocks)),
                       "mass": np.asarray(mass, "<f4").tobytes()})


def test_a_decode_step_s_report_gives_the_sink_and_the_recent_blocks_their_priors(svc):
    blocks = ids(call(svc, "alloc", "e", n=8, seq=1, pin=True)["blocks"])
    assert _attention(svc, blocks, [0, 0, 0, 0, 0, 0, 0, 8.0]) == 8  # all on the newest block
    imp = svc.node.mgr.table.importance[blocks]
    assert imp[0] == 1.0 and imp[7] == 1.0  # the sink, and the block the step read
    assert np.all(imp[1:4] == 0.0) and np.all((imp[4:7] >= 0.5) & (imp[4:7] < 0.51))


def test_blocks_left_out_of_a_report_still_count_in_its_shares(svc):
    blocks = ids(call(svc, "alloc", "e", n=4, seq=2, pin=True)["blocks"])
    call(svc, "release", "e", blocks=[blocks[3]])
    call(svc, "free", "e", blocks=[blocks[3]])  # an open block freed: no longer the engine's
    assert _attention(svc, blocks, [1, 1, 1, 97]) == 3
    np.testing.assert_allclose(svc.node.scores.ema_value[blocks[:3]], 0.04, rtol=1e-5)



def test_a_scoring_reload_rescores_the_blocks_scored_before(svc, tmp_path):
    """A reload of the segment weights reaches blocks that get no report after it (an idle
    sequence's, which demotion ranks); a block never scored keeps its neutral weight."""
    blocks = ids(call(svc, "alloc", "e", n=6, seq=3, pin=True)["blocks"])
    scored, never = blocks[:4], blocks[4:]
    assert svc.ingest({"v": P.VERSION, "engine": "e", "kind": "segment", "blocks": P.id_bytes(np.array(scored)),
                       "tag": "document"}) == 4
    assert _attention(svc, scored, [1, 1, 1, 1]) == 4  # a fair share each: EMA 1, x 0.6 (document)
    t, value = svc.node.mgr.table, svc.node.placement.policies
    np.testing.assert_allclose(t.importance[scored[1:]], 0.6, rtol=1e-6)
    cfg = svc.cfg.model_copy(deep=True)
    cfg.scoring.segment_weights["document"] = 0.9
    svc.apply_hot(cfg, ["scoring"])
    np.testing.assert_allclose(t.importance[scored[1:]], 0.9, rtol=1e-6)
    assert t.importance[scored[0]] == 1.0  # the sink stays a sink
    weighted = [pol for pol in value.values() if hasattr(pol, "weight")]
    assert weighted  # the default policy weighs by importance
    for pol in weighted:
        np.testing.assert_allclose(pol.weight[scored[1:]], (0.2 + 0.8 * 0.9) / 0.6, rtol=1e-6)  # neutral weighs 1
        assert np.all(pol.weight[never] == 1.0)
    assert np.all(t.importance[never] == 0.5)  # neutral: nobody reported on them


def _send(svc, blocks, **fields) -> int:
    return svc.ingest({"v": P.VERSION, "engine": "e", "blocks": P.id_bytes(np.array(blocks)), **fields})


def test_a_tag_a_reload_removes_rescoring_its_blocks(tmp_path):
    """A block only tagged (no report) under a tag the new config drops is scored again; the
    rescore had picked blocks after the tag was gone, so it kept the old weight."""
    s = hbm_only_service(tmp_path, 8, "scoring.segment_weights={tool=0.5}", block_bytes=BB)
    try:
        call(s, "register", "e", pid=0, block_bytes=BB)
        b = ids(call(s, "alloc", "e", n=1, seq=1)["blocks"])
        assert _send(s, b, kind="segment", tag="tool") == 1
        pol = s.node.placement.policies[0]
        assert s.node.mgr.table.importance[b[0]] == 0.25 and pol.weight[b[0]] < 1.0
        cfg = s.cfg.model_copy(deep=True)
        del cfg.scoring.segment_weights["tool"]
        s.apply_hot(cfg, ["scoring"])
        assert s.node.mgr.table.importance[b[0]] == 0.5 and pol.weight[b[0]] == pytest.approx(1.0)
    finally:
        s.close()


def test_a_block_of_neutral_importance_weighs_as_much_as_an_unreported_one(svc):
    """Tagged with the heaviest segment and never reported, a block is neutral: it weighed 0.6
    against an untagged block's 1.0, so it went first."""
    a, b = ids(call(svc, "alloc", "e", n=2, seq=1)["blocks"])
    assert _send(svc, [a], kind="segment", tag="system") == 1
    for pol in svc.node.placement.policies.values():
        assert pol.weight[a] == pytest.approx(pol.weight[b]) == pytest.approx(1.0)
    assert svc.node.mgr.table.importance[a] == svc.node.mgr.table.importance[b] == 0.5


def test_mass_as_a_list_of_floats_is_read_as_floats(svc):
    blocks = ids(call(svc, "alloc", "e", n=2, seq=1)["blocks"])
    assert _send(svc, blocks, kind="attention", mass=[0.9, 0.1]) == 2  # it was cut to [0, 0] and applied
    np.testing.assert_allclose(svc.node.scores.ema_value[blocks], [1.0, 0.2], rtol=1e-6)
    assert _send(svc, blocks, kind="attention", mass=["x", 1]) == 0 and svc.counters["telemetry_rejected"] == 1


def test_mass_whose_float32_sum_overflows_keeps_its_shares(svc):
    blocks = ids(call(svc, "alloc", "e", n=4, seq=1)["blocks"])
    with np.errstate(over="ignore"):
        assert _attention(svc, blocks, [3e38, 3e38, 0, 0]) == 4
    np.testing.assert_allclose(svc.node.scores.ema_value[blocks], [1, 1, 0, 0])


def test_repeated_ids_are_refused_and_open_blocks_class_is_not_counted(svc):
    blocks = ids(call(svc, "alloc", "e", n=4, seq=1)["blocks"])
    assert _attention(svc, [blocks[0]] * 100, np.ones(100)) == 0  # counted 100 updates, made 1
    assert svc.counters["telemetry_rejected"] == 1 and svc.node.scores.reports[blocks[0]] == 0
    assert _send(svc, blocks, kind="class", cont=True, span=3) == 0  # open blocks: their class is their alloc's
    assert svc.counters["telemetry_block_updates"] == 0
