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


class Namespaces:
    """Namespace name -> small id, assigned at first use, for the life of the daemon; and the
    geometry of the blocks each namespace holds: the widest ``block_bytes`` an engine registered
    into it with (and that engine's tokens a block). The remote tier's tag binds it, so nodes
    whose engines write blocks of other sizes under one namespace name never read each other's
    values (a 4 KiB node was served a 2 KiB node's value as a hit, its slot's tail stale). The
    widest, not the first: vLLM's scheduler registers into its rank's namespace with a smaller
    size than the workers that write the blocks, in either order, and only refs."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {"": 0}
        self._names: list[str] = [""]  # by id
        self._geometry: dict[int, Geometry] = {}

    def id(self, name: str, geometry: Optional[Geometry] = None) -> int:
        """The id of ``name``; ``geometry``, an engine's, widens the namespace's."""
        got = self._ids.get(name)
        if got is None:
            if len(self._ids) >= MAX_NAMESPACES:
                raise ValueError(f"more than {MAX_NAMESPACES} namespaces")
            got = self._ids[name] = len(self._ids)
            self._names.append(name)
        if geometry is not None and geometry[0] > self._geometry.get(got, (0, 0))[0]:
            self._geometry[got] = (int(geometry[0]), int(geometry[1]))
        return got

    def name(self, ns: int) -> str:
        return self._names[ns]

    def geometry(self, ns: int) -> Optional[Geometry]:
        """The geometry of namespace ``ns``'s blocks (None before an engine registered in it)."""
        return self._geometry.get(ns)


__all__ = ["Namespaces", "Geometry", "scoped_keys", "unscoped_keys", "MAX_NAMESPACES"]
