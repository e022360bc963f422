"""Where a daemon's runtime files live and how an engine finds them.

Shared by both sides: the daemon writes ``daemon.json`` (endpoints, pid) into
its runtime directory; ``TierClient`` and the CLI read it. Kept apart from the
daemon's config so an engine process never imports the daemon.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Optional

INFO_FILE = "daemon.json"
TOKEN_FILE = "admin.token"  # the daemon owner's capability, mode 0600
EVENTS_TOPIC = b"kv-events"


def _user_dir(env: str, fallback: str) -> str:
    base = os.environ.get(env)
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        return os.path.join(base, "kvtier")
    return os.path.join(tempfile.gettempdir(), f"kvtier-{os.getuid()}", fallback)


def default_runtime_dir() -> str:
    """Per-user runtime directory (sockets): $XDG_RUNTIME_DIR/kvtier or /tmp/kvtier-UID/run."""
    return _user_dir("XDG_RUNTIME_DIR", "run")


def default_data_dir() -> str:
    """Per-user data directory (NVMe slabs): $XDG_DATA_HOME/kvtier or /tmp/kvtier-UID/data."""
    return _user_dir("XDG_DATA_HOME", "data")


def endpoints(runtime_dir: str) -> dict[str, str]:
    """The daemon's ZeroMQ endpoints under ``runtime_dir``."""
    d = Path(runtime_dir)
    return {"rpc": f"ipc://{d / 'rpc.sock'}", "telemetry": f"ipc://{d / 'telemetry.sock'}",
            "events": f"ipc://{d / 'events.sock'}"}


def read_info(runtime_dir: str) -> dict:
    """The running daemon's ``daemon.json`` (raises FileNotFoundError if none)."""
    with open(Path(runtime_dir) / INFO_FILE) as f:
        return json.load(f)


def read_token(runtime_dir: str) -> Optional[str]:
    """The daemon's admin token, where this process may read it (None elsewhere)."""
    try:
        with open(Path(runtime_dir) / TOKEN_FILE) as f:
            return f.read().strip() or None
    except OSError:
        return None


__all__ = ["TOKEN_FILE", "read_token", "INFO_FILE", "EVENTS_TOPIC", "default_runtime_dir", "default_data_dir",
           "endpoints", "read_info"]
