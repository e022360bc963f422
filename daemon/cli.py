"""``kvtier`` command line: a registry of subcommands.

Each command module exposes ``register(subparsers)`` and sets ``func`` on
its parser; this file only wires them together, so adding a command never
grows an if/elif ladder.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# module path -> registers one or more subcommands
COMMAND_MODULES: tuple[str, ...] = (
    "kvtier.daemon.commands.bench",
    "kvtier.daemon.commands.replay",
    "kvtier.daemon.commands.serve",
    "kvtier.daemon.commands.config",
    "kvtier.daemon.commands.demo",
)


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    parser = argparse.ArgumentParser(prog="kvtier", description="Predictive KV-cache tiering daemon.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, PermissionError) as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
