"""The ``peak`` memory mode's measurement (``python -m benchmarks.memory peak``) on this job's ranks.

argv: OUT_DIR LAYOUTS, a comma list of ``benchmarks.memory.peak`` layout keys. Each rank measures its peak of
activation bytes under every layout, one after another, and writes rank{r}.json (``measure_layouts``).
"""

from pathlib import Path

from benchmarks.memory.peak import measure_layouts
from entry import run_script


def main(out_dir: Path, args: list[str]) -> None:
    measure_layouts(out_dir, args[0].split(","))


if __name__ == "__main__":
    run_script(main)
