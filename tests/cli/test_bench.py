"""Benchmark commands run end to end and write the JSON they promise (speed itself is not asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from kvtier.bench.baselines import COMPILED_IO
from kvtier.cli.main import main


def test_bench_tiers_writes_ratios(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "tiers", "--block-kib", "64", "--total-mib", "2", "--reps", "1",
                 "--metadata-blocks", "1000", "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["sizes_measured"] == "each in a process of its own"  # as a daemon builds its tiers once
    host = ("dram_copy", "nvme_write", "nvme_read")
    gpu = ("h2d", "d2h", "kvikio_read", "kvikio_write")
    assert set(r["ratios"]) == {*host, *gpu}
    assert all(r["ratios"][k] > 0 for k in host) and r["metadata_bytes_per_block"] > 0
    assert r["metadata"]["metadata_bytes_per_block_all"] == r["metadata_bytes_per_block"]
    assert all((r["ratios"][k] is None) == (not torch.cuda.is_available()) for k in ("h2d", "d2h"))
    size = r["sizes"]["64KiB"]
    by = size["ratios_by_baseline"]  # every baseline measured, the headline against the fastest
    assert set(by) == set(host) and set(by["dram_copy"]) == {"memcpy_tier", "torch_copy_tier", "threads_copy_tier",
                                                                 "chunks_copy_tier"}
    compiled = {"_c"} if COMPILED_IO else set()  # the backend's own compiled loop, run bare
    assert set(by["nvme_write"]) == {f"raw_odirect_write_tier{x}" for x in ("", "_qd", *("_qd" + c for c in compiled))}
    assert set(by["nvme_read"]) == {f"raw_odirect_read_tier{x}" for x in ("", "_qd", *("_qd" + c for c in compiled))}
    for k in host:
        fastest = min(by[k], key=lambda x: sorted(size["samples_s"][x])[len(size["samples_s"][x]) // 2])
        assert size["best_baseline"][k] == fastest and size["ratios"][k] == by[k][fastest]
        assert r["ratios_old_baseline"][k] == size["ratios_old_baseline"][k] > 0
        lo, hi = size["ratio_intervals"][k]  # resampled repetitions: the median they resample lies inside
        assert lo - 1e-12 <= size["ratios"][k] <= hi + 1e-12
        assert r["ratio_intervals"][k] == [lo, hi]  # one size: the headline's interval is that size's
        assert min(size["ratios_by_step"][k].values()) == size["ratios"][k]
    assert set(size["ratios_by_step"]["dram_copy"]) == {"hbm_to_dram", "dram_to_hbm"}
    assert size["ratio_intervals"]["nvme_write"][0] == size["ratio_intervals"]["nvme_write"][1]  # one repetition
    pooled = tmp_path / "p.json"  # a run pooled with itself: its own figures, every repetition twice
    assert main(["bench", "tiers-runs", str(out), str(out), "--json", str(pooled)]) == 0
    heads = json.loads(pooled.read_text())["heads"]
    assert all(heads[k]["pooled"] == r["ratios"][k] and heads[k]["per_run"] == [r["ratios"][k]] * 2 for k in host)
    samples = size["samples_s"]  # copies: --copy-rounds (3) a repetition; the rest once
    assert len(samples["hbm_to_dram"]) == len(samples["memcpy_tier"]) == len(samples["threads_copy_tier"]) == 3
    assert len(samples["dram_to_nvme"]) == len(samples["raw_odirect_write_tier_qd"]) == 1
    if COMPILED_IO:  # the verified raw read is reported beside the baselines, never one of them
        assert len(samples["raw_odirect_read_tier_qd_c_verified"]) == 1
        assert set(size["read_verification"]) == {"raw_verified_vs_raw", "nvme_read_vs_raw_verified"}
        assert all(v > 0 for v in size["read_verification"].values())


@pytest.mark.parametrize("one_process", [False, True])
def test_bench_tiers_measures_sizes_in_processes_of_their_own_or_one_after_another(tmp_path, one_process):
    out = tmp_path / "t.json"
    assert main(["bench", "tiers", "--block-kib", "64", "128", "--total-mib", "2", "--reps", "1", "--copy-rounds", "1",
                 "--metadata-blocks", "1000", "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out),
                 *(["--one-process"] if one_process else [])]) == 0
    r = json.loads(out.read_text())
    assert r["sizes_measured"] == ("in this process, one after another" if one_process else "each in a process of its own")
    assert set(r["sizes"]) == {"64KiB", "128KiB"} and not (tmp_path / "nvme").exists()  # the run's files are gone
    for k in ("dram_copy", "nvme_write", "nvme_read"):  # the headline is the worse size, its interval below both
        assert r["ratios"][k] == min(s["ratios"][k] for s in r["sizes"].values())
        assert r["ratio_intervals"][k][0] <= min(s["ratio_intervals"][k][0] for s in r["sizes"].values()) + 1e-12


def test_bench_rpc_writes_the_issue_fields(tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "rpc", "--iters", "30", "--telemetry-messages", "5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("raw_zmq_rtt_us_p50", "acquire_rtt_us_p50", "ratio", "telemetry_block_updates_per_s"):
        assert r[key] > 0
    assert r["telemetry_delivered"] == 1.0
