"""Whole-turn figures of ``bench e2e``: every step counted, ratios of the right clocks, and the JSON keys."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.bench.demo import turn_figures
from kvtier.bench.workload import TurnResult
from kvtier.cli.main import main


def _turn(prefill: float, decode: float, total: float, ttft: float) -> TurnResult:
    return TurnResult([1, 2, 3], [torch.zeros(1)] * 3, decode, 2, prefill, 10, total, ttft)


def test_turn_figures_divide_the_right_clocks():
    turns = [(_turn(1.0, 2.0, 4.0, 1.1), _turn(2.0, 2.5, 6.0, 2.2)),
             (_turn(1.0, 2.0, 4.0, 1.3), _turn(1.0, 1.5, 4.0, 1.2))]
    f = turn_figures(turns)
    assert f["ratio"] == pytest.approx(8.0 / 10.0)  # whole turn: 8 s untiered, 10 s tiered
    assert f["prefill_ratio"] == pytest.approx(2.0 / 3.0) and f["decode_ratio"] == pytest.approx(4.0 / 4.0)
    assert f["turn_tokens"] == 2 * (10 + 2 + 1)  # prompt, decoded tokens, and the prefill's token
    assert f["tokens_per_s_tiered"] == pytest.approx(26 / 10.0)
    assert f["prefill_tokens_per_s_untiered"] == pytest.approx(20 / 2.0)
    assert f["ttft_s_tiered"]["per_turn"] == [2.2, 1.2] and f["ttft_s_untiered"]["max"] == 1.3
    assert f["overhead_s"]["prefill_s"] == pytest.approx(1.0)
    assert f["overhead_s"]["outside_forward_s"] == pytest.approx(2.0 - 1.0 - 0.0)


def test_bench_e2e_reports_both_hint_modes(tmp_path):
    out = tmp_path / "e.json"
    assert main(["bench", "e2e", "--sessions", "2", "--turns", "2", "--gen-tokens", "3", "--user-tokens", "8",
                 "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("ratio", "decode_ratio", "prefill_ratio", "tokens_per_s_tiered", "prefill_tokens_per_s_tiered",
                "decode_tokens_per_s_tiered", "prefetch_on_time_hints", "prefetch_on_time_no_hints"):
        assert r[key] is not None and r[key] >= 0, key
    assert len(r["ttft_s_tiered"]["per_turn"]) == len(r["ttft_s_untiered"]["per_turn"]) == 4
    assert r["bit_exact"] and r["no_hints"]["bit_exact"] and r["options"]["hints"]
    assert "costliest_step" in r and r["targets"]["prefetch_on_time_min"] == 0.95
