"""``kvtier config show|validate|schema``."""

from __future__ import annotations

import argparse
import json
import sys

from kvtier.cli.serve import add_config_args


def configure(name: str, p: argparse.ArgumentParser) -> None:
    csub = p.add_subparsers(dest="config_cmd", metavar="ACTION")
    show = csub.add_parser("show", help="print the effective config (defaults < file < env < --set) as TOML-like JSON")
    add_config_args(show)
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


def cmd_show(args: argparse.Namespace) -> int:
    from kvtier.daemon.config import load_config

    print(json.dumps(load_config(args.config, overrides=args.overrides).model_dump(), indent=2))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from kvtier.daemon.config import ConfigError, load_config

    try:
        load_config(args.file, environ={})
    except ConfigError as e:
        print(f"{e}", file=sys.stderr)
        return 1
    print(f"{args.file}: ok")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    from kvtier.daemon.config import KvtierConfig

    print(json.dumps(KvtierConfig.model_json_schema(), indent=2))
    return 0
