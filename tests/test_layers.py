"""The import graph of ``src/durably`` points one way: no circle, no layer reaching up.

basics ← domain ← store ← engine ← the ``App`` facade ← server ← the public package ← the
demo ← the CLI. Every import counts, also those made only for type checking or inside a
function: each is a dependency a reader has to hold in mind.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "durably"

LAYERS: dict[str, int] = {
    # basics: values, names and mechanisms that know nothing of runs
    "durably.errors": 0,
    "durably.values": 0,
    "durably.status": 0,
    "durably.keys": 0,
    "durably.faults": 0,
    "durably.metrics": 0,
    "durably.loop": 0,
    "durably.owners": 0,
    # domain: the records of the protocol and the pure rules over them
    "durably.checkpoint": 1,
    "durably.ledger": 1,
    "durably.definitions": 1,
    "durably.model_calls": 1,
    "durably.reconcile": 1,
    "durably.redaction": 1,
    "durably.registry": 1,
    # store: persistence behind one contract
    "durably.store": 2,
    # engine: executing runs, given its collaborators
    "durably.engine": 3,
    "durably.actions": 3,
    "durably.fork": 3,
    "durably.whatif": 3,
    "durably.views": 3,
    "durably.calls": 3,
    "durably.execution": 3,
    "durably.approval_join": 3,
    "durably.stops": 3,
    "durably.context": 3,
    "durably.runtime": 3,
    "durably.steps": 3,
    "durably.verification": 3,
    "durably.effect": 3,
    "durably.waits": 3,
    "durably.workflow_api": 3,
    "durably.worker": 3,
    "durably.exposition": 3,
    "durably.subscription": 3,
    # the facade
    "durably.registration": 4,
    "durably.app": 4,
    # the console, over the facade
    "durably.server": 5,
    # the public API: re-exports of the layers below
    "durably": 6,
    # the shipped demo agent and its shop: user code of the public API (`import durably`)
    "durably.demo": 7,
    # the command line: the facade, the console and the demo
    "durably.cli": 8,
    "durably.__main__": 9,
    # agent-framework plug-ins: need their optional extras, so nothing in durably imports them
    "durably.integrations": 10,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    name = module
    while name not in LAYERS:
        if "." not in name:
            raise AssertionError(f"{module} is in no layer: add it to LAYERS")
        name = name.rsplit(".", 1)[0]
    return LAYERS[name]


def imports(module: str) -> set[str]:
    """The durably modules ``module`` imports, wherever the import statement is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("durably")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("durably"):
                continue
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in MODULES else node.module)
    return found - {module}


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_layer() -> None:
    for module in MODULES:
        layer(module)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_a_layer_above_its_own(module: str) -> None:
    upward = sorted(m for m in GRAPH[module] if layer(m) > layer(module))
    assert not upward, f"{module} (layer {layer(module)}) imports {upward}"


def test_the_import_graph_has_no_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in GRAPH.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not circles, f"import circles: {circles}"
