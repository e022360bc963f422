"""Benchmark commands run end to end and write the JSON they promise (speed itself is not asserted)."""

from __future__ import annotations

import json

import torch

from kvtier.cli.main import main


def test_bench_tiers_writes_ratios(tmp_path):
    out = tmp_path / "t.json"
    assert main(["bench", "tiers", "--block-kib", "64", "--total-mib", "2", "--reps", "1",
                 "--metadata-blocks", "1000", "--nvme-dir", str(tmp_path / "nvme"), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    host = ("dram_copy", "nvme_write", "nvme_read")
    gpu = ("h2d", "d2h", "kvikio_read", "kvikio_write")
    assert set(r["ratios"]) == {*host, *gpu}
    assert all(r["ratios"][k] > 0 for k in host) and r["metadata_bytes_per_block"] <= 256
    assert all((r["ratios"][k] is None) == (not torch.cuda.is_available()) for k in ("h2d", "d2h"))
    size = r["sizes"]["64KiB"]
    assert size["dram_copy_vs_torch_copy"] > 0 and size["memcpy_tier_gbps"] > 0
    samples = size["samples_s"]  # copies: --copy-rounds (3) a repetition; the rest once
    assert len(samples["hbm_to_dram"]) == len(samples["memcpy_tier"]) == 3
    assert len(samples["dram_to_nvme"]) == len(samples["raw_odirect_write_tier"]) == 1


def test_bench_rpc_writes_the_issue_fields(tmp_path):
    out = tmp_path / "r.json"
    assert main(["bench", "rpc", "--iters", "30", "--telemetry-messages", "5", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    for key in ("raw_zmq_rtt_us_p50", "acquire_rtt_us_p50", "ratio", "telemetry_block_updates_per_s"):
        assert r[key] > 0
    assert r["telemetry_delivered"] == 1.0
