"""``kvtier config show|validate|schema``."""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any, Callable, Optional, Sequence

from kvtier.cli.serve import add_config_args


def configure(name: str, p: argparse.ArgumentParser, rest: Optional[Sequence[str]] = None) -> None:
    csub = p.add_subparsers(dest="config_cmd", metavar="ACTION")
    show = csub.add_parser("show", help="print the effective config (defaults < file < env < --set); "
                                        "TOML by default, a file `kvtier serve --config` takes as is")
    add_config_args(show)
    show.add_argument("--format", choices=sorted(FORMATS), default="toml",
                      help="toml (default; unset fields are left out) or json (unset fields as null)")
    show.add_argument("--sources", action="store_true",
                      help="print only the config sources in use, lowest precedence first, one a line")
    show.set_defaults(func=cmd_show)
    val = csub.add_parser("validate", help="check a config file; exit 1 naming the bad key and line")
    val.add_argument("file")
    val.set_defaults(func=cmd_validate)
    sch = csub.add_parser("schema", help="print the JSON Schema of the config")
    sch.set_defaults(func=cmd_schema)

    def show_help(a: argparse.Namespace) -> int:
        p.print_help()
        return 2

    p.set_defaults(func=show_help)


_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(k: str) -> str:
    return k if _BARE_KEY.match(k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    """One TOML value (JSON string escapes are valid TOML basic-string escapes)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return ("inf" if v > 0 else "-inf") if math.isinf(v) else "nan" if math.isnan(v) else repr(v)
    if isinstance(v, (int, str)):
        return json.dumps(v)
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    """A two-level config as TOML: one table per section; None (unset) fields are left out,
    since TOML has no null and an explicit value may be refused (server.tcp_port)."""
    out = []
    for section, fields in data.items():
        out.append(f"[{_toml_key(section)}]")
        out += [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in fields.items() if v is not None]
        out.append("")
    return "\n".join(out)


FORMATS: dict[str, Callable[[dict[str, Any]], str]] = {
    "toml": to_toml,
    "json": lambda d: json.dumps(d, indent=2) + "\n",
}


def cmd_show(args: argparse.Namespace) -> int:
    from kvtier.daemon.config import config_sources, load_config, resolve_config_path

    path = resolve_config_path(args.config)
    cfg = load_config(path, overrides=args.overrides)
    sources = config_sources(path, overrides=args.overrides)
    if args.sources:
        print("\n".join(sources))
        return 0
    text = FORMATS[args.format](cfg.model_dump(mode="json"))
    if args.format == "toml":  # a comment keeps the output a file `kvtier serve --config` takes as is
        text = "".join(f"# source: {s}\n" for s in sources) + "\n" + text
    print(text, end="")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from kvtier.daemon.config import load_config

    load_config(args.file, environ={})  # a ConfigError becomes one "kvtier: error:" line, exit 1
    print(f"{args.file}: ok")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from kvtier.daemon.config import KvtierConfig

    print(json.dumps(KvtierConfig.model_json_schema(), indent=2))
    return 0


__all__ = ["FORMATS", "to_toml"]
