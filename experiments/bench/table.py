"""Plain-text tables for benchmark records."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if value == 0 or 1e-3 <= abs(value) < 1e5:
            return f"{value:.4g}"
        return f"{value:.3e}"
    return "-" if value is None else str(value)


def format_table(records: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> str:
    """Align `records` in columns (those of the given ones that some record has, or every
    key in first-seen order)."""
    if not records:
        return "(no records)"
    columns = [c for c in columns or () if any(c in r for r in records)]
    if not columns:
        columns = list(dict.fromkeys(k for r in records for k in r))
    rows = [[_cell(r.get(c)) for c in columns] for r in records]
    widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
