"""``kvtier serve`` writes one summary line at start and one at stop, even under --log-level WARNING."""

from __future__ import annotations

import json
import re

from kvtier.bench.spawn import DaemonProcess


def test_start_and_stop_summary_lines(tmp_path):
    d = DaemonProcess(tmp_path, "tiers.nvme_bytes=16777216")  # passes --log-level WARNING
    try:
        port = d.info["metrics_port"]
    finally:
        assert d.stop() == 0
    log = d.read_log()
    start = [ln for ln in log.splitlines() if "kvtier 0.1.0 started:" in ln]
    assert len(start) == 1, log
    line = start[0]
    assert "tiers hbm 256 MiB, dram 1024 MiB, nvme 16 MiB in " + str(d.nvme_dir) in line
    assert re.search(r"io auto \((posix|kvikio)\)", line)
    assert f"socket ipc://{d.runtime_dir}/rpc.sock" in line
    assert f"metrics http://127.0.0.1:{port}/metrics" in line
    assert "config field defaults < shipped default (kvtier/daemon/defaults/kvtier.toml) < " in line
    assert "--set metrics.port=0" in line
    stop = [ln for ln in log.splitlines() if "kvtier stopped:" in ln]
    assert len(stop) == 1, log
    assert re.search(r"kvtier stopped: no tiers were built; uptime \d+\.\d s", stop[0])  # no engine registered


def test_json_log_format(tmp_path):
    import os
    import subprocess
    import sys
    import time

    run = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "kvtier.cli", "serve", "--log-format", "json",
                          "--set", "metrics.port=0", "--set", f"server.runtime_dir={json.dumps(str(run))}",
                          "--set", f"tiers.nvme_dir={json.dumps(str(tmp_path / 'nvme'))}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={k: v for k, v in os.environ.items() if not k.startswith("KVTIER_")})
    end = time.monotonic() + 30
    while not (run / "daemon.json").exists() and p.poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    p.terminate()
    out, _ = p.communicate(timeout=30)
    assert p.returncode == 0, out
    records = [json.loads(ln) for ln in out.splitlines() if ln.strip()]
    assert records, out
    for r in records:
        assert set(r) >= {"time", "level", "logger", "message"}, r
    messages = [r["message"] for r in records if r["logger"] == "kvtier.lifecycle"]
    assert messages[0].startswith("kvtier 0.1.0 started:") and messages[-1].startswith("kvtier stopped:"), messages


def test_stop_line_counts_nvme_blocks_once_tiers_exist(tmp_path):
    import numpy as np

    d = DaemonProcess(tmp_path, "tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=1048576")
    try:
        with d.client(heartbeat_s=None) as c:
            c.register(block_bytes=4096)
            ids, _ = c.alloc(3, seq=1)
            c.seal(ids, np.array([11, 12, 13], dtype=np.uint64), seq=1)
            c.free(seqs=[1])
            nvme_used = next(r["used"] for r in c.stats()["tiers"] if r["tier"] == "nvme")
    finally:
        assert d.stop() == 0
    stop = [ln for ln in d.read_log().splitlines() if "kvtier stopped:" in ln]
    assert len(stop) == 1 and f"kvtier stopped: {nvme_used} blocks kept on NVMe; uptime " in stop[0], d.read_log()
