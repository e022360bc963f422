"""Keys >= 2**63 mixed with small ones reach the real daemon exactly (no float64 folding)."""

from __future__ import annotations


def test_large_and_small_keys_in_one_seal_stay_distinct(daemon):
    with daemon.client(heartbeat_s=None) as c:
        c.register(block_bytes=4096)
        a, _ = c.alloc(2, seq=1)
        b, _ = c.alloc(2, seq=2)
        assert c.seal(a, [0xE000000000000001, 7], seq=1).tolist() == a.tolist()
        # with float64 packing 0xE...02 rounded onto 0xE...01 and b[0] folded into a[0]
        assert c.seal(b, [0xE000000000000002, 8], seq=2).tolist() == b.tolist()
        assert c.ref([0xE000000000000001, 0xE000000000000002, 7, 8]).tolist() == [a[0], b[0], a[1], b[1]]
        c.check()
