"""Telemetry ingestion: fire-and-forget reports from engines, applied in batches.

Attention mass updates the importance EMA and the policies' weights; segment
tags set a block's segment weight; access reports feed the policies' access
log. A bad message is counted and dropped: telemetry never fails an engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.tiers.types import FREE

from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError

if TYPE_CHECKING:
    from .service import Service


def ingest(svc: "Service", msg: Any) -> int:
    """One telemetry message; returns block updates applied (bad ones are counted, not fatal)."""
    if svc.mgr is None or not isinstance(msg, dict) or msg.get("v") != P.VERSION:
        svc.counters["telemetry_rejected"] += 1
        return 0
    try:
        blocks = P.ids(msg.get("blocks"), np.int64, svc.cfg.server.max_batch_blocks, "blocks")
        t = svc.mgr.table
        if blocks.size == 0 or np.any((blocks < 0) | (blocks >= t.max_blocks)):
            raise ProtocolError(P.BAD_REQUEST, "bad blocks")
        live = t.state[blocks] != FREE
        kind = msg.get("kind")
        if kind == "attention":
            mass = P.ids(msg.get("mass"), np.float32, svc.cfg.server.max_batch_blocks, "mass")
            if mass.size != blocks.size or not np.all(np.isfinite(mass)) or np.any(mass < 0):
                raise ProtocolError(P.BAD_REQUEST, "bad mass")
            svc.scores.report(blocks[live], mass[live])  # type: ignore[union-attr]
            apply_weights(svc, blocks[live])
        elif kind == "segment":
            tag = msg.get("tag")
            if not isinstance(tag, str):
                raise ProtocolError(P.BAD_REQUEST, "bad tag")
            svc.scores.tag(blocks[live], tag)  # type: ignore[union-attr]
            apply_weights(svc, blocks[live])
        elif kind == "access":
            svc.placement.log_access(blocks[live])  # type: ignore[union-attr]
        else:
            raise ProtocolError(P.BAD_REQUEST, "unknown kind")
    except ProtocolError:
        svc.counters["telemetry_rejected"] += 1
        return 0
    n = int(live.sum())
    svc.counters["telemetry_block_updates"] += n
    return n


def apply_weights(svc: "Service", blocks: np.ndarray) -> None:
    """Importance changed: refresh the table column and the policies' weights."""
    w = svc.scores.weight(blocks)  # type: ignore[union-attr]
    svc.mgr.table.importance[blocks] = svc.scores.score(blocks)  # type: ignore[union-attr]
    for pol in svc.placement.policies.values():  # type: ignore[union-attr]
        pol.set_weights(blocks, w)


__all__ = ["ingest", "apply_weights"]
