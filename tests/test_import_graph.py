"""Layers only point down (docs/engine.md "Layering"): ds4py's import graph, function-local and TYPE_CHECKING
imports included, has no cycle; the CUDA backend never imports the numpy reference (`ds4py.cuda` -> `ds4py.ref`),
and the numpy twins under ds4py/cuda/twins (test oracles, which may import ref) are imported by nothing in ds4py
but other twins. Every test file runnable alone: this one reads source only, it imports nothing from ds4py."""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "ds4py"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PKG.rglob("*.py"))}


def resolve(target: str, modules: dict[str, Path]) -> str | None:
    """The most specific ds4py module `target` names (a dotted name that may continue into a module's attribute)."""
    while target and target not in modules:
        target = target.rpartition(".")[0]
    return target or None


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every ds4py module `name` imports anywhere in its source: top level, in functions, under TYPE_CHECKING."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(t for a in node.names if (t := resolve(a.name, modules)))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                head = ".".join(base + ([node.module] if node.module else []))
            else:
                head = node.module or ""
            if not (head == "ds4py" or head.startswith("ds4py.")):
                continue
            for alias in node.names:
                # `from pkg import sub` imports the submodule; `from mod import obj` imports mod.
                sub = f"{head}.{alias.name}"
                target = sub if sub in modules else resolve(head, modules)
                if target:
                    found.add(target)
    found.discard(name)
    return found


@lru_cache(maxsize=1)
def import_graph() -> dict[str, set[str]]:
    """ds4py module -> the ds4py modules it imports (read once per run; callers do not change it)."""
    modules = all_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan), as a closed path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # the graph has a few hundred nodes: recursion depth is fine
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                components.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_path_through(graph, set(c)) for c in components]


def _path_through(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest cycle through the component's first module (breadth-first), to print."""
    start = min(comp)
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start] + path[::-1][1:] + [start] if len(path) > 1 else [start, v, start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def is_twin(name: str) -> bool:
    return name == "ds4py.cuda.twins" or name.startswith("ds4py.cuda.twins.")


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_local_and_relative_imports_are_edges():
    g = import_graph()
    assert "ds4py.server.app" in g["ds4py.cli.serve"]          # imported inside serve's function
    assert {"ds4py.server.openai", "ds4py.server.page"} <= g["ds4py.server.app"]   # `from . import openai, page`
    assert len(g) > 100 and sum(map(len, g.values())) > 300


def test_import_graph_has_no_cycle():
    found = cycles(import_graph())
    assert not found, f"{len(found)} import cycle(s) in ds4py:\n" + "\n".join(" -> ".join(c) for c in found)


def test_cuda_never_imports_ref():
    bad = [
        f"{m} -> {t}"
        for m, ts in import_graph().items()
        if m.startswith("ds4py.cuda") and not is_twin(m)
        for t in sorted(ts)
        if t == "ds4py.ref" or t.startswith("ds4py.ref.")
    ]
    assert not bad, "the CUDA backend imports the numpy reference:\n" + "\n".join(bad)


def test_only_twins_import_twins():
    bad = [f"{m} -> {t}" for m, ts in import_graph().items() if not is_twin(m) for t in sorted(ts) if is_twin(t)]
    assert not bad, "a test oracle (ds4py/cuda/twins) is imported outside the tests:\n" + "\n".join(bad)


def test_nothing_in_ds4py_imports_the_old_model_module():
    """ds4py.model only re-exports the contract and the factory for scripts; inside ds4py the layers are named."""
    bad = sorted(m for m, ts in import_graph().items() if "ds4py.model" in ts)
    assert not bad, f"import ds4py.contract / ds4py.backends instead of ds4py.model: {bad}"


def test_the_layers_named_in_docs_point_down():
    """config -> schema (never back); convert / convert_v41 / engram are acyclic (ds4py.checkpoint below them)."""
    graph = import_graph()
    assert "ds4py.schema" in graph["ds4py.config"] and "ds4py.config" not in graph["ds4py.schema"]
    assert "ds4py.convert" not in graph["ds4py.engram"] | graph["ds4py.convert_v41"]


def test_run_chat_and_serve_share_one_driver():
    """One generation driver (ds4py.driver) under Session.generate (run, chat) and the server's scheduler; it
    sits below both: it imports neither the session nor anything of the server."""
    graph = import_graph()
    assert "ds4py.driver" in graph["ds4py.session"] and "ds4py.driver" in graph["ds4py.server.scheduler"]
    above = sorted(t for t in graph["ds4py.driver"] if t == "ds4py.session" or t.startswith("ds4py.server"))
    assert not above, f"the driver imports a layer above it: {above}"
