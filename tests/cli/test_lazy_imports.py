"""Help and a bad flag answer at once: the CLI imports a command's heavy modules (torch,
transformers, the daemon) only to run it, and ``kvtier bench`` only the bench named."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from kvtier.cli.bench import BENCHES

# runs ``main(argv)`` in a fresh interpreter and prints whether torch got imported
PROBE = """
import sys
from kvtier.cli.main import main
try:
    main({argv!r})
except SystemExit:
    pass
print("torch imported:", "torch" in sys.modules)
"""


@pytest.mark.parametrize("argv", [
    ["bench", "--help"],
    ["bench", "rpc", "--help"],
    ["bench", "rpc", "--iters", "0"],
    ["demo", "--help"],
    ["demo", "--budget", "0"],  # 3.8 s before, importing the model's modules for the choices
    ["bench", "tiers-runs", "no-such-run.json"],  # pooling saved runs measures nothing
])
def test_help_and_bad_flags_do_not_import_torch(argv):
    r = subprocess.run([sys.executable, "-c", PROBE.format(argv=argv)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == "torch imported: False", r.stdout


def test_the_named_bench_gets_its_arguments_and_the_others_none():
    from kvtier.cli.main import build_parser

    args = build_parser(["bench", "scale", "--seconds", "2"]).parse_args(["bench", "scale", "--seconds", "2"])
    assert args.bench == "scale" and args.seconds == 2.0 and callable(args.func)


def test_each_bench_summary_is_the_first_line_of_its_module_docstring():
    for name, (module, summary) in BENCHES.items():
        doc = importlib.import_module(module).__doc__ or ""
        assert doc.strip().splitlines()[0] == summary, name
