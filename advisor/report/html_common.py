"""Helpers shared by the HTML report's modules: escaping, number formatting, tables.

Every text from the inputs passes through `_e`; numbers that are missing, booleans or
not finite print as a dash.
"""

from __future__ import annotations

import html
import math
from collections.abc import Iterable
from typing import Any

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf")
DASH = "—"


def _e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _f(x: Any, fmt: str = ".3f", unit: str = "") -> str:
    v = _num(x)
    return DASH if v is None else f"{v:{fmt}}{unit}"


def _bytes(x: Any) -> str:
    v = _num(x)
    if v is None:
        return DASH
    for unit in ("B", "KB", "MB", "GB"):
        if abs(v) < 1000:
            return f"{v:.0f} {unit}"
        v /= 1000
    return f"{v:.1f} TB"


def _table(headers: Iterable[str], rows: Iterable[Iterable[tuple[str, bool]]],
           total: int | None = None) -> str:
    """Cells are (already-escaped html, numeric); row index `total` is styled as a total."""
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = []
    for i, row in enumerate(rows):
        cells = "".join(f'<td class="n">{c}</td>' if n else f"<td>{c}</td>" for c, n in row)
        body.append(f'<tr class="total">{cells}</tr>' if i == total else f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _cell(v: Any) -> tuple[str, bool]:
    if v is None:
        return DASH, False
    if isinstance(v, float):
        return (f"{v:.4g}" if math.isfinite(v) else DASH), True
    if isinstance(v, (list, tuple, dict)):
        return _e(str(v)[:200]), False
    return _e(v), isinstance(v, int) and not isinstance(v, bool)
