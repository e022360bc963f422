"""Writing results: JSON files written atomically, shared by every command."""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any


class CliError(Exception):
    """An expected failure: ``kvtier`` prints its message as one line and exits 1, no traceback."""


def finite(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float (numpy's too) made None: JSON has no NaN."""
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):  # np.float64 is a float
        return None
    return obj


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` (no-op without one) via a temp file and rename. NaN and
    infinities are written as null, so the file is valid JSON."""
    if not path:
        return
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(finite(result), f, indent=2, sort_keys=True, allow_nan=False)
        f.write("\n")
    os.replace(tmp, path)
    print(f"wrote {path}", file=sys.stderr)


__all__ = ["CliError", "finite", "write_json"]
