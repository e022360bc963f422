"""A client process for the daemon tests: writes, demotes and verifies its blocks."""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

from kvtier.client.tier_client import TierClient


def pattern(block: int, salt: int, n: int) -> np.ndarray:
    return ((np.arange(n, dtype=np.int64) * 31 + block * 7 + salt) % 251).astype(np.uint8)


def main(runtime_dir: str, salt: int, mode: str) -> int:
    c = TierClient(runtime_dir=runtime_dir, engine_id=f"worker-{salt}", heartbeat_s=0.2)
    c.register(block_bytes=4096)
    if mode == "hold":  # take pins, report ready, then wait to be killed
        blocks, _ = c.alloc(3, seq=1)
        c.acquire(blocks=blocks)
        print("ready", flush=True)
        time.sleep(600)
        return 0
    rng = np.random.default_rng(salt)
    owned: dict[int, int] = {}
    for step in range(12):
        blocks, _ = c.alloc(2, seq=step)
        b, slots = c.acquire(blocks=blocks)
        for blk, s in zip(b.tolist(), slots.tolist()):  # host or device HBM alike
            c.slot_view(s).copy_(torch.from_numpy(pattern(blk, salt, 4096)))
        if c.hbm is not None and c.hbm.is_cuda:
            torch.cuda.synchronize()  # the daemon reads these bytes when it seals them
        c.release(blocks=b)
        keys = rng.integers(1, 2**62, size=2, dtype=np.int64) | (salt << 56)
        canon = c.seal(b, keys, seq=step)
        owned.update({int(k): int(x) for k, x in zip(canon, b)})
        check = rng.choice(list(owned), size=min(3, len(owned)), replace=False)
        got, slots = c.acquire(blocks=check, timeout_s=20)
        for blk, s in zip(got.tolist(), slots.tolist()):
            if not np.array_equal(c.slot_view(s).cpu().numpy(), pattern(owned[blk], salt, 4096)):
                print(f"MISMATCH block {blk}", flush=True)
                return 1
        c.release(blocks=got)
    c.close()
    print("ok", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
