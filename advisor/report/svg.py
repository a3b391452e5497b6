"""SVG drawing primitives for the HTML report: scales, axes, frames, legends.

Plain string builders (no plotting library); every label passes through html.escape.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from html import escape
from typing import Any


def _e(x: Any) -> str:
    return escape(str(x), quote=True)


def svg(width: int, height: int, label: str, body: str) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" role="img" aria-label="{_e(label)}">{body}</svg>')


def legend(items: Iterable[tuple[str, str]]) -> str:
    return "<p>" + "".join(f'<span class="sw" style="background:{c}"></span>{_e(t)}'
                           for t, c in items) + "</p>"


def scale(lo: float, hi: float, a: float, b: float, log: bool = False) -> Callable[[float], float]:
    """[lo, hi] (decade exponents when `log`) onto pixels [a, b]."""
    return lambda v: a + (b - a) * ((math.log10(v) if log else v) - lo) / (hi - lo)


def frame(box: tuple[int, int, int, int]) -> str:
    x0, y0, x1, y1 = box
    return f'<rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}" fill="none" stroke="#999"/>'


def log_span(values: list[float]) -> tuple[float, float]:
    lo, hi = math.floor(math.log10(min(values))), math.ceil(math.log10(max(values)))
    return float(lo), float(hi if hi > lo else lo + 1)


def log_axes(xs: tuple[float, float], ys: tuple[float, float], box: tuple[int, int, int, int]) -> str:
    """Decade grid lines and labels for log10 spans `xs`, `ys` inside box (x0, y0, x1, y1)."""
    x0, y0, x1, y1 = box
    px, py, out = scale(*xs, x0, x1), scale(*ys, y1, y0), [frame(box)]
    for d in range(int(xs[0]), int(xs[1]) + 1):
        out.append(f'<line x1="{px(d):.1f}" y1="{y0}" x2="{px(d):.1f}" y2="{y1}" stroke="#eee"/>'
                   f'<text x="{px(d):.1f}" y="{y1 + 14}" text-anchor="middle">1e{d}</text>')
    for d in range(int(ys[0]), int(ys[1]) + 1):
        out.append(f'<line x1="{x0}" y1="{py(d):.1f}" x2="{x1}" y2="{py(d):.1f}" stroke="#eee"/>'
                   f'<text x="{x0 - 6}" y="{py(d) + 4:.1f}" text-anchor="end">1e{d}</text>')
    return "".join(out)


def ms_axis(values: list[float], box: tuple[int, int, int, int]) -> tuple[Callable[[float], float], str]:
    """A y scale for ms and its labels: linear from 0, or log10 when the values span > 20x."""
    x0, y0, _, y1 = box
    lo, hi = min(values), max(values)
    if lo > 0 and hi / lo > 20:
        span = log_span(values)
        ticks = [10.0 ** d for d in range(int(span[0]), int(span[1]) + 1)]
        py = scale(*span, y1, y0, log=True)
    else:
        ticks = [0.0, hi * 1.15 / 2 or 0.5, hi * 1.15 or 1.0]
        py = scale(0.0, ticks[-1], y1, y0)
    return py, "".join(f'<line x1="{x0}" x2="{box[2]}" y1="{py(t):.1f}" y2="{py(t):.1f}" stroke="#eee"/>'
                       f'<text x="{x0 - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:.3g} ms</text>'
                       for t in ticks)
