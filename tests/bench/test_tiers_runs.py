"""Pooling saved ``bench tiers`` runs: exact pooled figures on hand-made runs, and bad files refused."""

from __future__ import annotations

import json

import pytest

from kvtier.bench.intervals import pooled_interval
from kvtier.bench.tiers_runs import pool
from kvtier.cli.main import main

STEPS = ("hbm_to_dram", "dram_to_hbm", "dram_to_nvme", "nvme_to_dram")


def a_run(ratio_of: dict[str, list[float]], kib: int = 256) -> dict:
    """A bench tiers result of one size whose raw steps take 1 s and kvtier's 1 / ratio."""
    samples = {o: [1.0 / r for r in ratio_of[o]] for o in STEPS}
    samples.update(raw_copy=[1.0] * len(ratio_of["hbm_to_dram"]), raw_write=[1.0] * len(ratio_of["dram_to_nvme"]),
                   raw_read=[1.0] * len(ratio_of["nvme_to_dram"]))
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731  (odd counts here)
    ratios = {"dram_copy": min(med(ratio_of["hbm_to_dram"]), med(ratio_of["dram_to_hbm"])),
              "nvme_write": med(ratio_of["dram_to_nvme"]), "nvme_read": med(ratio_of["nvme_to_dram"])}
    size = {"block_bytes": kib << 10, "samples_s": samples, "ratios": ratios,
            "best_baseline": {"dram_copy": "raw_copy", "nvme_write": "raw_write", "nvme_read": "raw_read"}}
    return {"bench": "tiers", "ratios": ratios, "sizes": {f"{kib}KiB": size}}


def a_run_timed_at(t: object) -> dict:
    """A run whose every repetition took ``t``."""
    run = a_run({o: [0.9] for o in STEPS})
    size = run["sizes"]["256KiB"]
    size["samples_s"] = {o: [t] for o in size["samples_s"]}
    return run


def changed(**fields: object) -> dict:
    """A one-size run with some of its size's fields replaced."""
    run = a_run({o: [0.9] for o in STEPS})
    run["sizes"]["256KiB"].update(fields)
    return run


def test_pooled_figures_are_the_median_of_every_repetition():
    one = a_run({"hbm_to_dram": [0.8, 0.85, 0.95], "dram_to_hbm": [1.0, 1.0, 1.0],
                 "dram_to_nvme": [0.8], "nvme_to_dram": [0.9]})
    two = a_run({"hbm_to_dram": [0.92, 0.96, 0.97], "dram_to_hbm": [0.99, 0.99, 0.99],
                 "dram_to_nvme": [0.9], "nvme_to_dram": [0.7]})
    got = pool([one, two], ["a", "b"])["heads"]
    copy = got["dram_copy"]
    assert copy["per_run"] == [0.85, 0.96] and copy["met"] == 1 and copy["range"] == [0.85, 0.96]
    assert copy["pooled"] == pytest.approx(0.935)  # median of .8 .85 .92 .95 .96 .97: (.92 + .95) / 2
    assert got["nvme_write"]["pooled"] == pytest.approx(0.85) and got["nvme_write"]["met"] == 1
    assert got["nvme_read"]["pooled"] == pytest.approx(0.8)
    for h in got.values():
        lo, hi = h["pooled_interval"]
        assert lo <= h["pooled"] <= hi


def test_sizes_a_run_lacks_pool_over_the_runs_that_have_them():
    small = a_run({o: [0.95] * 3 for o in STEPS}, kib=256)
    large = a_run({o: [0.91] * 3 for o in STEPS}, kib=2048)
    copy = pool([small, large], ["s", "l"])["heads"]["dram_copy"]
    assert list(copy["by_size"]) == ["256KiB", "2048KiB"]  # by block size, not by name
    assert copy["by_size"]["2048KiB"]["runs"] == 1 and copy["by_size"]["2048KiB"]["pooled"] == pytest.approx(0.91)
    assert copy["pooled"] == pytest.approx(0.91) and copy["pooled_interval"][0] == pytest.approx(0.91)


def test_a_difference_between_runs_widens_the_interval():
    reps = [0.88, 0.9, 0.92, 0.94, 0.96]
    alike = [[reps], [reps], [reps], [reps]]
    apart = [[[r - 0.05 for r in reps]], [[r + 0.05 for r in reps]]] * 2
    lo, hi = pooled_interval(alike)
    lo2, hi2 = pooled_interval(apart)
    assert hi2 - lo2 > hi - lo
    assert pooled_interval([[[0.9] * 4]] * 3) == (0.9, 0.9)


@pytest.mark.parametrize("runs", [[], [[[1.0]], [[1.0], [1.0]]], [[[]], [[]]], [[[1.0], []], [[], []]]])
def test_pooled_interval_refuses_what_it_cannot_resample(runs):
    with pytest.raises(ValueError):
        pooled_interval(runs)


def test_the_command_pools_files_and_writes_its_json(tmp_path):
    paths = []
    for i, r in enumerate((0.93, 0.97)):
        p = tmp_path / f"run{i}.json"
        p.write_text(json.dumps(a_run({o: [r] * 3 for o in STEPS})))
        paths.append(str(p))
    out = tmp_path / "pooled.json"
    assert main(["bench", "tiers-runs", *paths, "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["runs"] == 2 and got["files"] == paths and got["ok"] is True
    assert got["heads"]["dram_copy"]["pooled"] == pytest.approx(0.95)


@pytest.mark.parametrize("content, says", [
    ("not json {", "not JSON"),
    (json.dumps({"bench": "rpc"}), "not a `kvtier bench tiers --json` result"),
    (json.dumps({"bench": "tiers", "sizes": {}}), "no block sizes"),
    (json.dumps({"bench": "tiers", "sizes": {"256KiB": {"samples_s": {}, "best_baseline": {}}}}), "best baselines"),
    (json.dumps(changed(samples_s={"hbm_to_dram": [1.0]})), "lacks the repetitions of dram_to_hbm"),
    (json.dumps(a_run_timed_at(0.0)), "not positive times"),
    (json.dumps(a_run_timed_at("1 s")), "not positive times"),
    (json.dumps(a_run_timed_at(10 ** 400)), "not positive times"),  # too large for a float
    (json.dumps(changed(best_baseline={"dram_copy": None, "nvme_write": "raw_write", "nvme_read": "raw_read"})),
     "best baselines"),
    (json.dumps(changed(best_baseline={"dram_copy": ["raw_copy"], "nvme_write": "raw_write", "nvme_read": "raw_read"})),
     "best baselines"),
    (json.dumps(changed(ratios={"dram_copy": 0.9})), "headline ratios"),
    (json.dumps(changed(block_bytes="256 KiB")), "not a byte count"),
    (json.dumps(changed(samples_s=dict(a_run({o: [0.9] for o in STEPS})["sizes"]["256KiB"]["samples_s"],
                                       raw_copy=[1.0, 1.0]))), "1 repetitions of hbm_to_dram against 2 of raw_copy"),
])
def test_a_file_that_is_no_tiers_run_is_refused_and_nothing_is_written(tmp_path, capsys, content, says):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    out = tmp_path / "pooled.json"
    assert main(["bench", "tiers-runs", str(bad), "--json", str(out)]) == 1
    assert says in capsys.readouterr().err and not out.exists()


def test_a_missing_file_is_named(tmp_path, capsys):
    assert main(["bench", "tiers-runs", str(tmp_path / "nope.json")]) == 1
    assert "nope.json: cannot read it" in capsys.readouterr().err
