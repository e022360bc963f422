"""Writing results: JSON files written atomically, shared by every command."""

from __future__ import annotations

import json
import os
import sys
from typing import Any


class CliError(Exception):
    """An expected failure: ``kvtier`` prints its message as one line and exits 1, no traceback."""


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` (no-op without one) via a temp file and rename."""
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)


__all__ = ["CliError", "write_json"]
