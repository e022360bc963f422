"""The import graph respects the written layer rules and has no cycles.

Every ``kvtier`` import in every module counts, whether at module level, inside
a function or under ``TYPE_CHECKING``: a lazy import is still a dependency.
The rules are the README's "Architecture" section, as data.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# folder -> the kvtier packages it may import (besides itself and the ``kvtier`` root for the version)
ALLOWED: dict[str, set[str]] = {
    "protocol": set(),
    "kernels": set(),
    "scoring": set(),
    "predictor": {"kernels"},  # the compiled victim search (kernels/_value.c)
    "tiers": {"kernels", "protocol"},
    "policy": {"predictor", "scoring", "tiers", "kernels"},  # the compiled replay loop (kernels/_replay.c)
    "daemon": {"protocol", "kernels", "tiers", "scoring", "predictor", "policy"},
    "client": {"protocol"},
    "connectors": {"client", "protocol"},  # engine side: never the daemon
    "replay": {"policy", "predictor", "scoring", "tiers", "daemon"},
    "bench": {"protocol", "client", "kernels", "tiers", "scoring", "predictor", "policy", "daemon"},
    "cli": {"protocol", "client", "kernels", "tiers", "scoring", "predictor", "policy", "daemon", "replay", "bench"},
}
ENGINE_SIDE_FORBIDDEN = ("kvtier.daemon", "kvtier.policy", "kvtier.replay", "kvtier.bench", "kvtier.cli",
                         "scipy", "prometheus_client", "transformers")  # hf_cache is a transformers Cache: not in its list


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[:2] == ["daemon", "_root"]:
        parts = parts[2:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["kvtier", *parts])


def _imports(path: Path, name: str) -> set[str]:
    """kvtier modules ``path`` imports, resolved to module names."""
    tree = ast.parse(path.read_text(), str(path))
    pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("kvtier")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            if base.startswith("kvtier"):
                out |= {f"{base}.{a.name}" for a in node.names} | {base}
    return out


def _graph() -> dict[str, set[str]]:
    files = [ROOT / d / f for d in ALLOWED for f in os.listdir(ROOT / d) if f.endswith(".py")]
    files += [ROOT / "daemon" / "_root" / "__init__.py"]
    names = {_module_name(p): p for p in files}
    # compiled extensions (setup.py builds kernels/*.c as kvtier.kernels.<name>) are modules too
    compiled = {_module_name(ROOT / d / f) for d in ALLOWED for f in os.listdir(ROOT / d) if f.endswith(".c")}
    graph: dict[str, set[str]] = {name: set() for name in compiled}
    for name, path in names.items():
        # "from kvtier.x import y" names a module or an attribute: keep what is a module
        graph[name] = {m for m in _imports(path, name) if (m in names or m in compiled) and m != name}
    return graph


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_folder_imports_only_the_layers_below_it():
    bad = []
    for mod, deps in _graph().items():
        own = _layer(mod)
        for dep in deps:
            layer = _layer(dep)
            if own and layer and layer != own and layer not in ALLOWED[own]:
                bad.append(f"{mod} -> {dep}")
    assert not bad, "imports that break the layer rules:\n" + "\n".join(sorted(bad))


def test_the_import_graph_has_no_cycles():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    # a package __init__ that re-exports its own modules (policy registry) is not a cycle between modules
    real = [c for c in cycles if not all(_layer(m) == _layer(c[0]) and
                                         any(m == f"kvtier.{_layer(m)}" for m in c) for m in c)]
    assert not real, f"import cycles: {real}"


def _run_isolated(code: str) -> str:
    """Run ``code`` in a fresh interpreter; return what it prints."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_an_engine_importing_the_client_loads_nothing_of_the_daemon():
    loaded = _run_isolated("""
        import sys
        import kvtier.client.tier_client
        print("\\n".join(sorted(sys.modules)))
    """).split()
    bad = [m for m in loaded if any(m == p or m.startswith(p + ".") for p in ENGINE_SIDE_FORBIDDEN)]
    assert not bad, bad


def test_cli_help_version_and_stats_need_neither_torch_nor_transformers():
    out = _run_isolated("""
        import importlib.abc, sys

        class Refuse(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("torch", "transformers", "scipy"):
                    raise ImportError(f"{name} must not be imported by this command")
                return None

        sys.meta_path.insert(0, Refuse())
        from kvtier.cli.main import main
        for argv in (["--version"], ["--help"], ["stats", "--help"], ["reload", "--help"]):
            try:
                main(argv)
            except SystemExit as e:
                assert e.code == 0, (argv, e.code)
        rc = main(["stats", "--runtime-dir", "/nonexistent-kvtier-runtime"])  # no daemon: one line, exit 1
        print("stats rc", rc)
    """)
    assert "kvtier " in out and "stats rc 1" in out
