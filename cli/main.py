"""``kvtier`` command line: a registry of subcommands, each loaded only when chosen.

Every command is one line here (module, help). ``kvtier --help`` and
``--version`` import no command module at all; ``kvtier stats`` imports the
serve module and the client, never torch, transformers or the daemon. A
command module exposes ``configure(name, parser, rest)``, which adds its
arguments and sets ``func``; ``rest`` is the words after the command's name
(None: configure everything), so ``bench`` imports only the bench named there.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Iterable, Optional, Sequence

# command -> (module with ``configure(name, parser, rest)``, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("kvtier.cli.demo", "run a real model through a real daemon and verify bit-exact outputs"),
    "serve": ("kvtier.cli.serve", "run the tiering daemon in the foreground"),
    "stats": ("kvtier.cli.serve", "show a running daemon's tiers, engines and counters"),
    "reload": ("kvtier.cli.serve", "re-read the config of a running daemon; list what changed and what needs a restart"),
    "clear": ("kvtier.cli.serve", "drop every cached block of a running daemon (live blocks stay)"),
    "config": ("kvtier.cli.config", "show, validate or describe the configuration"),
    "replay": ("kvtier.cli.replay", "replay traces through policies; compare with LRU and Belady"),
    "bench": ("kvtier.cli.bench", "benchmarks against a raw baseline measured in the same run"),
}


def chosen_word(argv: Sequence[str], among: Iterable[str]) -> tuple[Optional[str], Optional[list[str]]]:
    """The first word of ``argv`` that is not an option, if it is one of ``among``, and the words after it."""
    for i, a in enumerate(argv):
        if not a.startswith("-"):
            return (a, list(argv[i + 1:])) if a in among else (None, [])
    return None, []


def build_parser(argv: Optional[Sequence[str]] = ()) -> argparse.ArgumentParser:
    """The parser; only the command named in ``argv`` gets its arguments (all of them if ``argv`` is None).
    A command's ``configure`` gets the words after its name (None: configure everything)."""
    from kvtier import __version__

    parser = argparse.ArgumentParser(prog="kvtier", description="Predictive KV-cache tiering daemon.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen, rest = chosen_word(argv, COMMANDS) if argv is not None else (None, None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or name == chosen:
            importlib.import_module(module).configure(name, p, rest)
    return parser


# Expected failures, by class (module.qualname, matched along the MRO): bad input, a missing or
# busy file or port, an unreachable daemon, a directory another daemon holds. They print one line;
# anything else is a bug and keeps its traceback. Names, not classes: nothing is imported for this.
EXPECTED: frozenset[str] = frozenset({
    "builtins.ValueError",  # bad arguments, ConfigError, pydantic's ValidationError
    "builtins.OSError",  # files, ports (FileNotFoundError, PermissionError, TimeoutError ...)
    "kvtier.client.replies.KvtierError",  # no daemon, no reply, a rejected request
    "kvtier.daemon.dirlock.DirInUse",  # another daemon holds the runtime or NVMe directory
    "kvtier.cli.output.CliError",
    "kvtier.tiers.remote_store.RemoteError",  # the remote tier's cluster refused us or cannot be reached
})


def _expected(e: BaseException) -> bool:
    return any(f"{c.__module__}.{c.__qualname__}" in EXPECTED for c in type(e).__mro__)


def _one_line(e: BaseException) -> str:
    """The message of ``e`` on one line (config errors list one problem a line)."""
    if isinstance(e, OSError) and e.strerror:
        text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror  # the path is the subject
    else:
        text = str(e) or type(e).__name__
    return "; ".join(part.strip() for part in text.splitlines() if part.strip())


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return 2
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if not _expected(e):
            raise
        print(f"kvtier: error: {_one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
