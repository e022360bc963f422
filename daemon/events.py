"""Block events in the shape of vLLM's KV events, for KV-aware routers.

vLLM (0.32) publishes ``KVEventBatch(ts, events, data_parallel_rank)`` over a
ZeroMQ PUB socket as three frames ``(topic, seq: 8-byte big-endian, payload)``:
the batch is an ``array_like`` msgspec struct, each event a tagged map
(``{"type": "BlockStored", "block_hashes": [...], "parent_block_hash": ...,
"token_ids": [...], "block_size": n, "lora_id": ..., "medium": ..., "lora_name": ...}``,
``{"type": "BlockRemoved", "block_hashes": [...], "medium": ...}``,
``{"type": "AllBlocksCleared"}``). We encode the same with msgpack, so vLLM's
own ``KVEventBatch`` decoder reads our stream. Media are vLLM's: ``GPU``, ``CPU``
and ``STORAGE`` (NVMe). Only sealed blocks have content keys; open blocks produce
no events. ``AllBlocksCleared`` is sent only when no block is left at all; a
clear that keeps live blocks sends their removals one by one instead.
"""

from __future__ import annotations

import time
from typing import Optional

import msgpack
import numpy as np

from kvtier.protocol import wire as P
from kvtier.tiers.manager import TierManager
from kvtier.tiers.types import SEALED, Tier

MEDIUM = {int(Tier.HBM): "GPU", int(Tier.DRAM): "CPU", int(Tier.NVME): "STORAGE"}


def _signed(key: int) -> int:
    """vLLM's ExternalBlockHash is a signed 64-bit int in msgpack."""
    return key - (1 << 64) if key >= 1 << 63 else key


class EventCollector:
    """Collects manager events between flushes and encodes them as one batch.

    Pending events are kept as runs ``(type, medium, keys)``: a move's blocks arrive
    as one array and stay one (a tuple per block had cost ~1 ms of the owner's time
    per 1,000 blocks moved, time the copy threads wanted on a host of two cores)."""

    def __init__(self, mgr: TierManager, block_tokens: int) -> None:
        self.mgr = mgr
        self.block_tokens = block_tokens
        self._runs: list[tuple[str, str, "list[int] | np.ndarray"]] = []
        mgr.listeners.append(self.on_event)
        mgr.batch_listeners[self.on_event] = self.on_events

    def _add(self, kind: str, medium: str, keys: "list[int] | np.ndarray") -> None:
        self._runs.append((kind, medium, keys))

    def _add_one(self, kind: str, medium: str, key: int) -> None:
        """One block's event: onto the last run where it is a list of the same type and medium."""
        if self._runs:
            last_kind, last_medium, keys = self._runs[-1]
            if last_kind == kind and last_medium == medium and isinstance(keys, list):
                keys.append(key)
                return
        self._runs.append((kind, medium, [key]))

    def on_event(self, kind: str, b: int, tier: int) -> None:
        t = self.mgr.table
        if t.state[b] != SEALED:
            return
        if t.detached[b] and t.lookup(int(t.key[b])) not in (-1, b):  # kept out of the index: the key's
            return  # events are the indexed block's (a router must not hear "removed" for a held key)
        key = _signed(int(t.key[b]))
        if kind == "stored":
            self._add_one("BlockStored", MEDIUM[tier], key)
        elif tier >= 0:
            self._add_one("BlockRemoved", MEDIUM[tier], key)
        else:  # the block leaves every tier it had a copy in
            copies = int(t.copies[b])
            for tr, medium in MEDIUM.items():
                if copies >> tr & 1:
                    self._add_one("BlockRemoved", medium, key)

    def on_events(self, kind: str, blocks: np.ndarray, tier: int) -> None:
        """``on_event`` for a move's blocks at once: the same events in the same order."""
        t = self.mgr.table
        sealed = t.state[blocks] == SEALED
        if not sealed.all():
            blocks = blocks[sealed]
        if tier < 0 or t.detached[blocks].any():  # rare: each block as ``on_event`` sees it
            for b in blocks.tolist():
                self.on_event(kind, b, tier)
            return
        if blocks.size:
            self._add("BlockStored" if kind == "stored" else "BlockRemoved", MEDIUM[tier],
                      t.key[blocks].view(np.int64))  # signed, as _signed; a copy (fancy indexing)

    def all_cleared(self) -> None:
        """Every block is gone: one AllBlocksCleared (the removals before it say the same)."""
        if not bool((self.mgr.table.state != 0).any()):
            self._add("AllBlocksCleared", "", [])

    @property
    def pending(self) -> list[tuple[str, int, str]]:
        """The pending events one by one, ``(type, key, medium)`` (for inspection)."""
        return [(kind, key, medium) for kind, medium, keys in self._runs
                for key in (keys.tolist() if isinstance(keys, np.ndarray) else keys or [0])]

    def take_batch(self) -> Optional[list]:
        """The pending events, in order, as a KVEventBatch array (None if there are none):
        consecutive runs of one type and medium are one event."""
        if not self._runs:
            return None
        events: list = []
        last: Optional[tuple[str, str]] = None
        for kind, medium, keys in self._runs:
            listed = keys.tolist() if isinstance(keys, np.ndarray) else keys
            if kind == "AllBlocksCleared":
                events.append({"type": "AllBlocksCleared"})
            elif (kind, medium) == last:
                events[-1]["block_hashes"].extend(listed)
            elif kind == "BlockStored":  # (a run's keys are this batch's own list from here: no copy)
                events.append({"type": "BlockStored", "block_hashes": listed, "parent_block_hash": None,
                               "token_ids": [], "block_size": self.block_tokens, "lora_id": None,
                               "medium": medium, "lora_name": None})
            else:
                events.append({"type": "BlockRemoved", "block_hashes": listed, "medium": medium})
            last = (kind, medium)
        self._runs.clear()
        return [time.time(), events, None]

    def close(self) -> None:
        if self.on_event in self.mgr.listeners:
            self.mgr.listeners.remove(self.on_event)
            self.mgr.batch_listeners.pop(self.on_event, None)


def encode_batch(batch: list) -> bytes:
    return P.pack(batch)


def decode_batch(payload: bytes) -> list:
    return msgpack.unpackb(payload, raw=False)


def seq_frame(seq: int) -> bytes:
    return int(seq).to_bytes(8, "big")


__all__ = ["EventCollector", "encode_batch", "decode_batch", "seq_frame", "MEDIUM"]
