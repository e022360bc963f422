"""``bench scale`` runs end to end on a small node and writes the JSON it promises (timing is not asserted)."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from kvtier.bench.scale_worker import OPS
from kvtier.cli.main import main


def test_bench_scale_writes_growth_and_metadata(tmp_path):
    out = tmp_path / "s.json"
    work = Path(tempfile.mkdtemp(prefix="kvs-"))  # short: the daemon's socket paths must fit sun_path
    try:
        assert main(["bench", "scale", "--blocks", "2000", "6000", "--engines", "1", "--seconds", "0.5",
                     "--real-blocks", "256", "--metadata-blocks", "20000", "--hbm-slots", "512",
                     "--dram-slots", "512", "--dir", str(work), "--json", str(out)]) == 0
        assert not list(work.iterdir())  # its directories are removed
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = json.loads(out.read_text())
    assert r["blocks"] == [2000, 6000] and r["max_per_op_growth"] > 0
    assert r["metadata_bytes_per_block_all"] == r["metadata"]["metadata_bytes_per_block_all"] > 0
    for point, n in zip(r["points"], (2000, 6000)):
        assert point["recovered_blocks"] == n and point["daemon_exit_code"] == 0
        row = point["engines"]["1"]
        assert row["daemon_rss_kb"] > 0 and row["cycles"] > 0
        for op in OPS:  # every op was timed, the missing acquire included
            assert row["ops"][op]["count"] > 0 and row["ops"][op]["p99_us"] >= row["ops"][op]["p50_us"] > 0
    assert set(r["per_op_growth"]["1"]) == set(OPS)
