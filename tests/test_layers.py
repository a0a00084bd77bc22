"""The packages are layers that only point down, and no modules import each other.

From the bottom: the library (`dsec/` without `launch/` and `cli/`); `controlplane/` and
`agent/`, which do not import each other; the launchers (`dsec/launch/`); `bench/`; the
CLI (`dsec/cli/`). The graph is read from the source, every import counted: at the top,
inside functions and under TYPE_CHECKING alike.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("dsec", "controlplane", "agent", "bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")}


def ours(name: str) -> str | None:
    """The module of ours that importing `name` runs (a name inside one: that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imported(module: str) -> Iterator[str]:
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from a import b` runs a.b when b is a module, else a alone
            names = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for name in names:
            if (target := ours(name)) and target != module:
                yield target


GRAPH = {module: set(imported(module)) for module in MODULES}


def layer(module: str) -> int:
    if module == "dsec.cli" or module.startswith("dsec.cli."):
        return 4
    if module.split(".")[0] == "bench":
        return 3
    if module == "dsec.launch" or module.startswith("dsec.launch."):
        return 2
    if module.split(".")[0] in ("controlplane", "agent"):
        return 1
    return 0


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components of more than one module: each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while (w := stack.pop()) != v:
                on_stack.discard(w)
                component.add(w)
            on_stack.discard(v)
            if component:
                cycles.append(component | {v})

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_graph_is_read_from_every_package():
    assert {"dsec.policy", "dsec.launch.local", "controlplane.scheduler", "agent.node"} <= set(
        MODULES
    )
    assert "controlplane.scheduler" in GRAPH["dsec.launch.local"] or any(
        m.startswith("controlplane.") for m in GRAPH["dsec.launch.local"]
    )


def test_no_package_imports_one_above_it():
    upward = sorted(
        f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if layer(b) > layer(a)
    )
    assert upward == []


def test_the_control_plane_and_the_agent_do_not_import_each_other():
    across = sorted(
        f"{a} -> {b}"
        for a, targets in GRAPH.items()
        for b in targets
        if layer(a) == layer(b) == 1 and a.split(".")[0] != b.split(".")[0]
    )
    assert across == []


def test_no_import_cycle():
    assert [sorted(c) for c in strongly_connected(GRAPH)] == []
