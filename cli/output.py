"""Writing results: JSON files written atomically, shared by every command."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from typing import Any

PLOT_FORMATS = ("png", "pdf", "svg", "jpg", "jpeg", "webp", "eps", "ps", "tif", "tiff")


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


def check_output(path: str | None, what: str = "--json") -> None:
    """Fail now, before a long run, where ``path`` could not be written at its end: a
    directory, or a folder that cannot be made or written to (its results were lost)."""
    if not path:
        return
    if os.path.isdir(path):
        raise CliError(f"{what} {path}: is a directory (name a file)")
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d, prefix=".kvtier-check-"):
            pass
    except OSError as e:
        raise CliError(f"{what} {path}: cannot write there ({e.strerror or e})") from None


def check_plot(path: str | None) -> None:
    """``check_output`` for a plot, and a format matplotlib writes (by the extension; none is PNG)."""
    if not path:
        return
    ext = os.path.splitext(path)[1].lstrip(".").lower()
    if ext and ext not in PLOT_FORMATS:  # none: PNG
        raise CliError(f"--plot {path}: name a file ending in one of .{', .'.join(PLOT_FORMATS)}")
    check_output(path, "--plot")


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write ``result`` to ``path`` (no-op without one) via a temp file of its own beside it and
    a rename: a failure leaves no file behind, and two runs never share a temp file. NaN and
    infinities are written as null, so the file is valid JSON."""
    if not path:
        return
    check_output(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".kvtier-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(finite(result), f, indent=2, sort_keys=True, allow_nan=False)
            f.write("\n")
        os.chmod(tmp, 0o644 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    print(f"wrote {path}", file=sys.stderr)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = ["CliError", "finite", "write_json", "check_output", "check_plot", "PLOT_FORMATS"]
