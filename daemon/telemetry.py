"""Telemetry ingestion: fire-and-forget reports from engines, applied in batches.

Attention mass updates the importance EMA and the policies' weights; segment
tags set a block's segment weight; class reports (does the request continue a
conversation, how many new blocks it adds) set a sealed block's predictor class;
access reports feed the policies' access log. A bad message is counted and dropped: telemetry never fails an engine.
A report names the session it was built in and the last request sent before it (``at``):
one of an earlier session is dropped, and ids that later requests let go of are skipped
(``DropLog``), since the id may name another block by the time the report is read.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError
from kvtier.tiers.types import FREE, OPEN

from .node import Node
from .session import EngineSession


def ingest(node: Node, counters: Counter[str], msg: Any, session: EngineSession) -> int:
    """One telemetry message of ``session``'s; returns block updates applied (bad ones are
    counted, not fatal). Only blocks the engine may see are touched: another namespace's
    importance, class and access log are not its to set."""
    if not isinstance(msg, dict) or msg.get("v") != P.VERSION:
        counters["telemetry_rejected"] += 1
        return 0
    try:
        blocks = node.ids(msg.get("blocks"), "blocks")
        t = node.mgr.table
        if blocks.size == 0 or np.any((blocks < 0) | (blocks >= t.max_blocks)):
            raise ProtocolError(P.BAD_REQUEST, "bad blocks")
        live = (t.state[blocks] != FREE) & node.mine(session, blocks)
        skip = _stale(session, msg.get("at"), blocks)
        if skip is None:
            counters["telemetry_stale"] += 1
            return 0
        live &= ~skip
        kind = msg.get("kind")
        if kind == "attention":
            mass = P.ids(msg.get("mass"), np.float32, node.max_batch_blocks, "mass")
            if mass.size != blocks.size or not np.all(np.isfinite(mass)) or np.any(mass < 0):
                raise ProtocolError(P.BAD_REQUEST, "bad mass")
            node.scores.report(blocks, mass, keep=live)  # shares and places over the whole report
            node.set_importance(blocks[live])
        elif kind == "segment":
            tag = msg.get("tag")
            if not isinstance(tag, str):
                raise ProtocolError(P.BAD_REQUEST, "bad tag")
            node.scores.tag(blocks[live], tag)
            node.set_importance(blocks[live])
        elif kind == "class":  # request features of sealed blocks: the predictor's class
            cont, span = msg.get("cont"), msg.get("span")
            if not isinstance(cont, bool) or not isinstance(span, int) or isinstance(span, bool) or span < 0:
                raise ProtocolError(P.BAD_REQUEST, "bad class features")
            node.placement.on_seal(blocks[live & (t.state[blocks] != OPEN)], cont, span)
        elif kind == "access":
            node.placement.log_access(blocks[live])
        else:
            raise ProtocolError(P.BAD_REQUEST, "unknown kind")
    except ProtocolError:
        counters["telemetry_rejected"] += 1
        return 0
    n = int(live.sum())
    counters["telemetry_block_updates"] += n
    return n


def _stale(session: EngineSession, at: Any, blocks: np.ndarray) -> "np.ndarray | None":
    """Which blocks a report built at ``at`` = [session tag, last request id sent] must skip;
    None: the whole report (another session's, or older than the drop log covers). A report
    without ``at`` (a client that does not stamp) skips nothing."""
    if at is None:
        return np.zeros(blocks.size, dtype=bool)
    if (not isinstance(at, list) or len(at) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in at)):
        raise ProtocolError(P.BAD_REQUEST, "bad at")
    if at[0] != session.tag:
        return None
    return session.drops.skip(at[1], blocks)


__all__ = ["ingest"]
