"""Start a real daemon process (tests, benchmarks, the demo) in a directory of its own."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional


class DaemonProcess:
    def __init__(self, root: Path, *overrides: str, config: Optional[str] = None, env: Optional[dict] = None) -> None:
        self.root = Path(root)
        self.runtime_dir = self.root / "run"
        self.nvme_dir = self.root / "nvme"
        args = [sys.executable, "-m", "kvtier.cli", "serve", "--log-level", "WARNING",
                "--set", f"server.runtime_dir={json.dumps(str(self.runtime_dir))}",
                "--set", f"tiers.nvme_dir={json.dumps(str(self.nvme_dir))}",
                "--set", "metrics.port=0",
                *[x for o in overrides for x in ("--set", o)]]
        if config:
            args += ["--config", config]
        self.log = open(self.root / "daemon.log", "w")
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.info = self._wait_info()

    def _wait_info(self, timeout: float = 30.0) -> dict:
        end = time.monotonic() + timeout
        info_path = self.runtime_dir / "daemon.json"
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: {self.read_log()}")
            if info_path.exists():
                try:
                    info = json.loads(info_path.read_text())
                    if info.get("pid") == self.proc.pid:
                        return info
                except json.JSONDecodeError:
                    pass
            time.sleep(0.02)
        log = self.read_log()
        self.stop(timeout=5.0)  # never leave a half-started daemon running behind a failed bench
        raise TimeoutError(f"daemon did not start within {timeout:g} s: {log}")

    def read_log(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.root / "daemon.log").read_text()

    def client(self, **kw):
        from kvtier.client.tier_client import TierClient

        return TierClient(runtime_dir=str(self.runtime_dir), **kw)

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode
