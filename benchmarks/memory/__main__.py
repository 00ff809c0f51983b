"""``python -m benchmarks.memory MODE [flags]``: dispatch to one mode's ``main(argv)`` (see ``__init__.py``)."""

from __future__ import annotations

import importlib
import sys
from typing import Optional

MODES = {
    "model-state": "model_state",
    "activations": "activations",
    "peak": "peak",
    "logits": "logits",
    "formulas": "formulas",
    "planner": "planner",
}


def main(argv: Optional[list[str]] = None) -> object:
    """Run ``argv[0]``'s mode with the rest of ``argv``; its return value (the rows some modes return) is returned."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in MODES:
        from benchmarks import memory

        names = ", ".join(MODES)
        sys.exit(f"usage: python -m benchmarks.memory MODE [flags]  (MODE one of: {names}; "
                 f"MODE --help for its flags)\n\n{memory.__doc__}")
    module = importlib.import_module(f"benchmarks.memory.{MODES[argv[0]]}")
    return module.main(argv[1:], prog=f"python -m benchmarks.memory {argv[0]}")


if __name__ == "__main__":
    main()
