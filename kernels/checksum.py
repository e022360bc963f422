"""Block checksums: one 64-bit value, computed where the bytes are.

The value is defined so that it vectorises both in numpy (host bytes) and in
plain torch ops (device bytes: a seal or a GPUDirect read on a CUDA pool never
copies a block to the host to check it; only the 8-byte sum comes back)::

    w_i = buf[:length], zero-padded to a multiple of 8 bytes, as little-endian u64 words
    m_i = (2i + 1) * P                  odd, so each word's term is a bijection of the word
    x_i = w_i * m_i;  x_i ^= x_i >> 32;  x_i *= C
    s   = sum of x_i                     (all arithmetic mod 2**64)
    h   = fmix64(s ^ fmix64(length + K))

A change confined to one 8-byte word always changes the value; the position
multiplier catches moved words and the length catches truncation to zeros.
It replaced xxh3 (which cannot run as torch ops): NVMe slots written with the
old value carry an older header version and are discarded at recovery.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

try:  # the one-pass C loop (kernels/_checksum.c); without a compiler at install, numpy
    from kvtier.kernels._checksum import sum_terms as _c_sum_terms
except ImportError:  # pragma: no cover - exercised where the extension was not built
    _c_sum_terms = None

M64 = (1 << 64) - 1
P = 0x9E3779B97F4A7C15
C = 0xD6E8FEB86659FD93
K = 0x27D4EB2F165667C5
CHUNK_WORDS = 1 << 15  # numpy pass size: scratch stays in L2, and reused (fresh arrays page-fault)


def _signed(v: int) -> int:
    """A u64 constant as the int64 torch multiplies by (same bits)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def fmix64(h: int) -> int:
    """murmur3's 64-bit finaliser (Python ints)."""
    h ^= h >> 33
    h = (h * 0xFF51AFD7ED558CCD) & M64
    h ^= h >> 33
    h = (h * 0xC4CEB9FE1A85EC53) & M64
    return h ^ (h >> 33)


def _finish(s: int, length: int) -> int:
    return fmix64((s & M64) ^ fmix64((length + K) & M64))


def _mix_word(w: int, i: int) -> int:
    """One word's term x_i (Python ints): the tail word of a length not a multiple of 8."""
    x = (w * (((2 * i + 1) * P) & M64)) & M64
    x ^= x >> 32
    return (x * C) & M64


# -- numpy (host bytes) ----------------------------------------------------------------
_np_mult = np.empty(0, dtype=np.uint64)
_grow = threading.Lock()
_tls = threading.local()


def _np_multipliers(n: int) -> np.ndarray:
    """m_i for i < n, from one cached array grown to the largest block seen."""
    global _np_mult
    m = _np_mult
    if m.size < n:
        with _grow:
            m = _np_mult
            if m.size < n:
                size = 1 << max(12, (n - 1).bit_length())
                m = (np.arange(size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)) * np.uint64(P)
                _np_mult = m
    return m[:n]


def _np_scratch() -> tuple[np.ndarray, np.ndarray]:
    s = getattr(_tls, "scratch", None)
    if s is None:
        s = _tls.scratch = (np.empty(CHUNK_WORDS, dtype=np.uint64), np.empty(CHUNK_WORDS, dtype=np.uint64))
    return s


def checksum_numpy(data: np.ndarray, length: int | None = None) -> int:
    """The reference: ``data`` is a contiguous uint8 array (any alignment)."""
    return _checksum_host(data, length, None)


def checksum_host(data: np.ndarray, length: int | None = None) -> int:
    """Same value as ``checksum_numpy``, by the compiled one-pass loop where it was
    built (about 3x numpy's speed, GIL released), else by numpy."""
    return _checksum_host(data, length, _c_sum_terms)


def _checksum_host(data: np.ndarray, length: int | None, c_loop: Any) -> int:
    b = data if length is None else data[:length]
    length = int(b.size)
    n = length // 8
    s = 0
    if n and c_loop is not None:
        s = c_loop(b, n) * C
    elif n:
        words = b[: n * 8].view("<u8")
        mult = _np_multipliers(n)
        x, t = _np_scratch()
        for lo in range(0, n, CHUNK_WORDS):
            k = min(CHUNK_WORDS, n - lo)
            xx, tt = x[:k], t[:k]
            np.multiply(words[lo: lo + k], mult[lo: lo + k], out=xx)
            np.right_shift(xx, np.uint64(32), out=tt)
            np.bitwise_xor(xx, tt, out=xx)
            s += int(xx.sum(dtype=np.uint64))
        s *= C  # sum(x_i * C) = C * sum(x_i) mod 2**64: one pass over the words fewer
    if length % 8:
        tail = np.zeros(8, dtype=np.uint8)
        tail[: length % 8] = b[n * 8:]
        s += _mix_word(int(tail.view("<u8")[0]), n)
    return _finish(s, length)


# -- torch (device bytes; runs on CPU tensors too, for the tests) ---------------------
_t_mult: dict[torch.device, torch.Tensor] = {}


def _torch_multipliers(n: int, device: torch.device) -> torch.Tensor:
    m = _t_mult.get(device)
    if m is None or m.numel() < n:
        size = 1 << max(12, (n - 1).bit_length())
        m = (torch.arange(size, dtype=torch.int64, device=device) * 2 + 1) * _signed(P)
        _t_mult[device] = m  # a race only builds the same values twice
    return m[:n]


def _torch_terms(words: torch.Tensor, first: int) -> torch.Tensor:
    """x_i / C of int64 ``words`` at positions first.. (int64 wraps like u64; >> is
    arithmetic in torch, so the shifted-in bits are masked off). The factor C is
    applied once to the sum by the caller (multiplication distributes mod 2**64)."""
    x = words * _torch_multipliers(first + words.numel(), words.device)[first:]
    x ^= (x >> 32) & 0xFFFFFFFF
    return x


def checksum_torch(t: torch.Tensor, length: int | None = None) -> int:
    """Same value as ``checksum_numpy`` for the same bytes, as torch ops on ``t``'s
    device: no copy of the block to the host, one 8-byte result read back."""
    flat = (t if t.is_contiguous() else t.contiguous()).reshape(-1).view(torch.uint8)
    b = flat if length is None else flat[:length]
    length = int(b.numel())
    n = length // 8
    total = torch.zeros((), dtype=torch.int64, device=b.device)
    if n:
        body = b[: n * 8]
        if body.storage_offset() % 8:  # words need 8-byte alignment: an odd view is copied (on the device)
            body = body.clone()
        total += _torch_terms(body.view(torch.int64), 0).sum()
    if length % 8:
        tail = torch.zeros(8, dtype=torch.uint8, device=b.device)
        tail[: length % 8] = b[n * 8:]
        total += _torch_terms(tail.view(torch.int64), n).sum()
    return _finish((int(total.item()) * C) & M64, length)


def block_checksum(buf: Any, length: int | None = None) -> int:
    """64-bit checksum of ``buf[:length]`` (numpy array, bytes, or tensor). A device
    tensor is checked on its device; host bytes with numpy."""
    if isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            return checksum_torch(buf, length)
        buf = (buf if buf.is_contiguous() else buf.contiguous()).reshape(-1).view(torch.uint8).numpy()
    if isinstance(buf, np.ndarray):
        arr = buf.reshape(-1).view(np.uint8)
    else:
        arr = np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8)
    return checksum_host(arr, length)


__all__ = ["block_checksum", "checksum_host", "checksum_numpy", "checksum_torch", "fmix64"]
