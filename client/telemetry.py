"""Where an engine finds the daemon's sockets, and the fire-and-forget telemetry it sends.

Telemetry (attention mass, segment tags, request features) goes over one PUSH socket,
apart from the RPC socket: it never waits for a reply and never blocks the engine (a full
queue drops the message), so it is its own piece of state with its own owner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

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
        if not isinstance(info, dict) or not isinstance(info.get("rpc"), str):  # torn or hand-edited
            raise DaemonUnavailable(f"the daemon info file in {runtime_dir} names no RPC endpoint "
                                    "(restart the daemon, or pass the endpoint)")
        return Endpoints(info["rpc"], info.get("telemetry"), info.get("events"))
    if "rpc.sock" not in endpoint:
        return Endpoints(endpoint, None, None)
    return Endpoints(endpoint, endpoint.replace("rpc.sock", "telemetry.sock"),
                     endpoint.replace("rpc.sock", "events.sock"))


class TelemetrySender:
    """One engine's telemetry socket, opened at the first report."""

    def __init__(self, ctx: "zmq.Context[zmq.Socket[bytes]]", endpoint: Optional[str], engine_id: str) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.engine_id = engine_id
        # each report's stamp: the daemon's tag of this session (None: no session) and its count
        # of block frees in the last reply before the report; it skips the ids freed since. A
        # report on ids the engine holds no reference on (looked up) goes right after the reply
        # that named them: a later reply's count may postdate their free.
        self.tag: Optional[int] = None
        self.freed = 0
        self._push: Optional[zmq.Socket] = None
        self.closed = False
        self.dropped = 0  # reports dropped for want of an endpoint
        self.unstamped = 0  # reports dropped for want of a session

    def send(self, kind: str, blocks: Any, **fields: Any) -> None:
        if self.closed:
            raise KvtierError("client is closed")
        if self.tag is None:  # no session (not registered, or reclaimed): the ids name nothing of ours
            self.unstamped += 1
            return
        msg = {"v": P.VERSION, "engine": self.engine_id, "kind": kind, "blocks": pack_ids(blocks),
               "at": [self.tag, self.freed], **fields}
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

    def start(self, tag: Optional[int]) -> None:
        """A session begins (its tag) or ends (None): a restarted daemon counts its frees afresh."""
        self.tag = None if tag is None else int(tag)
        if tag is None:
            self.freed = 0

    def saw(self, freed: Any) -> None:
        """A reply's free count (replies of several threads may come in any order: the largest)."""
        if isinstance(freed, int):
            self.freed = max(self.freed, freed)

    def close(self) -> None:
        self.closed = True
        if self._push is not None:
            self._push.close(0)
            self._push = None
