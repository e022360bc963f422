"""Prometheus exporter: maps the stats snapshot to ``kvtier_*`` metrics.

The owner thread publishes a snapshot (``stats.snapshot``) every second; the
HTTP thread of prometheus_client only reads the latest one, so scraping never
touches live metadata. The acquire stall histogram is counted by the service
(one array increment on the acquire path) and exported from the snapshot.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector


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
        bw = GaugeMetricFamily("kvtier_mover_bandwidth_bytes_per_second", "Mover bandwidth per path", labels=["path"])
        for path, row in s.get("paths", {}).items():
            label = [path.replace("->", "_to_")]
            moves.add_metric(label, row.get("moves", 0))
            moved.add_metric(label, row.get("bytes", 0))
            errors.add_metric(label, row.get("errors", 0))
            bw.add_metric(label, row.get("bandwidth_bytes_per_s", 0.0))
        yield from (moves, moved, errors, bw)
        blocks = GaugeMetricFamily("kvtier_blocks", "Tracked blocks by kind", labels=["kind"])
        for kind, n in s.get("blocks", {}).items():
            blocks.add_metric([kind], n)
        yield blocks
        direct = s.get("io", {}).get("nvme_direct_io")
        if direct is not None:
            yield _gauge("kvtier_nvme_direct_io", "1 while the NVMe tier does O_DIRECT I/O, 0 once it fell back "
                         "to buffered I/O (the page cache then holds NVMe-tier data)", float(direct))
        svc = s.get("service", {})
        yield _counter("kvtier_acquires", "Acquire requests", svc.get("acquires", 0))
        yield _counter("kvtier_acquires_on_time", "Acquires that found every block resident", svc.get("acquires_on_time", 0))
        yield _gauge("kvtier_prefetch_on_time_ratio", "Acquires on time / acquires", s.get("prefetch_on_time_ratio", 1.0))
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
        yield _counter("kvtier_rpc_errors", "RPC requests answered with an error", svc.get("rpc_errors", 0))
        yield _gauge("kvtier_engines", "Attached engines", len(s.get("engines", [])))
        yield _counter("kvtier_blocks_dropped", "Cached blocks dropped from the last tier",
                       s.get("placement", {}).get("dropped", 0))
        hist = s.get("acquire_stall_histogram")
        if hist:
            cum, buckets = 0, []
            for le, n in zip([*hist["le"], float("inf")], hist["counts"]):
                cum += n
                buckets.append(("+Inf" if le == float("inf") else repr(float(le)), cum))
            yield HistogramMetricFamily("kvtier_acquire_stall_seconds", "Time an acquire waited for its blocks",
                                        buckets=buckets, sum_value=hist["sum"])
        calib = s.get("calibration") or {}
        for name in ("brier", "ece"):
            if name in calib and calib[name] == calib[name]:
                yield _gauge(f"kvtier_predictor_{name}", f"Reuse predictor {name}", calib[name])
        if "n" in calib:  # how much the two figures above rest on: few predictions, noisy figures
            yield _gauge("kvtier_predictor_scored", "Resolved predictions behind the calibration figures", calib["n"])


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc)
    c.add_metric([], value)
    return c


class Exporter:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self.port: Optional[int] = None
        self._server: Any = None

    def start(self, host: str, port: int) -> int:
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        self._server = server
        self.port = server.server_address[1]
        return self.port

    def publish(self, snapshot: dict[str, Any]) -> None:
        self.collector.snapshot = snapshot

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


__all__ = ["Exporter"]
