"""Namespaces: engines of different models or tenants never meet in one key space.

An engine registers into a namespace (a model name, optionally with a tenant or
cache salt: any string). Inside the daemon a key is scoped to its namespace
(the default namespace "" keeps keys as they are, so a single-model node and
its KV events are unchanged); every block records its namespace and is found by
key, or named by id, only from its own namespace. HBM slots are zeroed before a
block of another namespace is allocated into them.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

MAX_NAMESPACES = 1 << 16  # the block column is uint16
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of 64-bit words, vectorised."""
    x = x.copy()
    x ^= x >> np.uint64(30)
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


_I1, _I2 = np.uint64(0x96DE1B173F119089), np.uint64(0x319642B2D24D8EC3)  # inverses of _M1, _M2 mod 2^64


def _unmix(x: np.ndarray) -> np.ndarray:
    """The inverse of ``_mix``."""
    x = x.copy()
    x ^= (x >> np.uint64(31)) ^ (x >> np.uint64(62))
    x *= _I2
    x ^= (x >> np.uint64(27)) ^ (x >> np.uint64(54))
    x *= _I1
    x ^= (x >> np.uint64(30)) ^ (x >> np.uint64(60))
    return x


def scoped_keys(keys: np.ndarray, ns: int) -> np.ndarray:
    """Keys of namespace ``ns`` as the daemon indexes them (``ns`` 0: unchanged)."""
    if ns == 0:
        return keys
    with np.errstate(over="ignore"):
        return _mix(keys.astype(np.uint64) ^ _mix(np.array([ns], dtype=np.uint64))[0])


def unscoped_keys(keys: np.ndarray, ns: "int | np.ndarray") -> np.ndarray:
    """The engines' keys of blocks indexed under ``scoped_keys`` (``ns`` per key or one for all).

    Namespace ids are this daemon's own; the remote tier names blocks by the key the
    engines sent and the namespace's name, which every node shares."""
    keys = keys.astype(np.uint64)
    ns_arr = np.broadcast_to(np.asarray(ns, dtype=np.uint64), keys.shape)
    with np.errstate(over="ignore"):
        out = _unmix(keys) ^ _mix(ns_arr.copy())
    return np.where(ns_arr == 0, keys, out)


Geometry = tuple[int, int]  # (block_bytes, block_tokens) of the blocks a namespace holds


class GeometryConflict(ValueError):
    """An engine registered into a namespace whose blocks have another size."""


class Namespaces:
    """Namespace name -> small id, assigned at first use, for the life of the daemon; and the
    block geometry each namespace's engines write. One geometry a namespace: a key names the
    same bytes for every engine that may read it, here and (through the remote tier's tag)
    on every node. Two engines of one namespace with different block sizes (an fp8 and a
    bf16 KV cache, another TP split) would otherwise read each other's blocks as their own."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {"": 0}
        self._geometry: dict[int, Geometry] = {}

    def id(self, name: str, geometry: Optional[Geometry] = None) -> int:
        """The id of ``name``; with ``geometry``, bound to it at first use and checked after
        (``GeometryConflict``, before anything is assigned)."""
        got = self._ids.get(name)
        if got is not None and geometry is not None and self._geometry.get(got, geometry) != geometry:
            bb, bt = self._geometry[got]
            raise GeometryConflict(f"namespace {name!r} holds blocks of {bb} bytes / {bt} tokens; an engine of "
                                   f"{geometry[0]} bytes / {geometry[1]} tokens needs a namespace of its own "
                                   "(name the model, KV dtype and tensor-parallel rank in it)")
        if got is None:
            if len(self._ids) >= MAX_NAMESPACES:
                raise ValueError(f"more than {MAX_NAMESPACES} namespaces")
            got = self._ids[name] = len(self._ids)
        if geometry is not None:
            self._geometry.setdefault(got, geometry)
        return got

    def geometry(self, ns: int) -> Optional[Geometry]:
        """The geometry namespace ``ns`` was bound to (None before an engine registered in it)."""
        return self._geometry.get(ns)

    def names(self) -> dict[int, str]:
        return {v: k for k, v in self._ids.items()}


__all__ = ["Namespaces", "GeometryConflict", "Geometry", "scoped_keys", "unscoped_keys", "MAX_NAMESPACES"]
