"""Where an engine finds the daemon's sockets, and the fire-and-forget telemetry it sends.

Telemetry (attention mass, segment tags, request features) goes over one PUSH socket,
apart from the RPC socket: it never waits for a reply and never blocks the engine (a full
queue drops the message), so it is its own piece of state with its own owner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgpack
import zmq

from kvtier.protocol import wire as P
from kvtier.protocol.runtime import read_info

from .replies import DaemonUnavailable, KvtierError, pack_ids

log = logging.getLogger("kvtier.client")


@dataclass(frozen=True)
class Endpoints:
    rpc: str
    telemetry: Optional[str]
    events: Optional[str]


def resolve_endpoints(endpoint: Optional[str], runtime_dir: str) -> Endpoints:
    """The daemon's RPC, telemetry and KV-event endpoints: from its runtime info file, or
    derived from an explicit ``ipc://…/rpc.sock`` (its siblings sit beside it)."""
    if endpoint is None:
        try:
            info = read_info(runtime_dir)
        except FileNotFoundError:
            raise DaemonUnavailable(f"no kvtier daemon in {runtime_dir} (start one with `kvtier serve`)") from None
        return Endpoints(info["rpc"], info.get("telemetry"), info.get("events"))
    if "rpc.sock" not in endpoint:
        return Endpoints(endpoint, None, None)
    return Endpoints(endpoint, endpoint.replace("rpc.sock", "telemetry.sock"),
                     endpoint.replace("rpc.sock", "events.sock"))


class TelemetrySender:
    """One engine's telemetry socket, opened at the first report."""

    def __init__(self, ctx: "zmq.Context[zmq.Socket[bytes]]", endpoint: Optional[str], engine_id: str,
                 stamp: Callable[[], Optional[list[int]]] = lambda: None) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.engine_id = engine_id
        self.stamp = stamp  # [session tag, last request sent] when a report is built (``daemon.drop_log``)
        self._push: Optional[zmq.Socket] = None
        self.closed = False
        self.dropped = 0  # reports dropped for want of an endpoint

    def send(self, kind: str, blocks: Any, **fields: Any) -> None:
        msg = {"v": P.VERSION, "engine": self.engine_id, "kind": kind, "blocks": pack_ids(blocks), **fields}
        at = self.stamp()
        if at is not None:
            msg["at"] = at
        if self.closed:
            raise KvtierError("client is closed")
        if self._push is None:
            if not self.endpoint:  # fire-and-forget: no endpoint drops it, never fails the engine
                if not self.dropped:
                    log.warning("kvtier: no telemetry endpoint known (an explicit RPC endpoint not named "
                                "rpc.sock): telemetry is dropped, placement goes without it")
                self.dropped += 1
                return
            self._push = self.ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.LINGER, 1000)
            self._push.setsockopt(zmq.SNDHWM, 10000)
            self._push.connect(self.endpoint)
        try:
            self._push.send(msgpack.packb(msg, use_bin_type=True), zmq.NOBLOCK)
        except zmq.Again:
            pass  # fire-and-forget: a full queue drops telemetry, never blocks the engine

    def close(self) -> None:
        self.closed = True
        if self._push is not None:
            self._push.close(0)
            self._push = None
