"""The package's imports run one way: down an ordered list of layers, with no circle between modules or parts.

Read from the source with ``ast``: every import statement counts, those inside functions too (a lazy import
that closes a circle is still a circle; it only moves the failure to run time). A package counts as its
``__init__.py``. ``sys.modules`` cannot tell: importing any part of ``lightning_megatron`` imports all of it.

A *part* is the first name under ``lightning_megatron`` (``parallel`` for ``lightning_megatron.parallel.state``;
a top-level module is a part of its own; the package's ``__init__`` is the part ``lightning_megatron``).
``LAYERS`` orders every part from the bottom up (docs/architecture.md, "Layers"): a module may import modules
of its own part or of a lower layer, never of its own layer's other parts nor of a higher one. A new part
must be placed in a layer, or this test fails.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_megatron"
ROOT = PACKAGE.name

# Bottom to top. What each layer holds (docs/architecture.md has the full map):
LAYERS = [
    ["checksums", "offload"],                               # leaves: checksums, offload tiers' settings and files
    ["parallel"],                                           # base: sizes, mesh, groups, RNG, shards, name matching
    ["tensor_parallel", "optim"],                           # parallel layers and collectives; step machinery
    ["context_parallel", "peft", "pipeline", "generation"],  # kernels and declarations the models are built from
    ["models", "data"],                                     # models and their data
    ["expert_parallel", "transforms"],                      # machinery over built models
    ["checkpoint"],                                         # layout-free checkpoints (the library)
    ["huggingface"],                                        # interop: conversion, export, LoRA export
    ["plan"],                                               # the planner library
    ["strategy"],                                           # the Lightning strategy package
    ["callbacks", "simulate"],                              # Lightning callbacks; one rank's step, simulated
    ["commands"],                                           # command-line tools: plan, checkpoint, generate, ...
    ["cli_errors"],                                         # the command line's error reports
    [ROOT],                                                 # `import lightning_megatron`
    ["cli"],                                                # `lightning-megatron`, which imports the package
]


def module_names(package: Path = PACKAGE) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each module of the package -> the modules of the package it imports (the nearest existing module of
    each imported name: ``from a.b import c`` is ``a.b.c`` when that is a module, else ``a.b``)."""
    modules = module_names(package)

    def nearest(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, path in modules.items():
        package_name = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(nearest(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    kept = package_name.split(".")[: len(package_name.split(".")) - (node.level - 1)]
                    base = ".".join(kept + ([node.module] if node.module else []))
                targets.update(nearest(f"{base}.{alias.name}") for alias in node.names)
        graph[name] = {target for target in targets if target is not None and target != name}
    return graph


def part_of(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def checked_edges(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import of one module by another."""
    return sorted((source, target) for source, targets in graph.items() for target in targets)


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


def test_the_scan_sees_lazy_and_relative_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "low").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low" / "__init__.py").write_text("from .names import match\n")
    (package / "low" / "names.py").write_text("def match():\n    from pkg.high import tool\n")
    (package / "high.py").write_text("from pkg.low import names\ntool = 1\n")
    assert import_graph(package) == {"pkg": set(), "pkg.low": {"pkg.low.names"}, "pkg.low.names": {"pkg.high"},
                                     "pkg.high": {"pkg.low.names"}}
    assert circles(import_graph(package)) == [["pkg.high", "pkg.low.names"]]


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "lightning_megatron.parallel.state" in graph["lightning_megatron.strategy.lightning"]  # the scan sees imports
    assert "lightning_megatron.models.flops" in graph["lightning_megatron.models.gpt"]
    assert circles(graph) == []


def test_every_part_has_a_layer():
    placed = [part for layer in LAYERS for part in layer]
    assert len(placed) == len(set(placed)), "a part is placed twice"
    parts = {part_of(module) for module in module_names()}
    assert sorted(parts - set(placed)) == [], "place the new part in LAYERS (and in docs/architecture.md)"


def test_imports_run_down_the_layers():
    rank = {part: height for height, layer in enumerate(LAYERS) for part in layer}
    upward = [f"{source} ({part_of(source)}) imports {target} ({part_of(target)})"
              for source, target in checked_edges(import_graph())
              if part_of(source) != part_of(target) and rank[part_of(source)] <= rank[part_of(target)]]
    assert upward == []


def test_no_two_parts_import_each_other():
    parts: dict[str, set[str]] = {}
    for source, target in checked_edges(import_graph()):
        parts.setdefault(part_of(source), set())
        parts.setdefault(part_of(target), set())
        if part_of(source) != part_of(target):
            parts[part_of(source)].add(part_of(target))
    assert "parallel" in parts["tensor_parallel"]  # the part graph holds the edges
    assert circles(parts) == []
