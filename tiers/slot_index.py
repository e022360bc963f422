"""Clean-stop slot index: a restart that reads one file instead of every slot header.

A manager that stops cleanly writes, beside its slab files, one small file that
lists every sealed slot (slot, key, length, checksum) and the store's write
sequence. The next start takes it instead of reading 4 KiB per slot, and deletes
it before anything new is written, so it never outlives the run that read it: a
crash leaves no index, and the start after it scans the slot headers as before.
An index is a hint, never trusted for bytes: every NVMe read is verified against
the block's checksum, so a wrong entry could only cost a miss.
"""

from __future__ import annotations

import logging
import os
import struct
from typing import Optional

import numpy as np

from kvtier.kernels.checksum import block_checksum

from .key_index import all_distinct
from .nvme import NvmeStore

INDEX_FILE = "slots.kvx"
MAGIC = b"KVTIDX01"
# 5: slabs of slot version 6 (keyed headers); 4: an owner per entry, slabs of slot version 5;
# 3: slot version 4 (headers in groups); 2: version 3
VERSION = 5
ENTRY = np.dtype([("slot", "<i8"), ("key", "<u8"), ("length", "<u8"), ("checksum", "<u8"), ("owner", "<u8")])
# magic, version, block_bytes, n_slots, slots_per_file, seq, entries, checksum of the entries
_HEAD = struct.Struct("<8sIQQQQQQ")
log = logging.getLogger("kvtier.nvme")


def index_path(store: NvmeStore) -> str:
    return os.path.join(store.directory, INDEX_FILE)


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_index(store: NvmeStore, entries: np.ndarray) -> None:
    """Atomically (temp file, fsync, rename, fsync of the directory) record ``entries``.
    Call it after the slabs are durable (``store.sync()``) and before closing them."""
    body = np.ascontiguousarray(entries, dtype=ENTRY).tobytes()
    head = _HEAD.pack(MAGIC, VERSION, store.block_bytes, store.n_slots, store.slots_per_file, store.seq,
                      len(entries), block_checksum(body))
    path = index_path(store)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(head)
        f.write(body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(store.directory)


def take_index(store: NvmeStore) -> Optional[np.ndarray]:
    """The entries a clean stop left for this store, or None (no index, or one that
    does not match the slabs' geometry or its checksum). The file is removed
    either way, and durably, before the store is written to again."""
    path = index_path(store)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    os.unlink(path)
    _fsync_dir(store.directory)
    why = _invalid(store, raw)
    if why:
        log.warning("%s ignored (%s): scanning the slot headers instead", path, why)
        return None
    seq, count = _HEAD.unpack_from(raw)[5:7]
    entries = np.frombuffer(raw, dtype=ENTRY, count=count, offset=_HEAD.size).copy()
    store.seq = max(store.seq, seq)  # new writes must outrank every slot on disk
    return entries


def _invalid(store: NvmeStore, raw: bytes) -> str:
    """Why ``raw`` cannot stand in for a scan of ``store``, or "" if it can."""
    if len(raw) < _HEAD.size:
        return "truncated"
    magic, version, block_bytes, n_slots, per_file, _, count, crc = _HEAD.unpack_from(raw)
    if magic != MAGIC:
        return "not a kvtier slot index"
    if version != VERSION:
        return f"index version {version}, this kvtier reads {VERSION}"
    if (block_bytes, n_slots, per_file) != (store.block_bytes, store.n_slots, store.slots_per_file):
        return "written for other slab geometry"
    body = raw[_HEAD.size:]
    if len(body) != count * ENTRY.itemsize or block_checksum(body) != crc:
        return "torn or corrupt"
    entries = np.frombuffer(body, dtype=ENTRY)
    slots, keys = entries["slot"], entries["key"]
    if slots.size and (slots.min() < 0 or slots.max() >= store.n_slots or not all_distinct(slots)):
        return "slot numbers out of range or repeated"
    if not all_distinct(keys):
        return "a key listed twice"
    return ""


__all__ = ["ENTRY", "INDEX_FILE", "index_path", "take_index", "write_index"]


def recovered_entries(store: NvmeStore, verify_payload: bool) -> tuple[np.ndarray, str, int]:
    """The sealed blocks a start finds on NVMe: (entries, "index" or "scan", slots
    discarded). The clean stop's index is taken (and deleted) in both modes, so it
    never outlives this run; it is used only when payloads need no verifying."""
    index = take_index(store)
    if index is not None and not verify_payload:
        return index, "index", 0
    found, discarded = store.recover(verify_payload=verify_payload)
    entries = np.array([(r.slot, r.header.key, r.header.length, r.header.checksum, r.header.owner) for r in found],
                       dtype=ENTRY)
    return entries, "scan", discarded


def sealed_entries(slots: np.ndarray, keys: np.ndarray, lengths: np.ndarray, checksums: np.ndarray,
                   owners: "np.ndarray | int" = 0) -> np.ndarray:
    """Index entries from parallel arrays (the blocks a clean stop describes)."""
    out = np.empty(slots.size, dtype=ENTRY)
    out["slot"], out["key"], out["length"], out["checksum"], out["owner"] = slots, keys, lengths, checksums, owners
    return out

