"""What the replay refuses or reports as missing: a policy that evicts a block it does not
hold, averages with nothing to average, bad trace lines and bad multi-tier options."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvtier.cli.main import main
from kvtier.cli.output import write_json
from kvtier.policy import make_policy
from kvtier.replay.report import replay
from kvtier.replay.sim import NotResident, simulate
from kvtier.replay.synthetic import synthetic_trace
from kvtier.replay.traces import TraceError, load_trace, split_trace

from .test_replay import _trace


def _lying(pol, victim: int):
    """``pol`` whose ``evict`` evicts as usual but names ``victim`` instead."""
    orig = pol.evict

    def evict(now: float) -> int:
        orig(now)
        return victim

    pol.evict = evict
    return pol


def test_simulate_refuses_a_victim_that_is_not_resident():
    tr = _trace([0, 1, 2, 3])
    # 3 is not resident when 2 misses at capacity 2 (0 and 1 are)
    with pytest.raises(NotResident, match="policy lru evicted block 3, which is not resident"):
        simulate(_lying(make_policy("lru", 2, tr.n_unique), 3), tr, None, compiled=False)
    with pytest.raises(NotResident, match="block -1"):  # no silent resident[-1]
        simulate(_lying(make_policy("lru", 2, tr.n_unique), -1), tr, None, compiled=False)
    # an honest policy passes the check, through the hooks and through kvtier's compiled loop
    assert simulate(make_policy("lru", 2, tr.n_unique), tr, None) == 0
    rng = np.random.default_rng(1)
    tr = _trace((rng.zipf(1.3, 3000) % 300).tolist())
    hooks = simulate(make_policy("kvtier", 15, tr.n_unique), tr, None, compiled=False)
    assert simulate(make_policy("kvtier", 15, tr.n_unique), tr, None) == hooks > 0


@pytest.mark.parametrize("tier", ["HBM", "DRAM"])
def test_tiered_replay_refuses_a_victim_that_is_not_resident(monkeypatch, tier):
    import kvtier.replay.tiered as T

    made: list = []

    def make(name, cap, n, **kw):  # the first policy made is HBM's, the second DRAM's
        pol = make_policy(name, cap, n, **kw)
        made.append(pol)
        return _lying(pol, 5) if len(made) == (1 if tier == "HBM" else 2) else pol

    monkeypatch.setattr(T, "make_policy", make)
    tr = _trace([0, 1, 2, 3, 4, 5, 0, 1, 2, 3])  # 5 is in no tier while 0..4 pass through HBM 1 + DRAM 2
    with pytest.raises(NotResident, match=f"evicted block 5, which is not resident in {tier}"):
        T.simulate_tiers("lru", T.TierSpec(1, 2), tr)


def test_gap_closed_names_its_capacities_and_is_null_without_any():
    tr = synthetic_trace("synthetic:zipf", requests=2000)
    pol = ["lru", "kvtier", "belady"]
    rep = replay(tr, [0.01, 1.0], pol, {"kvtier": {}})
    # at 100% every policy holds everything: Belady == LRU, no gap to close there
    assert rep["gap_capacities"] == [0.01]
    assert rep["gap_left_out"] == [{"fraction": 1.0, "capacity_blocks": tr.n_unique,
                                    "reason": "Belady == LRU: no gap to close"}]
    r = rep["rows"][0]["hit"]
    assert rep["gap_closed"]["kvtier"] == pytest.approx((r["kvtier"] - r["lru"]) / (r["belady"] - r["lru"]))
    only = replay(tr, [1.0], ["lru", "belady"], {})
    assert only["gap_closed"] == {"lru": None, "belady": None} and only["gap_capacities"] == []
    assert "gap_capacities" not in replay(tr, [1.0], ["lru"], {})


def test_calibration_is_the_mean_over_runs_that_scored_predictions():
    tr = synthetic_trace("synthetic:zipf", requests=2000)
    rep = replay(tr, [0.01, 0.2, 1.0], ["kvtier"], {"kvtier": {"track_calibration": True}})
    runs = rep["calibration_per_run"]
    assert [c["n"] > 0 for c in runs] == [True, True, False]  # at 100% nothing is evicted: no prediction
    assert math.isnan(runs[2]["brier"])
    c = rep["calibration"]
    assert c["runs"] == 2
    for k in ("brier", "ece", "ece_raw"):
        assert c[k] == pytest.approx((runs[0][k] + runs[1][k]) / 2)
    none = replay(tr, [1.0], ["kvtier"], {"kvtier": {"track_calibration": True}})["calibration"]
    assert none == {"runs": 0, "brier": None, "ece": None, "ece_raw": None}


def test_json_output_has_no_nan(tmp_path):
    p = tmp_path / "r.json"
    write_json(str(p), {"a": float("nan"), "b": [np.float64("inf"), 1.5, None], "c": {"d": -math.inf, "e": 2}})

    def refuse(name: str) -> None:
        raise AssertionError(f"{name} in the JSON")

    assert json.loads(p.read_text(), parse_constant=refuse) == {"a": None, "b": [None, 1.5, None],
                                                               "c": {"d": None, "e": 2}}


GOOD = '{"timestamp": 1000, "hash_ids": [0, 1]}\n'


def _bailian(**kw) -> str:
    return json.dumps({"chat_id": 1, "parent_chat_id": -1, "timestamp": 0.5, "input_length": 4, "output_length": 1,
                       "type": "text", "turn": 1, "hash_ids": [1], **kw}) + "\n"


@pytest.mark.parametrize("text,where,msg", [
    (GOOD + '{"timestamp": NaN, "hash_ids": [2]}\n{"timestamp": 5, "hash_ids": [3]}\n', 2, "finite"),
    (GOOD + '{"timestamp": Infinity, "hash_ids": [2]}\n', 2, "finite"),
    (GOOD + '{"timestamp": 1e999, "hash_ids": [2]}\n', 2, "finite"),
    (GOOD + json.dumps({"timestamp": 2000, "hash_ids": [2**63]}) + "\n", 2, "64-bit"),
    (GOOD + json.dumps({"timestamp": 2000, "hash_ids": [-2**63 - 1]}) + "\n", 2, "64-bit"),
    ('\n\n{"foo": 1}\n', 3, "unknown trace format"),
    (_bailian() + _bailian(turn=None, timestamp=1.0), 2, "turn must be an integer"),
    (_bailian() + _bailian(turn="x", timestamp=1.0), 2, "turn must be an integer"),
    (_bailian() + _bailian(turn=True, timestamp=1.0), 2, "turn must be an integer"),
    (_bailian() + _bailian(parent_chat_id="1", timestamp=1.0), 2, "parent_chat_id"),
])
def test_bad_values_name_the_file_and_line(tmp_path, text, where, msg):
    p = tmp_path / "t.jsonl"
    p.write_text(text)
    with pytest.raises(TraceError, match=rf"t.jsonl:{where}: .*{msg}"):
        load_trace(str(p))


def test_bailian_parent_chat_id_may_be_null_or_absent(tmp_path):
    p = tmp_path / "b.jsonl"
    rec = json.loads(_bailian(turn=2, timestamp=1.0))
    del rec["parent_chat_id"]
    p.write_text(_bailian(parent_chat_id=None) + json.dumps(rec) + "\n"
                 + _bailian(parent_chat_id=2**63 - 1, hash_ids=[-2**63, 2**63 - 1], timestamp=2.0))
    tr = load_trace(str(p))
    assert tr.n_requests == 3 and tr.n_accesses == 4 and tr.n_unique == 3
    # classes: no parent and turn 1 starts a conversation; turn 2, or any parent id, continues one
    from kvtier.predictor.classes import block_class

    assert tr.cls.tolist() == [block_class(True, False, 1), block_class(True, True, 0),
                               block_class(False, True, 2), block_class(True, True, 2)]


def test_a_half_without_accesses_is_a_clear_error(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "hash_ids": []}\n{"timestamp": 5, "hash_ids": [1, 2]}\n')
    tr = load_trace(str(p))
    assert split_trace(tr, "second").n_accesses == 2
    with pytest.raises(TraceError, match="the first half of its 2 requests has no accesses"):
        split_trace(tr, "first")


@pytest.mark.parametrize("args,msg", [
    (["--nodes", "4"], "--nodes applies to the multi-tier replay only"),
    (["--remote-gbps", "3"], "--remote-gbps applies to the multi-tier replay only"),
    (["--publish-min-shares", "0"], "--publish-min-shares applies to the multi-tier"),
    (["--dram-gbps", "10"], "--dram-gbps applies to the multi-tier"),
    (["--tiers", "1%,5%", "--nvme-gbps", "0"], "--nvme-gbps must be a positive number, not 0"),
    (["--tiers", "1%,5%", "--dram-gbps", "-3"], "--dram-gbps must be a positive number, not -3"),
    (["--tiers", "1%,5%", "--block-mib", "nan"], "--block-mib must be a positive number"),
    (["--tiers", "1%,5%,20%", "--remote-gbps", "0"], "--remote-gbps must be a positive number"),
    (["--tiers", "1%,5%", "--nodes", "0"], "--nodes must be at least 1"),
    (["--tiers", "1%,5%", "--remote-gbps", "3"], "--remote-gbps applies to a remote tier"),
    (["--tiers", "1%"], "--tiers takes two or three capacities"),
    (["--part", "first"], "first half of its 2 requests has no accesses"),
])
def test_bad_replay_options_are_one_error_line(tmp_path, capsys, args, msg):
    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "hash_ids": []}\n{"timestamp": 5, "hash_ids": [1, 2, 1]}\n')
    assert main(["replay", str(p), "--policy", "lru", "--capacity", "50%", *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtier: error: ") and msg in err[0], err


def test_multi_tier_options_with_tiers_still_run(tmp_path, capsys):
    p = tmp_path / "t.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i, "hash_ids": [i % 7, i % 3 + 10]}) + "\n" for i in range(60)))
    out = tmp_path / "r.json"
    assert main(["replay", str(p), "--policy", "lru,belady", "--capacity", "20%,100%", "--tiers", "20%,40%,50%",
                 "--nodes", "2", "--remote-gbps", "1", "--publish-min-shares", "0", "--nvme-gbps", "2",
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert rep["tiers"][0]["nodes"] == 2 and rep["gap_left_out"][0]["fraction"] == 1.0
    assert rep["gap_capacities"] == [0.2]
    capsys.readouterr()


def test_several_traces_plot_to_one_file_each():
    from kvtier.cli.replay import plot_path

    assert plot_path("out.png", "synthetic:zipf:3") == "out-synthetic-zipf-3.png"
    assert plot_path("plots/out.svg", "conv.jsonl") == "plots/out-conv.svg"  # the trace's extension is not the plot's


def test_synthetic_seed_in_the_name():
    """``synthetic:FAMILY:SEED`` is that seed's draw (the same as ``seed=``), another seed
    is another trace, seed 0 keeps the plain name, and a bad seed is refused by name."""
    a = synthetic_trace("synthetic:loop:3", requests=300)
    b = synthetic_trace("loop", requests=300, seed=3)
    assert a.name == "synthetic:loop:3"
    assert np.array_equal(a.block, b.block) and np.array_equal(a.cls, b.cls)
    c = synthetic_trace("synthetic:loop:4", requests=300)
    assert c.block.size != a.block.size or not np.array_equal(c.block, a.block)
    assert synthetic_trace("synthetic:loop:0", requests=300).name == "synthetic:loop"
    for bad in ("synthetic:loop:x", "synthetic:loop:-1", "synthetic:loop:"):
        with pytest.raises(ValueError, match="non-negative integer"):
            synthetic_trace(bad, requests=10)
