"""Block keys from engine block hashes, and the digest that makes a 64-bit key safe.

vLLM names a full block by a chained hash (bytes, sha256-based by default). kvtier
indexes 64-bit keys, so two distinct hashes may share a key (with probability
~n^2/2^65). They are never folded into one served block: every block kvtier holds
for an engine carries the engine's full hash in a trailer written beside each
layer's bytes (``DIGEST_BYTES`` per layer), and a load compares the trailer with
the hash the engine asked for; a mismatch is a miss (the engine recomputes), never
a wrong byte. Integer hashes (older vLLM, SGLang) in [0, 2**64) are their own key.
"""

from __future__ import annotations

import hashlib
from typing import Iterable, Union

import numpy as np

BlockHash = Union[bytes, int]
DIGEST_BYTES = 64  # trailer per layer part: 1 length byte, then the hash (or its sha256 if longer than 63)
_U64 = (1 << 64) - 1


def hash_bytes(h: BlockHash) -> bytes:
    """The exact identity of a block hash as bytes (ints: 8 bytes big-endian)."""
    if isinstance(h, (bytes, bytearray, memoryview)):
        return bytes(h)
    if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
        raise ValueError(f"a block hash is bytes or an int, got {type(h).__name__}")
    v = int(h)
    if not 0 <= v <= _U64:
        raise ValueError(f"an integer block hash must lie in [0, 2**64), got {v}")
    return v.to_bytes(8, "big")


def block_key(h: BlockHash) -> int:
    """The 64-bit kvtier key of one block hash: an int is itself; bytes are folded by blake2b."""
    if not isinstance(h, (bytes, bytearray, memoryview)):
        return int.from_bytes(hash_bytes(h), "big")
    return int.from_bytes(hashlib.blake2b(bytes(h), digest_size=8).digest(), "little")


def block_keys(hashes: Iterable[BlockHash]) -> np.ndarray:
    """Keys of many hashes, exact uint64 (never through float64)."""
    ks = [block_key(h) for h in hashes]
    return np.array(ks, dtype=np.uint64) if ks else np.zeros(0, dtype=np.uint64)


def digest(h: BlockHash) -> bytes:
    """The trailer stored with the block: the full hash, so a hit can be verified."""
    raw = hash_bytes(h)
    if len(raw) > DIGEST_BYTES - 1:
        raw = hashlib.sha256(raw).digest()
    return bytes([len(raw)]) + raw + bytes(DIGEST_BYTES - 1 - len(raw))


def digests(hashes: Iterable[BlockHash]) -> np.ndarray:
    """Trailers of many hashes as a [n, DIGEST_BYTES] uint8 array."""
    rows = [np.frombuffer(digest(h), dtype=np.uint8) for h in hashes]
    return np.stack(rows) if rows else np.zeros((0, DIGEST_BYTES), dtype=np.uint8)


__all__ = ["BlockHash", "DIGEST_BYTES", "hash_bytes", "block_key", "block_keys", "digest", "digests"]
