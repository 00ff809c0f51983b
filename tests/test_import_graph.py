"""The package's imports form no circle, and the lower layers never import the upper ones.

Read from the source with ``ast``: every import statement counts, those inside functions too (a lazy import
that closes a circle is still a circle; it only moves the failure to run time). A package counts as its
``__init__.py``. ``sys.modules`` cannot tell: importing any part of ``lightning_megatron`` imports all of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_megatron"

# Layers that know nothing of what is built on them (DESIGN.md: imports run downward).
LOWER_LAYERS = ("lightning_megatron.models", "lightning_megatron.tensor_parallel", "lightning_megatron.peft")
UPPER_LAYERS = ("lightning_megatron.strategy", "lightning_megatron.checkpoint", "lightning_megatron.cli",
                "lightning_megatron.plan")


def module_names() -> dict[str, Path]:
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph() -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (the nearest existing module of
    each imported name: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``)."""
    modules = module_names()

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(nearest(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    kept = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(kept + ([node.module] if node.module else []))
                targets.update(nearest(f"{base}.{alias.name}") for alias in node.names)
        graph[name] = {target for target in targets if target is not None and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_circles_finds_a_circle_of_three_and_ignores_a_chain():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "lightning_megatron.parallel.state" in graph["lightning_megatron.strategy.lightning"]  # the scan sees imports
    assert "lightning_megatron.models.flops" in graph["lightning_megatron.models.gpt"]
    assert circles(graph) == []


def test_lower_layers_never_import_upper_ones():
    graph = import_graph()
    offending = sorted((module, target) for module, targets in graph.items() if module.startswith(LOWER_LAYERS)
                       for target in targets if target.startswith(UPPER_LAYERS))
    assert offending == []
