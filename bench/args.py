"""Argument types for the benches: a size, count or duration of 0 or less is refused by argparse
with one line, not met later as a ZeroDivisionError or an empty median."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive finite number")
    return v


__all__ = ["positive_int", "positive_float"]
