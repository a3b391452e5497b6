"""A self-contained HTML report from the plain JSON dicts (rendering only; the one estimate,
each family's measured saving, is advisor/report/attribution.py).

Inputs are the documented JSON outputs, read as dicts: analyses (`advisor.analyze.to_json`,
schema in advisor/analyze.py), an optional bench (`advisor.bench.to_json`, or a
`benchmarks/` result with the same `rows`; its greedy-generation rows, if any, under
`generation`: the bench part of the page is advisor/report/html_bench.py), an optional
recipe (`Recipe.to_json()`, or a hand-written plan) and an optional tuning history: one
dict per finished trial,
``{"bucket": int, "number": int, "state": "COMPLETE"|"FAIL"|"PRUNED", "value": ms | None,
"failure": str | None}`` (`dataclasses.asdict(TrialEvent)` plus the bucket's length), with
``"params"`` (the trial's Optuna parameters), ``"repeat_of"`` and ``"applied"`` where known
(`advisor.report.history.load_history` gives them): the candidates tables
(advisor/report/html_candidates.py) then show each family's measured saving.

The page has no external resources and no script: inline CSS, inline SVG drawn here,
tooltips as SVG ``<title>``/HTML ``title``. All text from the inputs is escaped. Example::

    import json
    from advisor.report.html import render_html, write_html
    a = json.load(open("benchmarks/results/h200-analysis-2026-12-02.json"))
    b = json.load(open("benchmarks/results/h200-apply-2026-12-02.json"))
    write_html("report.html", render_html(analyses=[a], bench=b, title="llama on H200"))
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from advisor.report.html_bench import bench_rows, bench_section
from advisor.report.html_candidates import candidates_section
from advisor.report.html_common import PALETTE, _e, _f, _num
from advisor.report.svg import frame, legend, log_axes, log_span, ms_axis, scale, svg

CATEGORIES = (("launch_host", "launch/host", "#b04fc4"), ("memory", "memory", "#2a9fc0"),
              ("compute", "compute", "#3d9a4b"), ("idle_sync", "idle/sync", "#9a9a9a"))
MEASURED_COLOR = "#444"
CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1150px;
color:#222;padding:0 16px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}h3{font-size:15px}
table{border-collapse:collapse;margin:8px 0 16px}td,th{border:1px solid #ddd;padding:3px 8px}
th{background:#f4f4f4;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
tr.total td{font-weight:600;background:#fafafa}.muted{color:#777}
.sw{display:inline-block;width:11px;height:11px;margin:0 4px 0 12px;vertical-align:-1px}
h4{font-size:14px;margin:18px 0 4px}.bad{color:#b00}.err{color:#b00;overflow-wrap:anywhere}
svg{display:block;margin:6px 0 14px}svg text{font:11px system-ui,sans-serif;fill:#333}
"""


# ---- (a) latency budget -----------------------------------------------------------------

def _budget_bars(s: dict, bench: dict | None) -> list[tuple[str, list[tuple[str, str, float]]]]:
    """Bars of one shape: the profiled budget (stacked), then the bench's measured totals."""
    cats = s.get("budget", {}).get("categories", {})
    bars = [("profiled budget", [(label, color, _num(cats.get(key)) or 0.0)
                                 for key, label, color in CATEGORIES])]
    for r in bench_rows(bench, s["seq_len"]):
        variant = str(r.get("variant", ""))
        if (variant == "eager" or variant.startswith("advisor")) and _num(r.get("ms")) is not None:
            name = "before fusion" if variant == "eager" else "after fusion"
            bars.append((f"{variant} ({name}, measured)",
                         [(f"{variant} measured total", MEASURED_COLOR, float(r["ms"]))]))
    return bars


def _budget_svg(a: dict, bench: dict | None) -> str:
    """Stacked horizontal bars per shape, each shape on its own scale (labelled in ms)."""
    lab, width, bar_w, row_h = 250, 980, 620, 22
    parts, y = [], 8
    for s in a.get("shapes", []):
        parts.append(f'<text x="0" y="{y + 12}" font-weight="bold">{_e(s.get("seq_len"))} tokens · '
                     f'{_e(s.get("verdict", ""))}</text>')
        y += 20
        bars = _budget_bars(s, bench)
        scale = max(sum(ms for _, _, ms in segs) for _, segs in bars) or 1.0
        for name, segs in bars:
            parts.append(f'<text x="0" y="{y + 15}">{_e(name)}</text>')
            x = float(lab)
            for label, color, ms in segs:
                w = bar_w * ms / scale
                parts.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" '
                             f'fill="{color}"><title>{_e(label)}: {ms:.3f} ms</title></rect>')
                x += w
            total = sum(ms for _, _, ms in segs)
            parts.append(f'<text x="{x + 6:.1f}" y="{y + 15}">{total:.3f} ms</text>')
            y += row_h
        y += 10
    return svg(width, y, "latency budget per shape", "".join(parts))


def _budget_section(a: dict, bench: dict | None) -> str:
    note = ("<p class='muted'>The profiled budget splits one forward's wall time (analysis); the "
            "grey bars are the bench's measured totals at the same length, under the bench's own "
            "conditions (no split is implied). Each shape has its own scale.</p>")
    key = legend([(label, color) for _, label, color in CATEGORIES] + [("measured total",
                                                                          MEASURED_COLOR)])
    return f"<h3>Latency budget</h3>{key}{_budget_svg(a, bench)}{note if bench else ''}"


# ---- (b) roofline -------------------------------------------------------------------------


def _roofline_svg(a: dict, ops: list[tuple[int, dict]], bw: float, peak: float, uid: str) -> str:
    box = (70, 12, 700, 372)
    x0, y0, x1, y1 = box
    ridge = peak * 1e3 / bw  # FLOP/byte where bandwidth * intensity meets the compute roof
    xs = log_span([o["intensity"] for _, o in ops] + [ridge])
    ys = log_span([o["achieved_tflops"] for _, o in ops] + [peak])
    px, py = scale(*xs, x0, x1, log=True), scale(*ys, y1, y0, log=True)
    roof = [(10 ** xs[0], bw * 10 ** xs[0] / 1e3), (ridge, peak), (10 ** xs[1], peak)]
    pts = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in roof)
    shapes = [s.get("seq_len") for s in a.get("shapes", [])]
    dots = [f'<circle cx="{px(o["intensity"]):.1f}" cy="{py(o["achieved_tflops"]):.1f}" r="3" '
            f'fill="{PALETTE[shapes.index(t) % len(PALETTE)]}" fill-opacity="0.65">'
            f'<title>{_e(o.get("op"))} {_e(o.get("module") or "")} @ {_e(t)} tokens: '
            f'{o["intensity"]:.3g} FLOP/B, {o["achieved_tflops"]:.3g} TFLOP/s, '
            f'{_f(o.get("device_ms"))} ms</title></circle>' for t, o in ops]
    body = (f'<clipPath id="{uid}"><rect x="{x0}" y="{y0}" width="{x1 - x0}" height="{y1 - y0}"/></clipPath>'
            + log_axes(xs, ys, box)
            + f'<polyline points="{pts}" fill="none" stroke="#000" stroke-width="2" clip-path="url(#{uid})"/>'
            + "".join(dots)
            + f'<text x="{(x0 + x1) / 2}" y="{y1 + 32}" text-anchor="middle">arithmetic intensity '
              f'(FLOP/byte)</text><text x="14" y="{(y0 + y1) / 2}" text-anchor="middle" '
              f'transform="rotate(-90 14 {(y0 + y1) / 2})">achieved TFLOP/s</text>')
    return svg(720, 412, "roofline of ops", body)


def _roofline_section(a: dict, uid: str) -> str:
    c = a.get("ceilings", {})
    bw = _num(c.get("copy_gbps"))
    tf = c.get("matmul_tflops", {})
    peak = _num(tf.get(a.get("dtype"), tf.get("float32")))
    ops = [(s.get("seq_len"), o) for s in a.get("shapes", []) for o in s.get("budget", {}).get("ops", [])]
    shown = [(t, o) for t, o in ops if (_num(o.get("intensity")) or 0) > 0
             and (_num(o.get("achieved_tflops")) or 0) > 0]
    if not bw or not peak or not shown:
        return "<h3>Roofline</h3><p class='muted'>no ops with FLOPs, or no measured ceilings.</p>"
    key = legend([(f"{s.get('seq_len')} tokens", PALETTE[i % len(PALETTE)])
                   for i, s in enumerate(a.get("shapes", []))])
    note = (f"<p class='muted'>Roofs: measured copy bandwidth and {_e(a.get('dtype'))} matmul rate "
            f"({peak:.3g} TFLOP/s · {bw:.0f} GB/s · ridge {peak * 1e3 / bw:.3g} FLOP/byte). "
            f"{len(ops) - len(shown)} of {len(ops)} ops without FLOPs (launch/host only) not shown.</p>")
    return f"<h3>Roofline</h3>{key}{_roofline_svg(a, shown, bw, peak, uid)}{note}"


# ---- (c) candidates: html_candidates.py · (d) tuning history -------------------------------


def _history_svg(bucket: Any, trials: list[dict], baseline: float | None) -> str:
    box = x0, y0, x1, y1 = 80, 14, 700, 214
    done = sorted((t["number"], float(t["value"])) for t in trials
                  if t.get("state") == "COMPLETE" and _num(t.get("value")) is not None)
    nums = [t["number"] for t in trials]
    lo, hi = min(nums), max(max(nums), min(nums) + 1)
    py, yaxis = ms_axis([v for _, v in done] + ([baseline] if baseline else []) or [1.0], box)
    px = scale(lo, hi, x0, x1)
    parts = [yaxis, frame(box), f'<text x="{x0}" y="{y1 + 14}">trial {lo}</text>',
             f'<text x="{x1}" y="{y1 + 14}" text-anchor="end">trial {hi}</text>']
    if baseline:
        parts.append(f'<line x1="{x0}" x2="{x1}" y1="{py(baseline):.1f}" y2="{py(baseline):.1f}" '
                     f'stroke="#777" stroke-dasharray="5 4"><title>unfused {baseline:.4g} ms</title></line>')
    best = [min(v for _, v in done[:i + 1]) for i in range(len(done))]
    steps = [(n, b) for (n, _), b in zip(done, best)] + ([(hi, best[-1])] if best else [])
    if steps:
        pts = " ".join(f"{px(n):.1f},{py(b):.1f}" for n, b in steps)
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{PALETTE[2]}"/>')
    parts += [f'<circle cx="{px(n):.1f}" cy="{py(v):.1f}" r="3.5" fill="{PALETTE[0]}">'
              f'<title>trial {n}: {v:.4g} ms</title></circle>' for n, v in done]
    for t in trials:
        if t.get("state") != "COMPLETE" or _num(t.get("value")) is None:
            x, y = px(t["number"]), y0 + 8
            parts.append(f'<path d="M{x - 4:.1f},{y - 4} l8,8 m0,-8 l-8,8" stroke="{PALETTE[1]}" '
                         f'stroke-width="2"><title>trial {t["number"]}: {_e(t.get("state"))} '
                         f'({_e(t.get("failure") or "no value")})</title></path>')
    return svg(720, y1 + 22, f"tuning history of bucket {bucket}", "".join(parts))


def _history_section(history: list[dict], recipe: dict | None) -> str:
    base = {b.get("max_len"): _num(b.get("measured", {}).get("unfused_ms"))
            for b in (recipe or {}).get("buckets", [])}
    by_bucket: dict[Any, list[dict]] = {}
    for t in history:
        if isinstance(t.get("number"), int):
            by_bucket.setdefault(t.get("bucket", t.get("length")), []).append(t)
    out = ["<h2>Tuning history</h2>", legend([("trial (ms)", PALETTE[0]), ("best so far", PALETTE[2]),
                                               ("failed trial", PALETTE[1]), ("unfused", "#777")])]
    for bucket, trials in sorted(by_bucket.items(), key=lambda kv: str(kv[0])):
        fails = sum(t.get("state") != "COMPLETE" for t in trials)
        out.append(f"<h3>bucket ≤ {_e(bucket)} tokens: {len(trials)} trials, {fails} failed</h3>"
                   + _history_svg(bucket, trials, base.get(bucket)))
    return "".join(out)


# ---- the page (the bench part: html_bench.py) -------------------------------------------------------

def _analysis_header(a: dict) -> str:
    c = a.get("ceilings", {})
    tf = ", ".join(f"{_e(k)} {_f(v, '.1f')}" for k, v in sorted(c.get("matmul_tflops", {}).items()))
    env = a.get("environment", {})
    return (f"<h2>{_e(a.get('model', 'model'))} · {_e(c.get('device_name', a.get('device', '')))}</h2>"
            f"<p>{_e(a.get('dtype'))}, batch {_e(a.get('batch'))}. Measured ceilings: copy "
            f"{_f(c.get('copy_gbps'), '.0f')} GB/s; matmul TFLOP/s {tf}; launch "
            f"{_f(c.get('launch_us'), '.2f')} µs.</p><p class='muted'>"
            + " · ".join(_e(f"{k}: {v}") for k, v in env.items()) + "</p>")


def render_html(*, analyses: list[dict], bench: dict | None = None, recipe: dict | None = None,
                history: list[dict] | None = None, title: str) -> str:
    """The whole report as one HTML string (see the module docstring for the inputs)."""
    body = [f"<h1>{_e(title)}</h1>"]
    for i, a in enumerate(analyses):
        body += [_analysis_header(a), _budget_section(a, bench), _roofline_section(a, f"roof{i}"),
                 candidates_section(a, bench, recipe, history)]
    if history:
        body.append(_history_section(history, recipe))
    if bench:
        body.append(bench_section(bench))
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{_e(title)}</title><style>{CSS}</style></head><body>{''.join(body)}</body></html>\n")


def write_html(path: str | os.PathLike[str], html_text: str) -> Path:
    """Write next to the destination, then os.replace: readers never see half a page."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(html_text)
        os.chmod(tmp, 0o644)  # a page to be read by others (mkstemp creates it 0600)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p
