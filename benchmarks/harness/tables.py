"""Printing results: aligned text tables and byte units (no torch import, so a script can print before it sets
torch's threads)."""

from __future__ import annotations

from typing import Iterable

MIB = 2**20
GIB = 2**30


def format_rows(rows: list[list[str]], left: Iterable[int] = (0,)) -> str:
    """``rows`` (the header first) as a text table: columns padded to their widest cell, the ``left`` ones (text)
    left-aligned and the rest (numbers) right-aligned, a rule under the header. Every benchmark prints with it."""
    left = set(left)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" | ".join(cell.ljust(w) if i in left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)
