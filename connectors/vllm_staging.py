"""Saving one batch of vLLM blocks to kvtier: staged in HBM slots, sealed under their hashes.

A batch is allocated pinned in the daemon's staging tier, each block's layers and hash
trailers written into its slot, then sealed (folding into a block another request saved
already), reported (segments, request features) and let go. Whatever fails, nothing is
left pinned or referenced: a refused seal releases and frees the staging blocks (they had
stayed pinned until the engine left), and a session the daemon reclaimed meanwhile is not
touched (its ids may be the new session's)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.client.replies import KvtierError, RequestRejected
from kvtier.client.tier_client import TierClient
from kvtier.protocol.wire import NO_SPACE

from .keys import block_keys, digests
from .kv_geometry import Geometry

log = logging.getLogger("kvtier.connectors.vllm")


@dataclass
class QueuedSave:
    req_id: str
    vid: int
    hash: Any
    seg: str
    since: float  # monotonic time it was queued
    cont: bool    # its request's features (the daemon's predictor class)
    span: int


def unref(client: TierClient, blocks: np.ndarray) -> None:
    """Drop one reference on each of ``blocks`` (a failure is logged: the daemon takes an
    engine's references back when it leaves)."""
    if blocks.size:
        try:
            client.free(blocks=blocks)
        except KvtierError as e:
            log.warning("kvtier: unreferencing blocks failed: %s", e)


def stage(client: TierClient, geo: Geometry, batch: list[QueuedSave], stats: dict[str, float]) -> bool:
    """Save ``batch``; True when it is done with (saved, or failed for good), False: no
    staging room yet (retry later)."""
    hbm = client.hbm
    if hbm is None:  # reclaimed: nothing to stage into until ``reattach``
        stats["save_dropped_blocks"] += len(batch)
        return True
    _, first = np.unique(block_keys([q.hash for q in batch]), return_index=True)
    if first.size < len(batch):  # one hash twice in a batch (identical prompts): saved once
        stats["save_dropped_blocks"] += len(batch) - first.size
        batch = [batch[i] for i in np.sort(first).tolist()]
    try:
        blocks, slots = client.alloc(len(batch), pin=True, wait=False)
    except KvtierError as e:
        if isinstance(e, RequestRejected) and e.code == NO_SPACE:
            return False
        log.warning("kvtier: no staging slots to save %d blocks (%s); they stay in vLLM only", len(batch), e)
        stats["save_dropped_blocks"] += len(batch)
        return True
    hashes = [q.hash for q in batch]
    segs = np.array([q.seg for q in batch])
    trailer = torch.from_numpy(digests(hashes))
    for i, (q, sl) in enumerate(zip(batch, slots.tolist())):
        row = hbm[int(sl)]
        for layer in range(len(geo.layers)):
            geo.save(layer, q.vid, row)
            geo.trailer(layer, row).copy_(trailer[i])
    geo.settle()  # every byte is in the slots before the daemon may move them
    session = client.session
    try:
        canon = client.seal(blocks, block_keys(hashes))
    except KvtierError as e:  # refused: the staging blocks are still ours, pinned and referenced
        log.warning("kvtier: saving %d blocks failed: %s", len(batch), e)
        stats["save_dropped_blocks"] += len(batch)
        if client.session == session and not client.reclaimed:  # else the daemon took them
            try:
                client.release(blocks=blocks)
            except KvtierError as e2:
                log.warning("kvtier: releasing unsaved staging blocks failed: %s", e2)
            unref(client, blocks)
        return True
    stats["saved_blocks"] += len(batch)
    try:
        client.release(blocks=canon[canon == blocks])  # a folded block's pins went with it
        for tag in sorted(set(segs.tolist())):
            client.report_segment(canon[segs == tag], tag)
        feats = [(q.cont, q.span) for q in batch]
        for cont, span in sorted(set(feats)):
            client.report_class(canon[[f == (cont, span) for f in feats]], cont, span)
    except KvtierError as e:
        log.warning("kvtier: after saving %d blocks: %s", len(batch), e)
    if client.session == session:
        unref(client, canon)  # one reference per sealed block, folded or not
    return True


__all__ = ["QueuedSave", "stage", "unref"]
