"""``wire.pack``: the same bytes as ``msgpack.packb``, without a fresh 256 KiB buffer per frame."""

from __future__ import annotations

import threading
import tracemalloc

import msgpack
import numpy as np
import pytest

from kvtier.protocol import wire as P


def _frame(n: int = 128) -> dict:
    return {"v": 1, "id": 7, "op": "acquire", "engine": "e0", "args": {"blocks": P.id_bytes(np.arange(n))}}


def test_pack_gives_msgpacks_bytes_and_allocates_no_buffer_per_frame():
    obj = _frame()
    assert P.pack(obj) == msgpack.packb(obj, use_bin_type=True)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(10):
            P.pack(obj)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    # packb builds a packer with a 256 KiB buffer on every call: an mmap and its page
    # faults per request and reply once the daemon pins glibc's mmap threshold
    assert peak < 16 << 10, peak


def test_a_frame_that_cannot_be_packed_leaves_the_next_one_intact():
    with pytest.raises(TypeError):
        P.pack({"bad": object()})
    obj = _frame(3)
    assert msgpack.unpackb(P.pack(obj), raw=False) == obj


def test_threads_pack_concurrently_without_mixing_frames():
    out: dict[int, list[bytes]] = {}

    def work(k: int) -> None:
        out[k] = [P.pack({"k": k, "i": i, "pad": bytes([k]) * (i % 300)}) for i in range(2000)]

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, frames in out.items():
        assert [msgpack.unpackb(f, raw=False)["i"] for f in frames] == list(range(2000))
        assert all(msgpack.unpackb(f, raw=False)["k"] == k for f in frames)


def test_a_large_frame_does_not_keep_its_buffer():
    big = P.pack({"pad": b"x" * (P.PACKER_KEEP_BYTES + 1)})
    assert len(big) > P.PACKER_KEEP_BYTES
    assert getattr(P._packers, "packer", None) is None  # dropped: rebuilt small on the next frame
    assert msgpack.unpackb(P.pack(_frame(2)), raw=False) == _frame(2)
