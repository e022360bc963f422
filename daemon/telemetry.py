"""Telemetry ingestion: fire-and-forget reports from engines, applied in batches.

Attention mass updates the importance EMA and the policies' weights; segment
tags set a block's segment weight; class reports (does the request continue a
conversation, how many new blocks it adds) set a sealed block's predictor class;
access reports feed the policies' access log. A bad message is counted and dropped: telemetry never fails an engine.
Telemetry travels on its own socket, so a report can be read after the id it names was freed
and taken by another block (the engine's own next alloc, or another engine's). Each report is
stamped (``at``) with its session's tag and the daemon's count of frees from the last reply the
engine had when it built it: a report of another session is dropped, and ids freed since the
stamp (``BlockTable.freed_since``) are skipped. Blocks an engine lets go of that stay cached
are the same blocks, and still take their reports.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from kvtier.protocol import wire as P
from kvtier.protocol.wire import ProtocolError
from kvtier.tiers.block_table import BlockTable
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
        if blocks.size == 0 or ((blocks < 0) | (blocks >= t.max_blocks)).any():
            raise ProtocolError(P.BAD_REQUEST, "bad blocks")
        if np.unique(blocks).size != blocks.size:  # as every RPC op refuses: one block named twice
            raise ProtocolError(P.BAD_REQUEST, "bad blocks (repeated ids)")
        live = (t.state[blocks] != FREE) & node.mine(session, blocks)
        skip = _stale(t, session, msg.get("at"), blocks)
        if skip is None:
            counters["telemetry_stale"] += 1
            return 0
        skipped = int(np.count_nonzero(live & skip))
        live &= ~skip
        kind = msg.get("kind")
        if kind == "attention":
            mass = P.ids(msg.get("mass"), np.float32, node.max_batch_blocks, "mass")
            if mass.size != blocks.size or not np.isfinite(mass).all() or (mass < 0).any():
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
            live &= t.state[blocks] != OPEN  # an open block's class comes from its alloc: not counted
            node.placement.on_seal(blocks[live], cont, span)
        elif kind == "access":
            node.placement.log_access(blocks[live])
        else:
            raise ProtocolError(P.BAD_REQUEST, "unknown kind")
    except ProtocolError:
        counters["telemetry_rejected"] += 1
        return 0
    n = int(live.sum())
    counters["telemetry_block_updates"] += n
    counters["telemetry_skipped"] += skipped
    return n


def _stale(table: BlockTable, session: EngineSession, at: Any, blocks: np.ndarray) -> "np.ndarray | None":
    """Which blocks a report stamped ``at`` = [session tag, the daemon's free count then] must
    skip: those freed since. None: the whole report (another session's, a count this daemon
    has not reached, or one 2^31 frees old). Without ``at`` (a client that does not stamp)
    it skips nothing."""
    if at is None:
        return np.zeros(blocks.size, dtype=bool)
    if not isinstance(at, list) or len(at) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in at):
        raise ProtocolError(P.BAD_REQUEST, "bad at")
    tag, freed = at
    if freed < 0:
        raise ProtocolError(P.BAD_REQUEST, "bad at")
    if tag != session.tag or not 0 <= table.releases - freed < 1 << 31:
        return None
    return table.freed_since(blocks, freed)


__all__ = ["ingest"]
