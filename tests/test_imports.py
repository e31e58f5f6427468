"""The product's import graph, read statically (ast) from the source: no cycles between
modules, the product never imports the dev tools or the tests, weight_calculator stands
alone, the config layer imports nothing of the rest, and `trimtab validate` stays light
(checked in a fresh interpreter, from `sys.modules`).

Edges: every `import x` and absolute or relative `from x import y` anywhere in a module
(function bodies included); `from package import name` points at the submodule when `name`
is one. Imports under `if TYPE_CHECKING:` never run, so they are left out of the cycle check
(they stay in the others: the product must not even name the dev tools in a type)."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("xds_server", "weight_calculator")
DEV = ("trimtab_dev", "tests")


@dataclass(frozen=True)
class Edge:
    target: str
    line: int
    type_only: bool  # under `if TYPE_CHECKING:`


def module_files(packages: tuple[str, ...] = PRODUCT, root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `packages`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement with whether it sits under `if TYPE_CHECKING:` (its `else`
    branch runs, so it counts)."""
    todo: list[tuple[ast.AST, bool]] = [(tree, False)]
    while todo:
        node, type_only = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, type_only
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            todo += [(child, True) for child in node.body]
            todo += [(child, type_only) for child in node.orelse]
            continue
        todo += [(child, type_only) for child in ast.iter_child_nodes(node)]


def _base(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (node.level - 1)]
    return ".".join([*parts, *([node.module] if node.module else [])])


def imports_of(module: str, path: Path, known: Mapping[str, Path]) -> list[Edge]:
    """What `module` imports: project modules by their full name, others as written."""
    edges = []
    for node, type_only in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges += [Edge(alias.name, node.lineno, type_only) for alias in node.names]
            continue
        base = _base(module, path.name == "__init__.py", node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            edges.append(Edge(sub if sub in known else base, node.lineno, type_only))
    return edges


def import_graph(packages: tuple[str, ...] = PRODUCT, root: Path = ROOT
                 ) -> dict[str, list[Edge]]:
    known = module_files(packages, root)
    return {module: imports_of(module, path, known) for module, path in known.items()}


def _runtime_successors(graph: Mapping[str, list[Edge]]) -> dict[str, list[str]]:
    return {m: sorted({e.target for e in edges if not e.type_only and e.target in graph})
            for m, edges in graph.items()}


def tangles(graph: Mapping[str, list[Edge]]) -> list[set[str]]:
    """The strongly connected components of the runtime edges between the nodes of `graph`
    that hold a cycle (Tarjan, iterative)."""
    succ = _runtime_successors(graph)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in sorted(succ):
        if start in index:
            continue
        work = [(start, iter(succ[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.add(top)
                        if top == node:
                            break
                    if len(component) > 1 or node in succ[node]:
                        components.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(succ[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def cycles(graph: Mapping[str, list[Edge]]) -> list[list[str]]:
    """One concrete cycle (a, b, ..., a) per tangle of `graph`."""
    succ = _runtime_successors(graph)
    return sorted(_cycle_in(component, succ) for component in tangles(graph))


def _cycle_in(component: set[str], succ: Mapping[str, list[str]]) -> list[str]:
    """A shortest path from the component's first module back to itself (breadth first)."""
    start = min(component)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in succ[node]:
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child in component and child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no cycle through {start}")  # unreachable for an SCC


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def _offences(graph: Mapping[str, list[Edge]], forbidden: tuple[str, ...],
              who: tuple[str, ...] = PRODUCT) -> list[str]:
    """`module:line imports target` for every import from a module under `who` of
    anything under `forbidden`."""
    return [f"{module}:{edge.line} imports {edge.target}"
            for module, edges in graph.items() if _within(module, who)
            for edge in edges if _within(edge.target, forbidden)]


# -- the checks ------------------------------------------------------------------------------


def test_the_walk_sees_the_graph() -> None:
    """The walker itself: modules found, submodule names resolved, function-level and
    TYPE_CHECKING imports seen (else every check below would pass on an empty graph)."""
    graph = import_graph()
    assert len(graph) > 50
    cli = {e.target for e in graph["xds_server.cli"]}
    assert "xds_server.app" in cli  # imported inside _serve()
    assert "xds_server.config.load" in cli
    pools = graph["xds_server.config.pools"]
    assert [e.type_only for e in pools if e.target == "xds_server.config.schema"] == [True]
    views = {e.target for e in graph["xds_server.envoy.views"]}
    assert "xds_server.envoy.request_features" in views  # `from xds_server.envoy import ...`


def test_cycles_are_found(tmp_path: Path) -> None:
    """The cycle finder on a made-up package: a -> b -> c -> a through a function-level and
    a relative import; d -> a only under TYPE_CHECKING does not count."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pkg import a\n")
    (package / "e.py").write_text("from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    pass\nelse:\n    from pkg import e\n")
    assert cycles(import_graph(("pkg",), tmp_path)) == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"],
                                                        ["pkg.e", "pkg.e"]]


def test_no_import_cycles_between_modules() -> None:
    found = cycles(import_graph())
    assert found == [], "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)


def package_of(module: str) -> str:
    """The part of the product a module belongs to: `xds_server.control.rollouts.state`
    -> `xds_server.control`; a top-level module (`xds_server.cli`) is its own part."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: Mapping[str, list[Edge]]) -> dict[str, list[Edge]]:
    packages: dict[str, list[Edge]] = {}
    for module, edges in graph.items():
        mine = package_of(module)
        packages.setdefault(mine, []).extend(
            Edge(package_of(e.target), e.line, e.type_only) for e in edges
            if e.target in graph and package_of(e.target) != mine)
    return packages


# Packages that still import each other (issue 14), module level acyclic:
# - admin.metrics is imported by control.controller and xds.server/convergence, while
#   admin.api imports control and xds (metrics as one collector would end it);
# - xds.server imports security.guard, which imports envoy.views, which imports xds.snapshot
#   and xds.type_urls (app handing the gRPC pump its guard would end it);
# Remove a package here once it is out of every cycle; nothing may join.
TANGLED = {"xds_server.admin", "xds_server.control", "xds_server.envoy", "xds_server.security",
           "xds_server.xds"}


def test_package_cycles_do_not_grow() -> None:
    packages = package_graph(import_graph())
    assert {"xds_server.config", "xds_server.envoy", "weight_calculator"} <= set(packages)
    # telemetry left the tangle when the page parser began reading the SLO counters itself
    assert "xds_server.telemetry" not in TANGLED
    tangled = {p for tangle in tangles(packages) for p in tangle}
    assert tangled <= TANGLED, f"new package cycles: {sorted(tangled - TANGLED)}"


def test_the_product_never_imports_the_dev_tools_or_the_tests() -> None:
    assert _offences(import_graph(), DEV) == []


TEST_HOOK_MARKS = ("test_hooks", "TEST_HOOKS", "/v1/test", ".mutators", "test-only")


def test_the_product_holds_no_test_hooks() -> None:
    """Fault injection (the hooked controller, its hooks server) lives in tests/support/:
    no test module, hook, switch or `/v1/test` route ships in the product."""
    files = module_files()
    assert "xds_server.control.controller" in files and "xds_server.admin.api" in files
    assert [m for m in files if m.rpartition(".")[2].startswith("test")] == []
    marked = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
              for path in files.values()
              for number, line in enumerate(path.read_text().splitlines(), 1)
              if any(mark in line for mark in TEST_HOOK_MARKS)]
    assert marked == []


RECONCILE_BYPASS = re.compile(
    r"controller\.(apply_config|publish|publish_off_loop|ingest|set_\w+|_\w+)\b"
    r"|controller\.(weights|canary_percent|config|auto)\s*=[^=]")


def test_other_parts_change_what_is_served_only_through_reconcile() -> None:
    """One reconcile path (issue 14): admin, discovery and reload ask the controller to
    `reconcile`; outside control/ nothing applies configs, publishes, or sets its state."""
    files = {m: p for m, p in module_files().items() if not m.startswith("xds_server.control")}
    assert "xds_server.app" in files and "xds_server.admin.api" in files
    offences = [f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
                for path in files.values()
                for number, line in enumerate(path.read_text().splitlines(), 1)
                if RECONCILE_BYPASS.search(line)]
    assert offences == []
    assert "controller.reconcile(" in files["xds_server.app"].read_text()


def test_weight_calculator_imports_nothing_of_xds_server() -> None:
    assert _offences(import_graph(), ("xds_server",), who=("weight_calculator",)) == []


def test_the_config_layer_imports_only_itself_pydantic_and_yaml() -> None:
    """Config is the bottom layer: the security, envoy, xds and admin parts import it, never
    the reverse (that cycle made `trimtab validate` load grpc and the Envoy protos)."""
    allowed = {"xds_server.config", "pydantic", "yaml", "__future__", *sys.stdlib_module_names}
    graph = {m: e for m, e in import_graph().items() if m.startswith("xds_server.config")}
    assert len(graph) >= 5
    wrong = [f"{module}:{edge.line} imports {edge.target}" for module, edges in graph.items()
             for edge in edges if not _within(edge.target, tuple(allowed))]
    assert wrong == []


_VALIDATE = """
import json, sys
from xds_server.cli import main
status = main(["validate", "--config", "examples/local.yaml"])
print(json.dumps({"status": status, "modules": sorted(sys.modules)}))
"""


def test_trimtab_validate_loads_neither_grpc_nor_aiohttp_nor_the_envoy_protos() -> None:
    done = subprocess.run([sys.executable, "-c", _VALIDATE], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, check=True)
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["status"] == 0
    assert "xds_server.config.load" in report["modules"]
    heavy = ("grpc", "aiohttp", "envoy", "xds_server.envoy", "xds_server.xds",
             "xds_server.security", "xds_server.app")
    loaded = [m for m in report["modules"] if _within(m, heavy)]
    assert loaded == []


def test_the_tree_imports_config_names_from_their_modules() -> None:
    """xds_server/config/__init__.py re-exports the public API for outside callers; inside
    the project every name is imported from the module that defines it (one spelling per
    name, so the graph above shows what each module really needs)."""
    graph = import_graph(("xds_server", "weight_calculator", "trimtab_dev", "tests",
                          "benchmarks"))
    assert "xds_server.config" in graph and "benchmarks.push_latency" in graph
    wrong = [f"{module}:{edge.line}" for module, edges in graph.items()
             if module != "xds_server.config"
             for edge in edges if edge.target == "xds_server.config"]
    assert wrong == []
