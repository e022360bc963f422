"""``kvtier replay`` runs any registered policy by name, the published references as a group."""

from __future__ import annotations

import json

import numpy as np

from .helpers import kvtier, one_error_line


def _trace(path) -> None:
    rng = np.random.default_rng(0)
    with open(path, "w") as f:
        for i in range(300):
            ids = [0, *(rng.zipf(1.3, 6) % 400 + 1).tolist()]
            f.write(json.dumps({"timestamp": i * 100, "hash_ids": ids}) + "\n")


def test_published_policies_beside_lru_and_belady_with_gap_closed(tmp_path):
    _trace(tmp_path / "t.jsonl")
    out = tmp_path / "r.json"
    r = kvtier("replay", str(tmp_path / "t.jsonl"), "--capacity", "5%,20%", "--policies",
               "lru,published,kvtier,belady", "--json", str(out))
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    names = ["lru", "arc", "lirs", "w-tinylfu", "s3fifo", "sieve", "2q", "lhd", "gdsf", "kvtier", "belady"]
    assert sorted(rep["rows"][0]["hit"]) == sorted(names) and sorted(rep["gap_closed"]) == sorted(names)
    assert rep["gap_closed"]["lru"] == 0.0 and rep["gap_closed"]["belady"] == 1.0
    assert all(rep["accesses_per_s"][n] > 0 for n in names)
    for n in names:  # the table has one row per policy
        assert any(line.split("│")[1].strip() == n for line in r.stdout.splitlines() if "│" in line), n


def test_an_unknown_policy_is_one_error_line(tmp_path):
    _trace(tmp_path / "t.jsonl")
    line = one_error_line(kvtier("replay", str(tmp_path / "t.jsonl"), "--policies", "lru,nope"))
    assert "unknown policy 'nope'" in line
