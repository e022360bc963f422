"""Transfer descriptors: what each path needs is there and frozen before a worker reads it."""

import numpy as np
import pytest

from kvtier.tiers.transfer import Transfer
from kvtier.tiers.types import Tier


def _transfer(src: Tier, dst: Tier, n: int = 3, header: bool = True, **over) -> Transfer:
    a = lambda: np.arange(n, dtype=np.int64)  # noqa: E731
    fields = dict(keys=a(), checksums=a(), sealed=np.ones(n, bool)) if header else dict(keys=None, checksums=None,
                                                                                        sealed=None)
    fields.update(over)
    return Transfer(1, src, dst, a(), a(), a(), fields["keys"], a(), fields["checksums"], fields["sealed"])


def test_a_memory_copy_carries_no_header_and_an_nvme_transfer_must():
    """Header fields (key, checksum, sealed) are read by NVMe paths only: a copy between
    memory tiers may leave them out, a transfer to or from NVMe may not, and whatever a
    transfer carries is read-only and one entry a block."""
    t = _transfer(Tier.HBM, Tier.DRAM, header=False)
    with pytest.raises(ValueError, match="no header"):
        t.header()
    assert not t.src_slots.flags.writeable and not t.blocks.flags.writeable
    for src, dst in ((Tier.DRAM, Tier.NVME), (Tier.NVME, Tier.HBM)):
        with pytest.raises(ValueError, match="needed by a transfer to or from NVMe"):
            _transfer(src, dst, header=False)
        keys, sums, sealed = _transfer(src, dst).header()
        assert keys.tolist() == [0, 1, 2] and not sums.flags.writeable and sealed.all()
    with pytest.raises(ValueError, match="Transfer.checksums has 2 entries, expected 3"):
        _transfer(Tier.DRAM, Tier.NVME, checksums=np.zeros(2, np.int64))
