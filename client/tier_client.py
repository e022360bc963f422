"""``TierClient``: the engine-side library of the kvtier daemon.

One DEALER socket for RPC (guarded by a lock, so engine threads may share a
client), one PUSH socket for fire-and-forget telemetry, and a heartbeat
thread on its own socket. Block ids and keys travel as packed arrays. Errors:
``DaemonUnavailable`` (no daemon, or it went away), ``RequestTimeout`` and
``RequestRejected`` (with the daemon's error code). A request that changes what the
engine holds and gets no reply ends the session on the client's side: the daemon may
still carry it out, so the next call raises ``EngineReclaimed`` until ``reattach`` (or
``register``) starts a new session, which takes back everything the old one held.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Optional, Sequence, TypeAlias

import msgpack
import numpy as np
import zmq

from kvtier.protocol import wire as P
from kvtier.protocol.runtime import default_runtime_dir, ipc_unreachable, pid_namespace, read_token
from kvtier.protocol.shm import release_shm

from .region import map_daemon_region
from .replies import (
    AcquireHandle,
    DaemonUnavailable,
    EngineReclaimed,
    KvtierError,
    RequestRejected,
    RequestTimeout,
    pack_ids,
    pack_keys,
    unpack_ids,
)
from .telemetry import TelemetrySender, resolve_endpoints

log = logging.getLogger("kvtier.client")

# requests that change what an engine holds (a poll that completes an acquire hands its pins to
# the session): one whose reply is lost leaves the session unknown
SESSION_OPS = frozenset({"alloc", "seal", "ref", "free", "acquire", "acquire_poll", "release"})

if TYPE_CHECKING:  # torch is loaded when a region is mapped, so the CLI and a stats call never pay for it
    from multiprocessing.shared_memory import SharedMemory

    import torch

ArrayLike: TypeAlias = "np.ndarray | Sequence[int]"


class TierClient:
    def __init__(self, endpoint: Optional[str] = None, runtime_dir: Optional[str] = None,
                 engine_id: Optional[str] = None, timeout_s: float = 30.0, heartbeat_s: Optional[float] = 2.0,
                 lease_size: int = 16) -> None:
        self.runtime_dir = runtime_dir or default_runtime_dir()
        self.engine_id = engine_id or f"engine-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.timeout_s = timeout_s
        ends = resolve_endpoints(endpoint, self.runtime_dir)
        endpoint, self.telemetry_endpoint, self.events_endpoint = ends.rpc, ends.telemetry, ends.events
        if (why := ipc_unreachable(endpoint)) is not None:  # at once, not after timeout_s
            raise DaemonUnavailable(why)
        self.endpoint = endpoint
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock = self._dealer()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self.telemetry = TelemetrySender(self.ctx, self.telemetry_endpoint, self.engine_id)
        self._lease: list[int] = []
        self._lease_slot: dict[int, int] = {}
        self.lease_size = lease_size
        self.info: dict = {}
        self.reclaimed = ""  # why, once the daemon took this engine's blocks back
        self._registration: dict[str, Any] = {}  # the last register's arguments (``reattach``)
        self.session = 0  # counts registers: what a session's handles check before they call
        self._next_reattach = 0.0
        self.hbm: Optional["torch.Tensor"] = None
        self._shm: Optional[SharedMemory] = None
        self._hb_stop = threading.Event()
        self._hb_thread: Optional[threading.Thread] = None
        self.heartbeat_s = heartbeat_s
        self.closed = False

    def _dealer(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(self.endpoint)
        return s

    # -- transport -------------------------------------------------------------
    def _call(self, op: str, args: Optional[dict] = None, timeout_s: Optional[float] = None,
              sock: Optional[zmq.Socket] = None) -> dict:
        if self.closed:
            raise KvtierError("client is closed")
        if self.reclaimed and op not in P.NO_ENGINE_OPS:  # ping, stats and a new register still go
            raise EngineReclaimed("unknown_engine", self.reclaimed)
        if self.endpoint.startswith("ipc://") and not os.path.exists(self.endpoint[6:]):
            raise DaemonUnavailable(f"no daemon at {self.endpoint}")  # at once: an engine never waits on none
        rid, session = next(self._ids), self.session
        if op in P.ADMIN_OPS or op == "stats":  # the owner's capability, where this process can read it
            token = read_token(self.runtime_dir)
            if token is not None:
                args = {**(args or {}), "token": token}
        payload = P.pack({"v": P.VERSION, "id": rid, "op": op, "engine": self.engine_id,
                          "args": {k: v for k, v in (args or {}).items() if v is not None}})
        timeout = self.timeout_s if timeout_s is None else timeout_s
        with self._lock if sock is None else contextlib.nullcontext():
            s = sock or self._sock
            s.send_multipart([b"", payload])
            end = time.monotonic() + timeout
            while True:
                left = end - time.monotonic()
                try:  # a blocking receive with a timeout: one call, no separate poll
                    if left <= 0:
                        raise zmq.Again()
                    s.setsockopt(zmq.RCVTIMEO, int(left * 1000) + 1)
                    frames = s.recv_multipart()
                except zmq.Again:
                    # the socket stays: a late reply is skipped by its id, and one connection keeps
                    # requests in order, so a lost request reaches the daemon before the register
                    # that starts the next session (a new socket's register could overtake it)
                    if self.endpoint.startswith("ipc://") and not os.path.exists(self.endpoint[6:]):
                        raise DaemonUnavailable(f"the daemon at {self.endpoint} went away") from None
                    if op in SESSION_OPS and self.info and session == self.session:
                        self._forget_session(f"{op} got no reply within {timeout} s: what it changed is unknown")
                    raise RequestTimeout(f"{op}: no reply within {timeout} s") from None
                reply = msgpack.unpackb(frames[-1], raw=False)
                if reply.get("id") == rid:
                    break
        if sock is None and session == self.session:  # not a heartbeat's (ids it named) nor an old session's
            self.telemetry.saw(reply.get("freed"))  # the daemon's free count: what later reports are stamped with
        if not reply.get("ok"):
            err = reply.get("error") or {}
            code, message = err.get("code", "unknown"), err.get("message", "")
            if code == "unknown_engine" and self.info and op != "register" and session == self.session:
                self._reclaimed(message)  # (an earlier session's reply, read late, says nothing of this one)
            raise RequestRejected(code, message)
        return reply.get("result") or {}

    def _reclaimed(self, message: str) -> None:
        """The daemon no longer knows us after we registered: stop writing anything."""
        self._forget_session(message or "reclaimed by the daemon")
        raise EngineReclaimed("unknown_engine", self.reclaimed)

    def _forget_session(self, why: str) -> None:
        """This session is over for the client: no slot is written, no call made, until a register
        starts a new one (the daemon then takes back all the old one held). Also after a request that
        changes what the engine holds got no reply: the daemon may still carry it out later (references
        and pins nobody would ever release), and a new session is the one state both sides agree on."""
        self.reclaimed = why
        self.telemetry.start(None)  # no reports either: their ids name nothing of ours now
        self.hbm = None  # slot_view raises from now on (the segment stays mapped until close); heartbeats pause

    # -- session -------------------------------------------------------------------
    def ping(self) -> dict:
        return self._call("ping", timeout_s=min(self.timeout_s, 5.0))

    def register(self, block_bytes: int, block_tokens: int = 16, layout: Optional[dict] = None,
                 hbm_tensor: Optional["torch.Tensor"] = None, hbm_shm_name: Optional[str] = None,
                 hbm_slots: int = 0, namespace: str = "", refs_only: bool = False) -> dict:
        """Attach to the daemon. Without a region, map the daemon's HBM pool (``self.hbm``).

        ``namespace``: this engine's key space (a model name, plus a tenant or cache salt
        where prefixes must not be shared); engines of different namespaces never see
        each other's blocks, keys or reuse. ``refs_only``: this engine only looks keys up,
        refs and hints (a scheduler); it sees every geometry of its namespace's name and may
        not allocate, seal or acquire."""
        self._new_session(own_region=bool(hbm_shm_name) or hbm_tensor is not None)
        self._registration = {"block_bytes": block_bytes, "block_tokens": block_tokens, "layout": layout,
                              "hbm_tensor": hbm_tensor, "hbm_shm_name": hbm_shm_name, "hbm_slots": hbm_slots,
                              "namespace": namespace, "refs_only": refs_only}
        args: dict[str, Any] = {"pid": os.getpid(), "pid_ns": pid_namespace(), "block_bytes": int(block_bytes),
                                "block_tokens": int(block_tokens), "namespace": namespace,
                                "layout": layout or {}, "refs_only": bool(refs_only)}
        if hbm_shm_name:
            args |= {"hbm_kind": "shm", "hbm_name": hbm_shm_name, "hbm_slots": int(hbm_slots)}
        elif hbm_tensor is not None:
            from kvtier.protocol.cuda_ipc import export_handle

            args |= {"hbm_kind": "cuda_ipc", "hbm_handle": export_handle(hbm_tensor), "hbm_slots": int(hbm_slots)}
            self.hbm = hbm_tensor
        self.info = self._call("register", args)
        self.reclaimed = ""
        self.telemetry.start(self.info.get("session_tag"))
        if self.hbm is None:
            self.hbm, self._shm = map_daemon_region(self.info)
        # a lease holds HBM slots idle: keep it a small fraction of the pool
        self.lease_size = min(self.lease_size, int(self.info.get("hbm_slots", 0)) // 16)
        if self.heartbeat_s and self._hb_thread is None:  # one thread for every session: it skips gaps
            self._hb_thread = threading.Thread(target=self._heartbeat, name="kvtier-heartbeat", daemon=True)
            self._hb_thread.start()
        return self.info

    def reattach(self, every_s: float = 1.0) -> bool:
        """Registered now? Once the daemon has reclaimed this engine (it restarted, or heard no
        heartbeat), register again as before, at most once per ``every_s``: an engine that
        carries on without kvtier meanwhile (recomputing) picks it up again when it is back."""
        if self.info and not self.reclaimed:
            return True
        if not self._registration or time.monotonic() < self._next_reattach:
            return False
        self._next_reattach = time.monotonic() + every_s
        try:
            self.register(**self._registration)
        except KvtierError as e:
            log.info("kvtier: register again failed (%s); retrying in %.0f s", e, every_s)
            return False
        return True

    def _new_session(self, own_region: bool) -> None:
        """A register starts a session afresh: the daemon has taken back whatever an earlier
        one of this id held, the leased blocks too (they may be another engine's by now),
        and a daemon that restarted serves another HBM region than the one mapped before."""
        self._lease.clear()
        self._lease_slot.clear()
        self.info = {}
        self.telemetry.start(None)
        self.reclaimed = "not registered: a register is under way or failed"  # ``reattach`` tries again
        self.session += 1  # handles of the old session never act in this one
        if not own_region:
            self.hbm = None
            if self._shm is not None:
                release_shm(self._shm, unlink=False)
                self._shm = None

    def _heartbeat(self) -> None:
        sock = self._dealer()
        try:
            while not self._hb_stop.wait(self.heartbeat_s):
                if self.reclaimed:  # no session now (``reattach`` or ``register`` starts the next)
                    continue
                try:
                    self._call("heartbeat", timeout_s=max(1.0, self.heartbeat_s or 1.0), sock=sock)
                except RequestTimeout:
                    sock.close(0)
                    sock = self._dealer()
                except KvtierError:  # reclaimed (the next call on the client raises it too), or no daemon
                    pass
        finally:
            sock.close(0)

    def slot_view(self, slot: int) -> "torch.Tensor":
        """The bytes of one HBM slot (block_bytes long) in the shared region."""
        if self.reclaimed:
            raise EngineReclaimed("unknown_engine", self.reclaimed)
        if self.hbm is None:
            raise KvtierError("no HBM region mapped: register first")
        return self.hbm[int(slot), : self.info["block_bytes"]]

    # -- blocks --------------------------------------------------------------------------
    def alloc(self, n: int, seq: Optional[int] = None, pin: bool = False,
              wait: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """n new blocks and their HBM slots at allocation time. Without ``seq`` they come
        from a local lease (one RPC per ``lease_size`` blocks). The daemon may move an
        unpinned block, so ``acquire`` a block before writing into its slot. ``wait=False``:
        a full HBM tier is refused at once (``no_space``) instead of waited for."""
        if seq is None and not pin and wait and self.lease_size and n <= self.lease_size:
            if len(self._lease) < n:
                r = self._alloc_retry(self.lease_size + n - len(self._lease), None)
                self._lease.extend(unpack_ids(r["blocks"]).tolist())
            out = np.asarray(self._lease[:n], dtype=np.int64)
            del self._lease[:n]
            return out, np.asarray([self._lease_slot.pop(b) for b in out.tolist()], dtype=np.int64)
        r = self._alloc_retry(n, seq, pin, wait)
        return unpack_ids(r["blocks"]), unpack_ids(r["slots"])

    def _alloc_retry(self, n: int, seq: Optional[int], pin: bool = False, wait: bool = True) -> dict:
        """The daemon waits for room (up to our timeout) rather than bouncing us."""
        r = self._call("alloc", {"n": int(n), "seq": seq, "pin": pin or None, "wait": wait,
                                 "timeout_s": self.timeout_s}, timeout_s=self.timeout_s + 5.0)
        if seq is None and not pin:
            self._lease_slot.update(zip(unpack_ids(r["blocks"]).tolist(), unpack_ids(r["slots"]).tolist()))
        return r

    def seal(self, blocks: ArrayLike, keys: ArrayLike, nbytes: Optional[int] = None,
             seq: Optional[int] = None, fold_identical_only: bool = False) -> np.ndarray:
        """Seal full blocks under content keys; returns canonical ids (shared prefixes fold).
        ``fold_identical_only`` (an engine that goes on reading what it sealed): fold only into a
        block of the same checksum, else keep this one, sealed but not indexed."""
        r = self._call("seal", {"blocks": pack_ids(blocks), "keys": pack_keys(keys), "nbytes": nbytes, "seq": seq,
                                "fold_identical_only": fold_identical_only})
        return unpack_ids(r["blocks"])

    def ref(self, keys: ArrayLike, seq: Optional[int] = None) -> np.ndarray:
        """Reference sealed blocks by key (prefix hits); -1 where a key is unknown."""
        return unpack_ids(self._call("ref", {"keys": pack_keys(keys), "seq": seq})["blocks"])

    def lookup(self, keys: ArrayLike) -> tuple[np.ndarray, np.ndarray]:
        """(block id or -1, fastest tier holding it: 0 hbm, 1 dram, 2 nvme, -1 none) per key;
        takes no reference, so a block may still go before it is ref'd."""
        r = self._call("lookup", {"keys": pack_keys(keys)})
        return unpack_ids(r["blocks"]), np.frombuffer(r["tiers"], dtype=np.int8).astype(np.int64)

    def acquire(self, blocks: Optional[ArrayLike] = None, keys: Optional[ArrayLike] = None,
                seqs: Optional[Sequence[int]] = None, timeout_s: Optional[float] = None) -> tuple[np.ndarray, np.ndarray]:
        """Pin blocks resident in HBM (promoting as needed); returns (sorted unique blocks, slots)."""
        # the daemon is told the wait this client will give it: with its own (longer) default an
        # acquire the client gave up on would complete later and pin blocks the engine never learns of
        wait = float(timeout_s if timeout_s is not None else self.timeout_s)
        r = self._call("acquire", {"blocks": pack_ids(blocks), "keys": pack_keys(keys),
                                   "seqs": list(seqs) if seqs is not None else None, "timeout_s": wait},
                       timeout_s=wait + 5.0)
        return unpack_ids(r["blocks"]), unpack_ids(r["slots"])

    def acquire_async(self, blocks: Optional[ArrayLike] = None, keys: Optional[ArrayLike] = None,
                      seqs: Optional[Sequence[int]] = None, timeout_s: Optional[float] = None) -> AcquireHandle:
        r = self._call("acquire", {"blocks": pack_ids(blocks), "keys": pack_keys(keys),
                                   "seqs": list(seqs) if seqs is not None else None, "timeout_s": timeout_s,
                                   "wait": False})
        return AcquireHandle(self._session_call(self.session), r, 0)

    def _session_call(self, session: int) -> Any:
        """The RPC for a handle of ``session``: refused once another session began (a restarted
        daemon numbers its tickets afresh, so an old ticket could name a new session's acquire)."""
        def call(op: str, args: Optional[dict] = None, **kw: Any) -> dict:
            if session != self.session:
                raise EngineReclaimed("unknown_engine", f"{op}: the session this was started in is over")
            return self._call(op, args, **kw)
        return call

    def release(self, blocks: Optional[ArrayLike] = None, seqs: Optional[Sequence[int]] = None) -> int:
        return self._call("release", {"blocks": pack_ids(blocks), "seqs": list(seqs) if seqs else None})["released"]

    def free(self, blocks: Optional[ArrayLike] = None, seqs: Optional[Sequence[int]] = None) -> int:
        return self._call("free", {"blocks": pack_ids(blocks), "seqs": list(seqs) if seqs else None})["freed"]

    def hint(self, blocks: Optional[ArrayLike] = None, keys: Optional[ArrayLike] = None,
             seqs: Optional[Sequence[int]] = None, deadline_s: float = 0.0) -> int:
        """Tell the daemon what will be acquired within ``deadline_s`` so it can prefetch."""
        return self._call("hint", {"blocks": pack_ids(blocks), "keys": pack_keys(keys),
                                   "seqs": list(seqs) if seqs else None, "deadline_s": float(deadline_s)})["hinted"]

    def stats(self) -> dict:
        return self._call("stats")

    def reload(self) -> dict:
        return self._call("reload")

    def clear(self) -> int:
        """Drop every cached block (the daemon owner's: needs its admin token); returns how many."""
        return int(self._call("clear")["dropped"])

    def check(self) -> dict:
        """Ask the daemon to verify its metadata invariants (raises RequestRejected if broken)."""
        return self._call("check")

    # -- telemetry (fire-and-forget) -----------------------------------------------------------
    def report_attention(self, blocks: ArrayLike, mass: "np.ndarray | Sequence[float]") -> None:
        """Attention mass per block of one sequence for the last step (fire-and-forget): the
        sequence's blocks in order, first to last, so their places give the sink and recency priors."""
        self.telemetry.send("attention", blocks, mass=np.ascontiguousarray(mass, dtype="<f4").tobytes())

    def report_segment(self, blocks: ArrayLike, tag: str) -> None:
        self.telemetry.send("segment", blocks, tag=tag)

    def report_class(self, blocks: ArrayLike, cont: bool, span: int) -> None:
        """The request features of sealed blocks the daemon cannot see itself (an engine that
        does not alloc by ``seq``): does the request continue a conversation, and how many new
        blocks it adds. The predictor's class of each block follows them."""
        self.telemetry.send("class", blocks, cont=bool(cont), span=int(span))

    # -- teardown ----------------------------------------------------------------------------
    def close(self, unregister: bool = True) -> None:
        if self.closed:
            return
        self._hb_stop.set()
        if self._hb_thread is not None:
            self._hb_thread.join(timeout=5)
        try:
            if self._lease and self.info and not unregister:
                self._call("free", {"blocks": pack_ids(self._lease)}, timeout_s=5.0)
            if unregister and self.info:
                self._call("unregister", timeout_s=5.0)
        except KvtierError:
            pass
        self.closed = True
        self.hbm = None
        if self._shm is not None:
            release_shm(self._shm, unlink=False)
            self._shm = None
        self._sock.close(0)
        self.telemetry.close()

    def __enter__(self) -> "TierClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["pack_keys", "TierClient", "AcquireHandle", "KvtierError", "DaemonUnavailable", "RequestTimeout",
           "RequestRejected", "EngineReclaimed"]
