"""Plain-text tables, for the command line and the benchmarks' reports."""

from __future__ import annotations


def format_table(headers: list[str], rows: list[list[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart, the headers first."""
    cells = [headers] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in cells)
