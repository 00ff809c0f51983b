"""The models never import the Hugging Face package or the checkpoint code, which import the models (no import circle).

Read from the source with ``ast``, every import statement counted, those inside functions too: importing
``lightning_megatron.models`` at run time imports the whole package (``lightning_megatron/__init__.py``), so
``sys.modules`` cannot tell. ``GPT.from_hf``/``to_hf`` find their converter in ``models/formats.py``, where the
Hugging Face package registers it, and ``load_from_checkpoint`` its sharded reader, registered by ``checkpoint.sharded``.
"""

import ast
from pathlib import Path

MODELS = Path(__file__).resolve().parents[1] / "lightning_megatron" / "models"
FORBIDDEN = ("lightning_megatron.huggingface", "lightning_megatron.checkpoint")


def imports(path: Path) -> set[tuple[str, str, str]]:
    """(file, enclosing function or "<module>", imported module) for every import statement in ``path``."""
    found = set()

    def visit(node: ast.AST, scope: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else scope
            if isinstance(child, ast.Import):
                found.update((path.name, scope, alias.name) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                package = "lightning_megatron.models".rsplit(".", child.level - 1)[0] if child.level else ""
                module = ".".join(part for part in (package, child.module) if part)
                found.update((path.name, scope, f"{module}.{alias.name}") for alias in child.names)
            visit(child, inner)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_models_import_neither_the_hugging_face_package_nor_checkpoint_code():
    every = set().union(*(imports(path) for path in sorted(MODELS.glob("*.py"))))
    assert any(module.startswith("lightning_megatron.models.formats") for _, _, module in every)  # the scan sees imports
    offending = {(file, scope, module) for file, scope, module in every if module.startswith(FORBIDDEN)}
    assert not offending, sorted(offending)
