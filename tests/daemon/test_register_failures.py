"""A first register that cannot build the tiers: a clear rejection, nothing left behind.

Real daemon processes, real /dev/shm, real files. ENOSPC comes from sizes above
/dev/shm's total size, which tmpfs refuses before allocating anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.bench.spawn import DaemonProcess
from kvtier.client.tier_client import RequestRejected

from ..conftest import SHM, shm_segments_of, shm_total_or_skip

SMALL = ("tiers.hbm_bytes=65536", "tiers.dram_bytes=65536", "tiers.nvme_bytes=262144")






def _fail_register(d: DaemonProcess, block_bytes: int = 4096) -> RequestRejected:
    """Register, expect a rejection; then the daemon must still serve, with no tiers and no leaks."""
    with d.client(heartbeat_s=None) as c:
        with pytest.raises(RequestRejected) as ei:
            c.register(block_bytes=block_bytes)
        assert shm_segments_of(d.proc.pid) == set(), d.read_log()
        assert c.ping()["pong"]
        s = c.stats()
        assert s["tiers"] == []
        assert s["service"].get("internal_errors", 0) == 0
    return ei.value


def _stop(d: DaemonProcess) -> None:
    assert d.stop() == 0, d.read_log()




def _fail_start(tmp_path: Path, *overrides: str) -> str:
    """The daemon refuses to start (it locks its NVMe directory at start): one line naming why."""
    with pytest.raises(RuntimeError) as ei:
        DaemonProcess(tmp_path, *SMALL, *overrides)
    assert "Traceback" not in str(ei.value), ei.value
    return str(ei.value)


def test_nvme_dir_under_a_file_is_refused_at_start_and_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    bad = tmp_path / "afile" / "sub"
    msg = _fail_start(tmp_path, f'tiers.nvme_dir="{bad}"')
    assert str(bad) in msg and "Not a directory" in msg


def test_nvme_dir_that_is_a_symlink_is_refused(tmp_path: Path) -> None:
    (tmp_path / "target").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    msg = _fail_start(tmp_path, f'tiers.nvme_dir="{link}"')
    assert str(link) in msg and "symlink" in msg
    assert list((tmp_path / "target").iterdir()) == []  # nothing was created through the link


def test_bad_numa_node_is_invalid_and_leaks_no_segment(tmp_path: Path) -> None:
    shm_total_or_skip()
    d = DaemonProcess(tmp_path, *SMALL, "tiers.dram_numa_node=4000")
    try:
        e = _fail_register(d)
        assert e.code == "invalid" and "NUMA node 4000" in str(e), e
    finally:
        _stop(d)


def test_dram_pool_larger_than_dev_shm_is_no_space(tmp_path: Path) -> None:
    too_big = shm_total_or_skip() + (64 << 20)
    d = DaemonProcess(tmp_path, *SMALL, f"tiers.dram_bytes={too_big}")
    try:
        e = _fail_register(d)
        assert e.code == "no_space", e
        assert SHM in str(e) and "No space left on device" in str(e)
    finally:
        _stop(d)


def test_slab_larger_than_its_filesystem_is_no_space_and_removed(tmp_path: Path, tmpfs_dir: Path) -> None:
    block = 1 << 20
    nvme = shm_total_or_skip() + (64 << 20)  # one slab file (under 65536 slots) bigger than the tmpfs
    d = DaemonProcess(tmp_path, *SMALL, f"tiers.nvme_bytes={nvme}", f'tiers.nvme_dir="{tmpfs_dir / "nvme"}"')
    try:
        e = _fail_register(d, block_bytes=block)
        assert e.code == "no_space", e
        assert str(tmpfs_dir / "nvme" / "slab-0000.kvt") in str(e)
        left = [p.name for p in (tmpfs_dir / "nvme").iterdir()] if (tmpfs_dir / "nvme").exists() else []
        assert left in ([], [".kvtier.lock"]), left  # no slab left; the daemon's lock file stays while it runs
    finally:
        _stop(d)
