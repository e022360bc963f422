"""Prometheus exporter: maps the stats snapshot to ``kvtier_*`` metrics, plus health checks.

The owner thread publishes a snapshot (``stats.snapshot``) every second; the
HTTP thread only reads the latest one, so scraping never touches live
metadata. The acquire stall histogram is counted by the service (one array
increment on the acquire path) and exported from the snapshot. The same port
answers ``/healthz`` (the owner loop published recently: it is not stuck) and
``/readyz`` (it is serving: engines can attach), for process supervisors.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any, Callable, Iterable, Iterator, Optional
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, GCCollector, PlatformCollector, ProcessCollector, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvtier import __version__

# service counter of blocks dropped by the clear op (BlockOps.op_clear), added to kvtier_blocks_dropped
CLEARED_COUNTER = "cleared_blocks"
STALE_AFTER_S = 5.0  # snapshots come every second; five missed means the owner loop is stuck


class SnapshotCollector(Collector):
    def __init__(self) -> None:
        self.snapshot: dict[str, Any] = {}

    def collect(self) -> Iterator[Any]:
        s = self.snapshot
        if not s:
            return
        cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Tier capacity in bytes", labels=["tier"])
        used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes of a tier holding blocks", labels=["tier"])
        slots = GaugeMetricFamily("kvtier_tier_slots", "Slots of a tier", labels=["tier"])
        used_slots = GaugeMetricFamily("kvtier_tier_used_slots", "Occupied slots of a tier", labels=["tier"])
        hits = CounterMetricFamily("kvtier_tier_hits", "Acquired blocks by the tier they were found in", labels=["tier"])
        for row in s.get("tiers", []):
            cap.add_metric([row["tier"]], row["capacity_bytes"])
            used.add_metric([row["tier"]], row["used_bytes"])
            slots.add_metric([row["tier"]], row["slots"])
            used_slots.add_metric([row["tier"]], row["used"])
            hits.add_metric([row["tier"]], row.get("hits", 0))
        yield from (cap, used, slots, used_slots, hits)
        moves = CounterMetricFamily("kvtier_moves", "Blocks moved (promotions and demotions) per path", labels=["path"])
        moved = CounterMetricFamily("kvtier_moved_bytes", "Bytes moved per path", labels=["path"])
        errors = CounterMetricFamily("kvtier_move_errors", "Failed block transfers per path", labels=["path"])
        busy = CounterMetricFamily("kvtier_mover_busy_seconds", "Seconds the mover spent copying per path "
                                   "(rate(moved_bytes) / rate(busy_seconds) = bandwidth while busy)", labels=["path"])
        for path, row in s.get("paths", {}).items():
            label = [path.replace("->", "_to_")]
            moves.add_metric(label, row.get("moves", 0))
            moved.add_metric(label, row.get("bytes", 0))
            errors.add_metric(label, row.get("errors", 0))
            busy.add_metric(label, row.get("busy_ns", 0) / 1e9)
        yield from (moves, moved, errors, busy)
        blocks = GaugeMetricFamily("kvtier_blocks", "Tracked blocks by kind", labels=["kind"])
        for kind, n in s.get("blocks", {}).items():
            if kind != "max":
                blocks.add_metric([kind], n)
        yield blocks
        if "max" in s.get("blocks", {}):
            yield _gauge("kvtier_blocks_capacity", "Size of the block table (most blocks tracked at once)",
                         s["blocks"]["max"])
        events = CounterMetricFamily("kvtier_tier_events", "Data-plane events by kind (corrupt_copies, keys_detached, "
                                     "nvme_read_retries, nvme_write_backoffs, ...)", labels=["event"])
        for name, n in s.get("io", {}).get("events", {}).items():
            events.add_metric([name], n)
        yield events
        direct = s.get("io", {}).get("nvme_direct_io")
        if direct is not None:
            yield _gauge("kvtier_nvme_direct_io", "1 while the NVMe tier does O_DIRECT I/O, 0 once it fell back "
                         "to buffered I/O (the page cache then holds NVMe-tier data)", float(direct))
        svc = s.get("service", {})
        yield _counter("kvtier_acquires", "Acquire requests", svc.get("acquires", 0))
        yield _counter("kvtier_acquires_on_time", "Acquires that found every block resident", svc.get("acquires_on_time", 0))
        if svc.get("acquires"):  # no acquires: no ratio (a 1.0 would claim a perfect prefetcher)
            yield _gauge("kvtier_prefetch_on_time_ratio", "Acquires on time / acquires", s["prefetch_on_time_ratio"])
        pf = s.get("prefetch", {})
        yield _counter("kvtier_prefetch_hinted_blocks", "Blocks named by schedule hints", pf.get("hinted", 0))
        yield _counter("kvtier_prefetch_started_blocks", "Hinted promotions started", pf.get("started", 0))
        spec = CounterMetricFamily("kvtier_speculative_promotions", "Unhinted promotions into idle HBM by outcome "
                                   "(used: acquired while in HBM; wasted: left HBM first)", labels=["outcome"])
        spec.add_metric(["started"], pf.get("speculated", 0))
        spec.add_metric(["used"], pf.get("speculative_used", 0))
        spec.add_metric(["wasted"], pf.get("speculative_wasted", 0))
        yield spec
        yield _counter("kvtier_telemetry_block_updates", "Telemetry block updates ingested",
                       svc.get("telemetry_block_updates", 0))
        yield _counter("kvtier_telemetry_rejected", "Telemetry messages rejected", svc.get("telemetry_rejected", 0))
        yield _counter("kvtier_telemetry_stale", "Telemetry messages dropped whole: another session's, or a "
                       "free count the daemon has not reached", svc.get("telemetry_stale", 0))
        yield _counter("kvtier_telemetry_skipped", "Telemetry block updates skipped: the id was freed after the "
                       "report was stamped", svc.get("telemetry_skipped", 0))
        yield _counter("kvtier_rpc_errors", "RPC requests answered with an error", svc.get("rpc_errors", 0))
        yield _gauge("kvtier_engines", "Attached engines", len(s.get("engines", [])))
        yield _counter("kvtier_blocks_dropped", "Cached blocks dropped: evicted from the last tier, or by clear",
                       s.get("placement", {}).get("dropped", 0) + svc.get(CLEARED_COUNTER, 0))
        hist = s.get("acquire_stall_histogram")
        if hist:
            cum, buckets = 0, []
            for le, n in zip([*hist["le"], float("inf")], hist["counts"]):
                cum += n
                buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cum))
            yield HistogramMetricFamily("kvtier_acquire_stall_seconds", "Time an acquire waited for its blocks",
                                        buckets=buckets, sum_value=hist["sum"])
        yield from _remote_families(s.get("remote") or {})
        calib = s.get("calibration") or {}
        for name, text in (("brier", "Reuse predictor brier"), ("ece", "Reuse predictor ece"),
                           ("ece_raw", "Reuse model ece before recalibration")):
            if name in calib and calib[name] == calib[name]:
                yield _gauge(f"kvtier_predictor_{name}", text, calib[name])
        if "n" in calib:  # how much the two figures above rest on: few predictions, noisy figures
            yield _gauge("kvtier_predictor_scored", "Resolved predictions behind the calibration figures",
                         calib["n"])


def _remote_families(r: dict[str, Any]) -> Iterator[Any]:
    """``kvtier_remote_*``: the shared remote tier (only where it is enabled)."""
    if not r.get("enabled"):
        return
    yield _gauge("kvtier_remote_up", "1 while the remote tier serves, 0 while it is degraded (failed batches: "
                 "lookups miss and engines recompute until it recovers)", float(r["state"] != "degraded"))
    yield _gauge("kvtier_remote_writes_refused", "1 while the cluster refuses our writes (full under noeviction, "
                 "read-only): publishing backs off, reads still serve", float(r["state"] == "writes refused"))
    yield _counter("kvtier_remote_hits", "Keys missed locally and found, verified, in the remote tier", r["hits"])
    yield _counter("kvtier_remote_misses", "Keys looked up remotely and not found (or not verified)", r["misses"])
    yield _counter("kvtier_remote_corrupt", "Remote values refused by their checksum (deleted, never served)",
                   r["corrupt"])
    yield _counter("kvtier_remote_published_blocks", "Blocks this node wrote to the remote tier", r["published"])
    nbytes = CounterMetricFamily("kvtier_remote_bytes", "Payload bytes to (put) and from (get) the remote tier",
                                 labels=["op"])
    errors = CounterMetricFamily("kvtier_remote_errors", "Remote batches that failed (unreachable, timeout)",
                                 labels=["op"])
    for op in ("put", "get"):
        nbytes.add_metric([op], r[f"{op}_bytes"])
        errors.add_metric([op], r["errors"][op])
    yield from (nbytes, errors)
    lat = HistogramMetricFamily("kvtier_remote_latency_seconds", "Time of one remote batch (a pipelined write "
                                "or read of up to tiers.remote.batch_blocks blocks)", labels=["op"])
    for op, hist in r["latency_histogram"].items():
        cum, buckets = 0, []
        for le, n in zip([*hist["le"], float("inf")], hist["counts"]):
            cum += n
            buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cum))
        lat.add_metric([op], buckets, hist["sum"])
    yield lat


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


class BuildInfoCollector(Collector):
    def collect(self) -> Iterator[Any]:
        g = GaugeMetricFamily("kvtier_build_info", "Always 1; the labels name the running build", labels=["version"])
        g.add_metric([__version__], 1)
        yield g


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds: no access log
        pass


CLOSE_POLL_S = 0.05  # how often the metrics thread looks for ``close``: 20 idle wake-ups a second


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def _server_class(host: str) -> type[WSGIServer]:
    """IPv6 binds need an AF_INET6 socket; resolve the host once to pick the family."""
    family = socket.getaddrinfo(host or None, 0, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    return type("_Server", (_ThreadingServer,), {"address_family": family})


class Exporter:
    """``/metrics`` (kvtier, process and Python collectors), ``/healthz`` and ``/readyz`` on one port."""

    def __init__(self, stale_after_s: float = STALE_AFTER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self.registry.register(BuildInfoCollector())
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        self.port: Optional[int] = None
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.published_at: Optional[float] = None
        self._server: Optional[WSGIServer] = None
        self._metrics_app = make_wsgi_app(self.registry)
        # path -> check returning (ok, JSON body); every other path serves the metrics
        self.checks: dict[str, Callable[[], tuple[bool, dict[str, Any]]]] = {
            "/healthz": self.health, "/readyz": self.ready}

    def start(self, host: str, port: int) -> int:
        try:
            server = make_server(host, port, self._app, _server_class(host), _QuietHandler)
        except OSError as e:
            raise OSError(e.errno, f"cannot serve metrics on {host}:{port}: {e.strerror or e} "
                                   "(set metrics.port to a free port, or 0 for any)") from None
        # ``close`` waits for the serving loop's next poll: 0.5 s by default, added to every stop
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": CLOSE_POLL_S}, name="kvtier-metrics",
                         daemon=True).start()
        self._server = server
        self.port = int(server.server_address[1])
        return self.port

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        check = self.checks.get(environ.get("PATH_INFO") or "/")
        if check is None:
            return self._metrics_app(environ, start_response)
        ok, body = check()
        start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "application/json")])
        return [json.dumps(body).encode() + b"\n"]

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Live: the owner loop published a snapshot within ``stale_after_s``."""
        if self.published_at is None:
            return False, {"ok": False, "why": "the owner loop has not started"}
        age = self.clock() - self.published_at
        ok = age <= self.stale_after_s
        return ok, {"ok": ok, "snapshot_age_s": round(age, 3)} | ({} if ok else {"why": "the owner loop is stuck"})

    def ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready: live and serving RPC. Engines are not required (one that waited for readiness
        before registering would wait forever); the body says how many are attached."""
        live, body = self.health()
        engines = len(self.collector.snapshot.get("engines", []))
        return live, body | {"engines": engines, "tiers_set_up": bool(self.collector.snapshot.get("tiers"))}

    def publish(self, snapshot: dict[str, Any]) -> None:
        self.collector.snapshot = snapshot
        self.published_at = self.clock()

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["Exporter", "CLEARED_COUNTER"]
