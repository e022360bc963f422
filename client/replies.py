"""What a ``TierClient`` call returns or raises: errors, packed ids and keys, async acquires.

Kept apart from the client's RPC machinery so the engine adapters and tests
can use them on their own. Keys are packed as exact uint64 (never through a
float64 array); ids as little-endian int64.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np

from kvtier.protocol import wire as P

Call = Callable[[str, dict], dict]  # one RPC: (op, args) -> result


class KvtierError(RuntimeError):
    pass


class DaemonUnavailable(KvtierError):
    pass


class RequestTimeout(KvtierError):
    pass


class RequestRejected(KvtierError):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class EngineReclaimed(RequestRejected):
    """The daemon judged this engine gone (silent too long) and took back its blocks.

    The client stops: its HBM mapping is dropped, so nothing more is written into
    slots that may belong to another engine now, and every later call raises this.
    Register a new client to start over."""


_U64_MAX = (1 << 64) - 1


def pack_keys(x: Any) -> Optional[bytes]:
    """Content keys as exact little-endian uint64 bytes (None stays None).

    Never through ``np.asarray`` of a Python list: a list mixing keys >= 2**63
    with smaller ones becomes float64 there and loses low bits, so two distinct
    keys fold into one block. A Python int must lie in [0, 2**64); a negative,
    too large or non-integer key raises ValueError instead of wrapping or
    rounding. Numpy integers are taken as 64-bit patterns: an int64 array is the
    signed view of uint64 keys (as vLLM's block hashes and our KV events are),
    which is lossless."""
    if x is None:
        return None
    if isinstance(x, np.ndarray) and x.dtype.kind in "iu":
        arr = x.reshape(-1)
        if arr.dtype.kind == "i":
            arr = arr.astype(np.int64).view(np.uint64)
        return np.ascontiguousarray(arr, dtype="<u8").tobytes()
    if isinstance(x, np.ndarray):
        if x.dtype != object:
            raise ValueError(f"keys must be integers, got a {x.dtype} array")
        items: Any = x.reshape(-1).tolist()
    elif isinstance(x, (int, np.integer, float, np.floating, str, bytes)):
        items = [x]
    else:
        items = list(x)
    vals: list[int] = []
    for v in items:
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"key {v!r} is not an integer; keys are uint64")
        if isinstance(v, np.signedinteger):
            v = int(np.int64(v).view(np.uint64))  # a 64-bit pattern, as for int64 arrays
        v = int(v)
        if not 0 <= v <= _U64_MAX:
            raise ValueError(f"key {v} is outside [0, 2**64)")
        vals.append(v)
    return np.array(vals, dtype="<u8").tobytes()


def pack_ids(x: Any, dtype: type = np.int64) -> Optional[bytes]:
    """Block ids (int64) or, with ``dtype=np.uint64``, keys (exact: see ``pack_keys``)."""
    if np.dtype(dtype) == np.uint64:
        return pack_keys(x)
    return None if x is None else P.id_bytes(np.asarray(x).reshape(-1), dtype)


def unpack_ids(b: bytes, dtype: type = np.int64) -> np.ndarray:
    return np.frombuffer(b, dtype=np.dtype(dtype).newbyteorder("<")).astype(dtype)


class AcquireHandle:
    """A non-blocking acquire: poll readiness per block, compute on what is ready."""

    def __init__(self, call: Call, reply: dict, blocks_hint: int) -> None:
        self.call = call  # the client's RPC
        self.ticket = reply["ticket"]
        self._last = reply
        self.n = blocks_hint
        self.layers = int(reply.get("layers", 1))

    @property
    def done(self) -> bool:
        return bool(self._last.get("done"))

    def poll(self) -> np.ndarray:
        """Boolean readiness per requested block (in request order, unique-sorted)."""
        if not self.done:
            self._last = self.call("acquire_poll", {"ticket": self.ticket})
        if self.done:
            return np.ones(len(self._last["blocks"]) // 8, dtype=bool)
        return np.frombuffer(self._last["ready"], dtype=bool).copy()

    def layers_ready(self) -> tuple[np.ndarray, np.ndarray]:
        """(layers landed per block, HBM slot per block or -1): layer l of a block may be
        read from its slot once layers_ready > l, while later layers are still arriving."""
        self.poll()
        if self.done:
            n = len(self._last["blocks"]) // 8
            return np.full(n, self.layers, dtype=np.int64), unpack_ids(self._last["slots"])
        self.layers = int(self._last.get("layers", 1))
        return unpack_ids(self._last["layers_ready"]), unpack_ids(self._last["slots"])

    def wait(self, timeout_s: Optional[float] = None, interval_s: float = 0.0005) -> tuple[np.ndarray, np.ndarray]:
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done:
            self.poll()
            if self.done:
                break
            if end is not None and time.monotonic() > end:
                raise RequestTimeout(f"acquire ticket {self.ticket} not ready after {timeout_s} s")
            time.sleep(interval_s)
        return unpack_ids(self._last["blocks"]), unpack_ids(self._last["slots"])


__all__ = ["KvtierError", "DaemonUnavailable", "RequestTimeout", "RequestRejected", "EngineReclaimed",
           "AcquireHandle", "pack_keys"]
