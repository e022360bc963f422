from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from kvtier.bench.spawn import DaemonProcess  # noqa: E402

SMALL = ("tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144")


@pytest.fixture
def daemon(tmp_path):
    d = DaemonProcess(tmp_path, *SMALL, "server.heartbeat_timeout_s=1.0")
    yield d
    rc = d.stop()
    assert rc == 0, d.read_log()
