"""Namespaces: engines of different models or tenants never meet in one key space.

An engine registers into a namespace (a model name, optionally with a tenant or
cache salt: any string) with its blocks' geometry; one name with two geometries is
two namespaces. Inside the daemon a key is scoped to its namespace (by a value stable
across restarts, so a recovered block's key is its namespace's again)
(the default namespace "" keeps keys as they are, so a single-model node and
its KV events are unchanged); every block records its namespace and is found by
key, or named by id, only from its own namespace. HBM slots are zeroed before a
block of another namespace is allocated into them.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import xxhash

from kvtier.tiers.types import geometry_ident

MAX_NAMESPACES = (1 << 16) - 1  # the block column is uint16; its last value is ``UNCLAIMED_NS``
# (block_bytes, block_tokens, KV dtype or "") of the blocks a namespace holds: an fp16 and a bf16
# cache of one model have equal sizes and hold different bytes under equal keys
Geometry = tuple[int, int, str]
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


def scoped_keys(keys: np.ndarray, scope: int) -> np.ndarray:
    """Keys of a namespace as the daemon indexes them (``key_scope``; 0: unchanged)."""
    if scope == 0:
        return keys
    with np.errstate(over="ignore"):
        return _mix(keys.astype(np.uint64) ^ _mix(np.array([scope], dtype=np.uint64))[0])


def unscoped_keys(keys: np.ndarray, scope: "int | np.ndarray") -> np.ndarray:
    """The engines' keys of blocks indexed under ``scoped_keys`` (``scope`` per key or one for all):
    the remote tier names blocks by the key the engines sent, which every node shares."""
    keys = keys.astype(np.uint64)
    sc = np.broadcast_to(np.asarray(scope, dtype=np.uint64), keys.shape)
    with np.errstate(over="ignore"):
        out = _unmix(keys) ^ _mix(sc.copy())
    return np.where(sc == 0, keys, out)


def as_geometry(block_bytes: int, block_tokens: int, dtype: object = "") -> Geometry:
    """A geometry from register's arguments (``dtype``: the layout's, where the engine states one)."""
    return int(block_bytes), int(block_tokens), str(dtype or "")[:64]


def describe(g: Geometry) -> str:
    return f"{g[0]} bytes / {g[1]} tokens" + (f" / {g[2]}" if g[2] else "")


def owner_of(name: str, geometry: "Geometry") -> int:
    """A namespace's stable identity, written beside its blocks' NVMe copies (``tiers.ownership``):
    the same every run, whatever order engines register in (ids are not); top bit set, so it is
    never 0 (the library's default) nor ``ORPHAN_OWNER``."""
    ident = name.encode() + b"\0" + geometry_ident(geometry)
    return xxhash.xxh3_64_intdigest(ident) | (1 << 63)


def key_scope(name: str) -> int:
    """What a namespace's keys are mixed with: its name alone, stable across restarts (a
    recovered block's key is its namespace's key again) and across geometries (a vLLM
    scheduler finds its worker's blocks whatever size it computed). The default name keeps
    keys as engines send them, so a one-model node and its KV events are unchanged. A key
    two geometries of one name both seal is the first's block; the other's is kept out of
    the key index (``TierManager.seal``: "foreign"), never shared."""
    return 0 if name == "" else xxhash.xxh3_64_intdigest(name.encode()) | (1 << 63)


class Namespaces:
    """(namespace name, block geometry) -> small id, assigned at first use, for the life of the
    daemon. Engines register into a name (a model, optionally with a tenant or cache salt);
    engines of one name whose blocks have another geometry (bytes and tokens a block: another
    KV dtype, another TP split) get an id of their own, so their blocks never meet: a block
    found or folded by key is always one of the engine's own namespace id (keys are scoped by
    ``key_scope``, stable across restarts; ids are this run's own).
    One name with one id let a 4 KiB engine's ``ref`` hit a 2 KiB engine's block (its slot's
    tail stale) and a seal fold into it. The remote tier's tag binds the geometry too. vLLM's
    scheduler registers its rank's worker's geometry (``connectors.vllm.scheduler_geometry``),
    so the two share; one that differs would see no blocks (a warning at register says so)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[str, Optional[Geometry]], int] = {}
        self._names: list[str] = [""]  # by id; 0 is the default name's first geometry
        self._geometry: list[Optional[Geometry]] = [None]  # by id
        self._zero_taken = False
        # id -> the id of its name's first geometry: what a refs-only engine (a scheduler) matches
        # blocks by; UNCLAIMED_NS (the last value) maps to itself, which no engine's group is
        self.groups = np.full(MAX_NAMESPACES + 1, MAX_NAMESPACES, dtype=np.uint16)
        self._group_of_name: dict[str, int] = {}

    def id(self, name: str, geometry: Optional[Geometry] = None) -> int:
        """The id of ``name`` for blocks of ``geometry``. Id 0 goes to the default name's first
        geometry, whose keys stay as engines send them (a single-model node is unchanged)."""
        g = None if geometry is None else as_geometry(*geometry)
        got = self._ids.get((name, g))
        if got is not None:
            return got
        if name == "" and not self._zero_taken:
            got, self._zero_taken = 0, True
            self._geometry[0] = g
        else:
            if len(self._names) >= MAX_NAMESPACES:
                raise ValueError(f"more than {MAX_NAMESPACES} namespaces")
            got = len(self._names)
            self._names.append(name)
            self._geometry.append(g)
        self._ids[(name, g)] = got
        self.groups[got] = self._group_of_name.setdefault(name, got)
        return got

    def group(self, ns: int) -> int:
        """The id of ``ns``'s name's first geometry: every geometry of one name shares it."""
        return int(self.groups[ns])

    def name(self, ns: int) -> str:
        return self._names[ns]

    def geometry(self, ns: int) -> Optional[Geometry]:
        """The geometry of namespace ``ns``'s blocks (None where it was asked for without one)."""
        return self._geometry[ns]

    def others(self, name: str, geometry: Geometry) -> list[Geometry]:
        """Other geometries engines registered ``name`` with (their blocks are not shared)."""
        return [g for n, g in self._ids if n == name and g is not None and g != as_geometry(*geometry)]


__all__ = ["Namespaces", "Geometry", "as_geometry", "describe", "scoped_keys", "unscoped_keys", "owner_of", "key_scope",
           "MAX_NAMESPACES"]
