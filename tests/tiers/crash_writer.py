"""A daemon-like writer killed by test_crash: seals blocks and writes them to
NVMe forever, announcing each key only after its write completed."""

import sys

from kvtier.tiers.manager import TierManager
from tests.conftest import pattern

BB = 64 * 1024


def main(directory: str) -> None:
    m = TierManager(BB, 8, 0, 4000, nvme_dir=directory, io_backend="posix", io_threads=4)
    key = 1 + m.recovered * 1000
    while True:
        blocks = m.alloc(4)
        for b in blocks.tolist():
            m.write(b, pattern(key, BB))
            m.seal(b, key)
            key += 1
        m.demote(blocks, "hbm", "nvme")
        m.wait()
        for b in blocks.tolist():
            m.free(b)
            print(int(m.table.key[b]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
