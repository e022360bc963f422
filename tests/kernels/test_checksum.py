"""Block checksum: the torch implementation (what a CUDA pool runs on its device)
gives exactly the numpy reference's value for the same bytes."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from kvtier.kernels import checksum as checksum_mod
from kvtier.kernels.checksum import (
    CHUNK_WORDS,
    M64,
    C,
    K,
    P,
    block_checksum,
    checksum_host,
    checksum_numpy,
    checksum_torch,
    fmix64,
)

LENGTHS = [0, 1, 2, 7, 8, 9, 15, 16, 17, 31, 63, 64, 65, 255, 4095, 4096, 4097, 8 * CHUNK_WORDS - 3,
           8 * CHUNK_WORDS, 8 * CHUNK_WORDS + 5, 3 * 8 * CHUNK_WORDS + 12345]


def _same_on(device: str) -> None:
    rng = np.random.default_rng(11)
    for n in LENGTHS:
        raw = rng.integers(0, 256, n + 24, dtype=np.uint8)
        dev = torch.from_numpy(raw).to(device)
        for off in (0, 1, 3, 8, 13):  # views at offsets: aligned and not
            ref = checksum_numpy(raw[off: off + n])
            assert checksum_torch(dev[off: off + n]) == ref, (n, off)
            assert checksum_torch(dev[off:], n) == ref, (n, off)  # a length shorter than the buffer
            assert block_checksum(dev[off: off + n]) == ref, (n, off)


def test_torch_equals_numpy_reference_on_cpu_tensors():
    _same_on("cpu")


def test_compiled_loop_is_built_where_a_compiler_exists():
    """The install builds kernels/_checksum.c (optional: without a compiler numpy
    serves); a silent build failure would cost verified NVMe reads a third of
    their speed on a small node, so it fails here."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler: the numpy checksum serves")
    assert checksum_mod._c_sum_terms is not None


def test_compiled_loop_equals_numpy_reference():
    if checksum_mod._c_sum_terms is None:
        pytest.skip("the compiled checksum was not built")
    rng = np.random.default_rng(13)
    for n in LENGTHS:
        raw = rng.integers(0, 256, n + 24, dtype=np.uint8)
        for off in (0, 1, 3, 8, 13):
            assert checksum_host(raw[off: off + n]) == checksum_numpy(raw[off: off + n]), (n, off)
            assert checksum_host(raw[off:], n) == checksum_numpy(raw[off:], n), (n, off)
    with pytest.raises(ValueError, match="do not fit"):
        checksum_mod._c_sum_terms(bytes(15), 2)  # more words than the buffer holds: refused, not read past
    with pytest.raises(ValueError, match="do not fit"):
        checksum_mod._c_sum_terms(bytes(16), -1)


def _spec(data: bytes) -> int:
    """The module docstring's definition, word by word in Python ints."""
    padded = data + bytes(-len(data) % 8)
    s = 0
    for i in range(len(padded) // 8):
        x = int.from_bytes(padded[8 * i: 8 * i + 8], "little") * ((2 * i + 1) * P % (1 << 64)) % (1 << 64)
        x ^= x >> 32
        s = (s + x * C) % (1 << 64)
    return fmix64(s ^ fmix64((len(data) + K) & M64))


def test_numpy_reference_follows_the_definition():
    rng = np.random.default_rng(12)
    for n in (0, 1, 5, 8, 13, 64, 1001):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert checksum_numpy(np.frombuffer(data, np.uint8)) == _spec(data)


def test_every_input_kind_gives_the_same_value():
    data = np.random.default_rng(3).integers(0, 256, 10_007, dtype=np.uint8)
    want = checksum_numpy(data)
    assert block_checksum(data) == want
    assert block_checksum(data.tobytes()) == want
    assert block_checksum(memoryview(data.tobytes())) == want
    assert block_checksum(torch.from_numpy(data.copy())) == want
    padded = np.concatenate([data, np.arange(9, dtype=np.uint8)])
    assert block_checksum(padded, data.size) == want
    f32 = np.random.default_rng(4).standard_normal(1000).astype(np.float32)  # typed: its bytes count
    assert block_checksum(torch.from_numpy(f32)) == block_checksum(f32) == checksum_numpy(f32.view(np.uint8))
    strided = torch.from_numpy(data.copy())[::2]  # a non-contiguous tensor: its elements, in order
    assert block_checksum(strided) == checksum_numpy(data[::2].copy())


def test_frozen_values():
    """NVMe slot headers store these: a change of algorithm must bump slot_header.VERSION."""
    assert block_checksum(b"") == 0xACB65BC0832C5445
    assert block_checksum(bytes(range(256)) * 3 + b"kv") == 0x3130CBE5A002EC57


def test_detects_word_changes_moves_and_truncation():
    rng = np.random.default_rng(5)
    data = rng.integers(0, 256, 65_536, dtype=np.uint8)
    base = block_checksum(data)
    for _ in range(200):  # any change inside one 8-byte word is always caught
        bad = data.copy()
        i = int(rng.integers(0, data.size))
        bad[i] ^= np.uint8(1 << int(rng.integers(0, 8)))
        assert block_checksum(bad) != base
    top = data.copy().view(np.uint64)  # the top bit of two words: a plain sum would cancel these
    top[[3, 900]] ^= np.uint64(1 << 63)
    assert block_checksum(top) != base
    swapped = data.copy().view(np.uint64)
    swapped[[10, 20]] = swapped[[20, 10]]
    assert block_checksum(swapped) != base
    zeros = np.zeros(4096, np.uint8)
    assert block_checksum(zeros) != block_checksum(zeros[:4088]) != block_checksum(zeros[:0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_checksum_equals_reference_without_a_host_copy(monkeypatch):
    _same_on("cuda")
    import kvtier.kernels.checksum as ck

    def no_host(*a: object, **k: object) -> int:
        raise AssertionError("a device tensor was checksummed on the host")

    monkeypatch.setattr(ck, "checksum_numpy", no_host)
    slot = torch.randint(0, 256, (2 << 20,), dtype=torch.uint8, device="cuda")
    assert ck.block_checksum(slot, (2 << 20) - 100) == checksum_numpy(slot.cpu().numpy()[: (2 << 20) - 100])
