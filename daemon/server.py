"""The daemon process: sockets, the owner loop, signals, heartbeats.

One thread (this loop) owns all metadata. It serves the ROUTER (RPC), drains
the PULL (telemetry), applies mover completions, advances waiting acquires,
runs background placement and prefetch in small slices, and publishes block
events on the PUB socket. No input can kill it: every request is decoded and
validated inside a guard that turns any problem into an error reply.

Runtime files live in ``server.runtime_dir`` (mode 0700): ``rpc.sock``,
``telemetry.sock``, ``events.sock`` (all 0600) and ``daemon.json`` (endpoints,
pid, metrics port), which ``kvtier stats`` and ``TierClient`` read.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import msgpack
import zmq

from kvtier.protocol import wire as P
from kvtier.protocol.runtime import EVENTS_TOPIC, INFO_FILE, TOKEN_FILE, endpoints, ensure_private_dir, write_private_file
from kvtier.protocol.wire import ProtocolError
from kvtier.tiers.copy_tuning import check_loop
from kvtier.tiers.io_kvikio import kvikio_status

from .acquire import Pending
from .config import ConfigError, KvtierConfig, resolve_config_path
from .dirlock import DirLock
from .events import encode_batch, seq_frame
from .metrics import Exporter
from .reload import RESTART_WITH_NODE, plan_reload
from .service import Service

log = logging.getLogger("kvtier.server")
STALL_S = 1.0  # a loop turn this late means the owner was away: engines are not blamed for it


class Server:
    def __init__(self, cfg: KvtierConfig, config_path: Optional[str] = None, overrides: Sequence[str] = (),
                 discovered: bool = False) -> None:
        self.cfg = cfg
        self.config_path = config_path
        self.discovered = discovered  # no --config: each reload looks for the file again
        self.overrides = list(overrides)
        self.service = Service(cfg, admin_token=secrets.token_hex(32))
        self.stop_requested = False
        self.reload_requested = False
        self.exporter: Optional[Exporter] = None
        # sockets untyped: pyzmq types getsockopt(EVENTS) as int | bytes, and the loop masks it with POLLIN
        self.ctx: zmq.Context[Any] = zmq.Context.instance()
        self.runtime_dir = Path(cfg.server.runtime_dir)
        self.endpoints = endpoints(str(self.runtime_dir))
        self._event_seq = 0
        self._last_check = 0.0
        self._turn_started = time.monotonic()
        self._last_snapshot = 0.0
        self.started_monotonic = time.monotonic()
        self.nvme_blocks_kept: Optional[int] = None  # set by shutdown: blocks left on NVMe for the next start
        self._bound: list[str] = []  # socket files this daemon made (a failed start removes them)
        self._bind()

    # -- setup -------------------------------------------------------------------
    def _bind(self) -> None:
        ensure_private_dir(self.runtime_dir)  # 0700, ours, not a symlink: or UnsafeDirError naming path and owner
        self.locks = [DirLock(self.runtime_dir, "runtime directory")]  # before touching anything in it
        tc = self.cfg.tiers
        if tc.nvme_bytes and tc.io_backend == "kvikio" and not kvikio_status()[0]:  # at start, not at the first register
            self.locks[0].release()
            raise ValueError(f"tiers.io_backend = 'kvikio' cannot run here: {kvikio_status()[1]}")
        try:
            check_loop(tc.copy_loop)  # a loop this CPU lacks: at start, like kvikio above
        except ValueError:
            self.locks[0].release()
            raise
        if tc.nvme_bytes:
            try:
                ensure_private_dir(tc.nvme_dir)
                # one directory for both: the runtime lock covers it (a second flock on a new
                # descriptor of the same file was refused by our own first one)
                if not os.path.samefile(tc.nvme_dir, self.runtime_dir):
                    self.locks.append(DirLock(tc.nvme_dir, "NVMe directory"))
            except BaseException:
                self.locks[0].release()
                raise
        if self.cfg.metrics.enabled:  # before any socket file: a busy port leaves nothing behind
            self.exporter = Exporter()
            try:
                self.exporter.start(self.cfg.metrics.host, self.cfg.metrics.port)
            except BaseException:
                for lock in self.locks:
                    lock.release()
                raise
        try:
            self._bind_sockets()
            assert self.service.admin_token is not None  # set in __init__
            write_private_file(self.runtime_dir / TOKEN_FILE, self.service.admin_token.encode())
            self._started = time.time()
            self._write_info()
        except BaseException:  # a socket that cannot bind: leave no socket file, port or lock behind
            self._unbind()
            raise

    def _bind_sockets(self) -> None:
        old_umask = os.umask(0o177)  # socket files are created 0600
        try:
            self.rpc = self.ctx.socket(zmq.ROUTER)
            self.rpc.setsockopt(zmq.LINGER, 0)
            # frames up to 4x the limit are read and answered too_large; beyond, the peer is cut off
            self.rpc.setsockopt(zmq.MAXMSGSIZE, 4 * self.cfg.server.max_message_bytes)
            self.telemetry = self.ctx.socket(zmq.PULL)
            self.telemetry.setsockopt(zmq.LINGER, 0)
            self.telemetry.setsockopt(zmq.MAXMSGSIZE, self.cfg.server.max_message_bytes)
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            for sock, name in ((self.rpc, "rpc"), (self.telemetry, "telemetry"), (self.pub, "events")):
                path = self.endpoints[name][len("ipc://"):]
                if os.path.exists(path):
                    os.unlink(path)
                sock.bind(self.endpoints[name])
                self._bound.append(path)
                os.chmod(path, 0o600)
        finally:
            os.umask(old_umask)

    def _unbind(self) -> None:
        """Undo a ``_bind`` that failed part-way: sockets, their files and the token and info
        files, the exporter, the locks."""
        for name in ("rpc", "telemetry", "pub"):
            sock = getattr(self, name, None)  # the sockets made before the failure
            if sock is not None:
                sock.close(0)
        for path in [*self._bound, str(self.runtime_dir / TOKEN_FILE), str(self.runtime_dir / INFO_FILE)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        if self.exporter is not None:
            self.exporter.close()
        for lock in self.locks:
            lock.release()

    def _write_info(self) -> None:
        """daemon.json: how to reach this daemon, and the config file it runs (rewritten when a
        reload finds another one, so the file never names a config the daemon no longer reads)."""
        info = {"pid": os.getpid(), **self.endpoints, "metrics_port": self.exporter.port if self.exporter else None,
                "metrics_host": self.cfg.metrics.host, "config": self.config_path, "started": self._started}
        write_private_file(self.runtime_dir / INFO_FILE, json.dumps(info).encode())

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_requested", True))
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "stop_requested", True))
        signal.signal(signal.SIGHUP, lambda *_: setattr(self, "reload_requested", True))

    # -- loop ----------------------------------------------------------------------
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.rpc, zmq.POLLIN)
        poller.register(self.telemetry, zmq.POLLIN)
        svc = self.service
        last_tick = 0.0
        self._turn_started = time.monotonic()
        while not self.stop_requested:
            self._excuse_stall()
            busy = svc.busy()
            if self.rpc.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # a request is waiting: skip the poller
                ready: dict[zmq.Socket, int] = {self.rpc: zmq.POLLIN}
                if self.telemetry.getsockopt(zmq.EVENTS) & zmq.POLLIN:  # ... but never starve telemetry
                    ready[self.telemetry] = zmq.POLLIN
            else:
                ready = dict(poller.poll(1 if busy else 20))
            if self.rpc in ready:
                # one request per turn: no exception-driven drain loop on the latency path
                self._on_request(self.rpc.recv_multipart(copy=True))
            if self.telemetry in ready:
                for _ in range(1024):
                    try:
                        frame = self.telemetry.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self._on_telemetry(frame)
            now = time.monotonic()
            if busy or now - last_tick > 0.005 or not ready:
                last_tick = now
                self._tick()
        self.shutdown()

    def _tick(self) -> None:
        svc = self.service
        try:
            svc.background()
            for w, result in svc.advance():
                self._reply_later(w, result)
            svc.maintain()
        except Exception:  # a bug must be loud but must not take the node's KV cache down
            log.exception("background work failed")
            svc.counters["internal_errors"] += 1
        now = time.monotonic()
        if now - self._last_check > 0.5:
            self._last_check = now
            self._excuse_stall()
            self._drain_requests()  # heartbeats already sent are read before anyone is judged silent
            for eid in svc.check_engines():
                log.warning("engine %s reclaimed (heartbeat timeout or process exit)", eid)
        if self.reload_requested:
            self.reload_requested = False
            try:
                self.reload()
            except ConfigError as e:
                log.error("reload rejected, running config kept: %s", e)
            except Exception:  # a SIGHUP must never stop the daemon
                log.exception("reload failed, running config kept")
        self._publish_events()
        if now - self._last_snapshot > 1.0 and self.exporter is not None:
            self._last_snapshot = now
            self.exporter.publish(svc.stats())

    def _excuse_stall(self) -> None:
        """Engines are not blamed for time the owner loop itself was away (a long
        op, a paused process): their silence clocks move on by the stall."""
        now = time.monotonic()
        away = now - self._turn_started
        self._turn_started = now
        if away > STALL_S:
            self.service.excuse_stall(away)
            self.service.counters["owner_stalls"] += 1
            log.warning("owner loop was away %.1f s; engines' heartbeat clocks moved on by as much", away)

    def _drain_requests(self, limit: int = 4096) -> None:
        """Answer the requests already queued on the RPC socket (bounded)."""
        for _ in range(limit):
            if not self.rpc.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            self._on_request(self.rpc.recv_multipart(copy=True))

    def _on_request(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return  # ROUTER always prefixes an identity; nothing to answer
        envelope, payload = frames[:-1], frames[-1]
        svc = self.service
        rid = -1
        try:
            req, args = P.decode_request(payload, self.cfg.server.max_message_bytes)
            rid = req.id
            if req.op == "reload" and svc.is_admin(args):
                result: Any = self.reload()
            elif req.op == "stats":
                result = svc.op_stats(None, args) | {"metrics_port": self.exporter.port if self.exporter else None}
            else:
                result = svc.handle(req, args)
            if isinstance(result, Pending):
                result.reply_to = (envelope, rid)
                return
            reply = P.ok(rid, result, svc.frees())
        except ProtocolError as e:
            svc.counters["rpc_errors"] += 1
            reply = P.error(rid if rid >= 0 else P.request_id(payload), e.code, e.message)
        except ConfigError as e:
            svc.counters["rpc_errors"] += 1
            reply = P.error(rid, P.INVALID, str(e))
        except Exception as e:  # never die from input
            log.exception("request failed")
            svc.counters["internal_errors"] += 1
            reply = P.error(rid, P.INTERNAL, f"{type(e).__name__}: {e}")
        self.rpc.send_multipart([*envelope, reply])

    def _reply_later(self, w: Pending, result: Any) -> None:
        if w.reply_to is None:
            return
        envelope, rid = w.reply_to
        if isinstance(result, ProtocolError):
            self.service.counters["rpc_errors"] += 1
            reply = P.error(rid, result.code, result.message)
        else:
            reply = P.ok(rid, result, self.service.frees())
        self.rpc.send_multipart([*envelope, reply])

    def _on_telemetry(self, frame: bytes) -> None:
        svc = self.service
        try:
            msg = msgpack.unpackb(frame, raw=False) if len(frame) <= self.cfg.server.max_message_bytes else None
        except Exception:
            msg = None
        if isinstance(msg, dict) and isinstance(msg.get("batch"), list):
            batch: list[Any] = msg["batch"]
        else:
            batch = [msg]
        for m in batch:
            try:
                svc.ingest(m)
            except Exception:
                log.exception("telemetry failed")
                svc.counters["telemetry_rejected"] += 1

    def _publish_events(self) -> None:
        if self.service.node is None:
            return
        batch = self.service.node.events.take_batch()
        if batch is not None:
            self._event_seq += 1
            self.pub.send_multipart([EVENTS_TOPIC, seq_frame(self._event_seq), encode_batch(batch)])

    def reload(self) -> dict:
        """Re-read config sources; apply [policy]/[scoring]/[predictor] or keep all on error.

        Every changed key is named: ``keys`` took effect, ``restart`` waits for a restart
        ([server], [tiers], [metrics], and policy.name once a node runs); ``changed`` lists
        the reconfigured sections."""
        notes, path = [], self.config_path
        if self.discovered:  # a file created (or removed) since the start is what reload reads
            path = resolve_config_path(None)
            if path != self.config_path:
                notes.append(_config_file_moved(self.config_path, path))
        plan = plan_reload(self.cfg, path, overrides=self.overrides)
        new = plan.config
        if new.policy.name != self.cfg.policy.name and self.service.node is not None:
            notes.append(f"policy.name {new.policy.name!r} takes effect on restart; "
                         f"running {self.cfg.policy.name!r} with the new parameters")
        for key in RESTART_WITH_NODE if self.service.node is not None else ():
            if key in plan.applied:  # the running policies were built with it: kept until a restart
                section, name = key.split(".")
                setattr(getattr(new, section), name, getattr(getattr(self.cfg, section), name))
                plan.applied.remove(key)
                plan.restart.append(key)
        self.service.apply_hot(new, plan.sections)
        moved, (self.cfg, self.config_path) = path != self.config_path, (new, path)  # a rejected reload changes neither
        if moved:
            self._write_info()
        log.info("reloaded: %s; needs a restart: %s%s", ", ".join(plan.applied) or "no changes",
                 ", ".join(plan.restart) or "nothing", "".join(f"; {n}" for n in notes))
        return {"changed": plan.sections, "keys": plan.applied, "restart": plan.restart, "notes": notes}

    # -- stop --------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Drain transfers, sync NVMe slabs, remove socket files and daemon.json."""
        svc = self.service
        if svc.node is not None:
            mgr = svc.node.mgr
            try:
                mgr.wait(timeout=30)
            except TimeoutError:
                log.error("transfers still pending at shutdown")
            if mgr.nvme is not None:
                mgr.nvme.sync()
                self.nvme_blocks_kept = next((int(r["used"]) for r in mgr.tier_usage() if r["tier"] == "nvme"), 0)
        svc.close()
        for sock in (self.rpc, self.telemetry, self.pub):
            sock.close(0)
        for name in ("rpc", "telemetry", "events"):
            path = self.endpoints[name][len("ipc://"):]
            if os.path.exists(path):
                os.unlink(path)
        for name in (INFO_FILE, TOKEN_FILE):
            (self.runtime_dir / name).unlink(missing_ok=True)
        if self.exporter is not None:
            self.exporter.close()
        for lock in self.locks:
            lock.release()

    # -- summaries (one log line each, at start and stop) ---------------------------------
    def start_summary(self, sources: Sequence[str] = ()) -> str:
        """Version, tier sizes, I/O backend, socket, metrics endpoint and config sources on one line."""
        from kvtier import __version__
        from kvtier.tiers.io_backends import kvikio_status

        t = self.cfg.tiers
        io: str = t.io_backend
        if io == "auto":
            io = f"auto ({'kvikio' if kvikio_status()[0] else 'posix'})"
        mib = lambda n: f"{n / 2**20:.0f} MiB"
        nvme = f"nvme {mib(t.nvme_bytes)} in {t.nvme_dir}" if t.nvme_bytes else "nvme off"
        port = self.exporter.port if self.exporter else None
        metrics = f"http://{self.cfg.metrics.host}:{port}/metrics" if port else "off"
        return (f"kvtier {__version__} started: pid {os.getpid()}; tiers hbm {mib(t.hbm_bytes)}, dram {mib(t.dram_bytes)}, "
                f"{nvme}; io {io}; socket {self.endpoints['rpc']}; metrics {metrics}; policy {self.cfg.policy.name}; "
                f"config {' < '.join(sources) or '-'}")

    def stop_summary(self) -> str:
        """Blocks kept on NVMe (None: no engine registered, so no tier was built) and uptime."""
        kept = "no tiers were built" if self.nvme_blocks_kept is None else f"{self.nvme_blocks_kept} blocks kept on NVMe"
        return f"kvtier stopped: {kept}; uptime {time.monotonic() - self.started_monotonic:.1f} s"


__all__ = ["Server"]


def _config_file_moved(was: Optional[str], now: Optional[str]) -> str:
    """Why a reload without ``--config`` read another file than the last one (or none)."""
    if now is None:
        return f"config file {was} is gone: reloaded from the shipped default (and environment, --set)"
    return f"config file is now {now} (" + (f"was {was})" if was else "none was found before)")
