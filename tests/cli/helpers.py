"""Running the ``kvtier`` command as a user does: a fresh process, its exit code and output."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Optional


def kvtier(*args: str, timeout: float = 120, env: Optional[dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvtier.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """The failure was reported as exactly one ``kvtier: error:`` line and a non-zero exit."""
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtier: error: "), r.stderr
    return lines[0]
