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
        np.testing.assert_allclose(pol.weight[scored[1:]], 0.2 + 0.8 * 0.9, rtol=1e-6)
        assert np.all(pol.weight[never] == 1.0)
    assert np.all(t.importance[never] == 0.0)
