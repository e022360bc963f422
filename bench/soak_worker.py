"""One soak engine process: random ops on the daemon, every byte checked (see ``soak.py``).

Blocks carry a pattern that is a function of their key alone, so a block any
engine reads back (its own, or a prefix another engine sealed first) is known
byte for byte. Outcomes: ``mismatches`` (a wrong byte served: must be 0),
``lost_live_blocks`` (a block this engine still holds vanished: must be 0),
``errors`` (requests refused for expected reasons: no room, deadline, a block
whose only copy the injected faults destroyed).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch

from kvtier.client.tier_client import KvtierError, RequestRejected, TierClient

BB = 16384
SHARED_KEYS = 32  # keys every engine seals with the same bytes: prefixes that fold
LOSS_CODES = {"invalid"}  # a held block that the daemon no longer knows
MAX_HELD = 40  # sequences one engine holds at most (4 engines: about half the tiers' slots)


def pattern(key: int) -> torch.Tensor:
    rng = np.random.default_rng(key & 0xFFFFFFFF)
    return torch.from_numpy(rng.integers(0, 256, size=BB, dtype=np.uint8))


def main() -> None:
    runtime_dir, idx, seconds, seed = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    rng = np.random.default_rng(seed * 1000 + idx)
    out: dict = {"engine": idx, "ops": 0, "mismatches": 0, "lost_live_blocks": 0, "errors": 0, "verified_blocks": 0,
                 "error_codes": {}}
    held: dict[int, tuple[list[int], list[int]]] = {}  # seq -> (blocks, keys)
    next_seq, next_key = 1, (idx + 1) << 40
    with TierClient(runtime_dir=runtime_dir, engine_id=f"soak-{idx}", heartbeat_s=1.0, timeout_s=20) as c:
        c.register(block_bytes=BB)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            op = rng.random()
            out["ops"] += 1
            try:
                if len(held) > MAX_HELD:
                    op = 1.0  # stay within a working set the tiers can hold
                if op < 0.35 or not held:  # a new sequence of 1-4 blocks
                    n = int(rng.integers(1, 5))
                    blocks, slots = c.alloc(n, seq=next_seq, pin=True)
                    keys = []
                    for s in slots.tolist():
                        if rng.random() < 0.3:
                            k = int(rng.integers(1, SHARED_KEYS + 1))
                        else:
                            k, next_key = next_key, next_key + 1
                        keys.append(k)
                        c.slot_view(s)[:] = pattern(k)
                    sealed = c.seal(blocks, keys, seq=next_seq)
                    still_pinned = [int(x) for x, b in zip(sealed, blocks) if x == b]  # folded ones came unpinned
                    if still_pinned:
                        c.release(blocks=still_pinned)
                    held[next_seq] = (sealed.tolist(), keys)
                    next_seq += 1
                elif op < 0.8:  # read a held sequence back and check every byte
                    seq = int(rng.choice(list(held)))
                    held_blocks, keys = held[seq]
                    got, slots = c.acquire(seqs=[seq], timeout_s=10)
                    by_block = dict(zip(got.tolist(), slots.tolist()))
                    try:
                        for b, k in zip(held_blocks, keys):
                            if not torch.equal(c.slot_view(by_block[b]), pattern(k)):
                                out["mismatches"] += 1
                            out["verified_blocks"] += 1
                    finally:
                        c.release(seqs=[seq])
                else:  # let a sequence go
                    seq = int(rng.choice(list(held)))
                    c.free(seqs=[seq])
                    held.pop(seq)
            except RequestRejected as e:
                if e.code in LOSS_CODES and "unknown" in e.message:
                    out["lost_live_blocks"] += 1
                out["errors"] += 1
                out["error_codes"][e.code] = out["error_codes"].get(e.code, 0) + 1
                if len(out.setdefault("error_samples", [])) < 5:
                    out["error_samples"].append(str(e)[:160])
            except KvtierError as e:
                out["errors"] += 1
                out["error_codes"][type(e).__name__] = out["error_codes"].get(type(e).__name__, 0) + 1
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
