"""The bench part of the HTML report: latency per forward and greedy generation (rendering only).

Input: a bench dict (`advisor.bench.to_json`, or a `benchmarks/` result with the same
"rows"). "rows" hold latency per forward, one per shape and variant; the advisor's rows
carry `matches_eager` and the `verdict` that says why; a variant that failed has `ms`
None and an `error`. "generation" (`advisor bench --phase decode --generate N`) holds
greedy-generation rows, one per context length and variant: `new_tokens`,
`ms_per_token`, `tokens_per_s`, `speedup_vs_eager`, `x_floor` (per-token latency ÷ the
read floor of one step) and, for all but eager,
`tokens_match`, `first_divergence` (a 0-based step or None), `compared_steps`,
`max_error`, `rel_error`, `logits_match` and `matches_eager` (`advisor.generate.compare`);
a failed variant has `ms_per_token` None and an `error`. Their generated `tokens` are
not shown.
"""

from __future__ import annotations

from typing import Any

from advisor.report.html_common import DASH, PALETTE, _cell, _e, _f, _num, _table
from advisor.report.svg import frame, legend, ms_axis, svg

BENCH_COLUMNS = ("shape", "variant", "ms", "speedup_vs_eager", "x_floor", "kernels", "first_call_s",
                 "peak_mb", "max_error", "rel_error", "matches_eager", "error")
SHOWN_INSIDE = ("verdict",)  # keys rendered inside another column's cell (matches_eager)
ERROR_SHOWN = 300  # characters of an error message in a cell; all of it in the tooltip
FAILED_COLOR = PALETTE[1]
VARIANT_COLORS = tuple(c for c in PALETTE if c != FAILED_COLOR)


def bench_rows(bench: dict | None, shape: int) -> list[dict]:
    return [r for r in (bench or {}).get("rows", []) if r.get("shape") == shape]


def applied_rows(bench: dict | None) -> list[dict]:
    applied = (bench or {}).get("applied") or []
    if isinstance(applied, dict):  # benchmarks/ results: variant -> summary
        applied = applied.get("advisor") or next(iter(applied.values()), [])
    return [r for r in applied if isinstance(r, dict)]


def _clip(text: Any, n: int = ERROR_SHOWN) -> str:
    """Escaped text, cut at n characters (the whole of it in a tooltip when cut)."""
    s = str(text)
    return _e(s) if len(s) <= n else f'<span title="{_e(s)}">{_e(s[:n])}…</span>'


def _error(text: Any) -> tuple[str, bool]:
    return (f'<span class="err">{_clip(text)}</span>' if text else DASH), False


def _ok(ok: Any, why: Any) -> tuple[str, bool]:
    """yes / no, then the reason in grey."""
    word = DASH if ok is None else "yes" if ok else '<span class="bad">no</span>'
    return word + (f' <span class="muted">{_e(why)}</span>' if why else ""), False


# ---- latency per forward ----------------------------------------------------------------

def _bench_cell(r: dict, col: str) -> tuple[str, bool]:
    if col == "ms" and _num(r.get("ms")) is None and r.get("error"):
        return '<span class="bad">failed</span>', False
    if col == "matches_eager":
        return _ok(r.get(col), r.get("verdict"))
    if col == "error":
        return _error(r.get(col))
    return _cell(r.get(col))


def _latency_table(rows: list[dict]) -> str:
    cols = [c for c in BENCH_COLUMNS if any(c in r for r in rows)]
    if "verdict" in {k for r in rows for k in r} and "matches_eager" not in cols:
        cols.append("matches_eager")
    cols += [c for c in dict.fromkeys(k for r in rows for k in r) if c not in cols and c not in SHOWN_INSIDE]
    return _table(cols, [[_bench_cell(r, c) for c in cols] for r in rows])


# ---- greedy generation ------------------------------------------------------------------

def _tokens_cell(r: dict) -> tuple[str, bool]:
    if r.get("variant") == "eager":
        return "reference", False
    if r.get("tokens_match") is None:
        return DASH, False
    if r["tokens_match"]:
        return f"all {_e(r.get('compared_steps', r.get('new_tokens')))} same", False
    return f"differ from step {_e(r.get('first_divergence'))}", False


def _logits_cell(r: dict) -> tuple[str, bool]:
    if _num(r.get("rel_error")) is None:
        return DASH, True
    tip = f"max |Δlogit| {_f(r.get('max_error'), '.3g')} over the first {r.get('compared_steps')} steps"
    return f'<span title="{_e(tip)}">{_f(r["rel_error"], ".3g")}</span>', True


def _generation_verdict(r: dict) -> tuple[str, bool]:
    """The row's own `verdict` if it has one, else said from its flags."""
    if r.get("variant") == "eager":
        return "reference", False
    if r.get("error") or (_num(r.get("ms_per_token")) is None and "tokens_match" not in r):
        return '<span class="bad">failed</span>', False
    if isinstance(r.get("verdict"), str):
        return _ok(r.get("matches_eager"), r["verdict"])
    why = []
    if r.get("logits_match") is False:
        why.append("logits beyond tolerance")
    elif r.get("logits_match"):
        why.append("logits within tolerance" + (" up to the divergence" if r.get("tokens_match") is False
                                                 else ""))
    if r.get("tokens_match") is False:
        why.append("tokens differ" + ("" if r.get("matches_eager") else " (exact tokens expected)"))
    return _ok(r.get("matches_eager"), "; ".join(why))


def _generation_table(rows: list[dict]) -> str:
    heads = ["variant", "ms / token", "tokens / s", "speed-up vs eager", "× read floor",
             "tokens vs eager", "logits rel error", "matches eager"]
    failed = any(r.get("error") for r in rows)
    body = [[(_e(r.get("variant")), False), (_f(r.get("ms_per_token")), True),
             (_f(r.get("tokens_per_s"), ".1f"), True), (_f(r.get("speedup_vs_eager"), ".2f", "×"), True),
             (_f(r.get("x_floor"), ".3f", "×"), True), _tokens_cell(r), _logits_cell(r),
             _generation_verdict(r)]
            + ([_error(r.get("error"))] if failed else []) for r in rows]
    return _table(heads + (["error"] if failed else []), body)


def _generation_svg(shape: Any, rows: list[dict], colors: dict[str, str]) -> str:
    """Vertical bars of ms per token, one per variant; a failed variant is a red cross."""
    slot, bar = 96, 56
    box = x0, y0, x1, y1 = 80, 22, 80 + slot * len(rows), 162
    ms = [_num(r.get("ms_per_token")) for r in rows]
    py, yaxis = ms_axis([v for v in ms if v is not None] or [1.0], box)
    parts = [yaxis, frame(box)]
    for i, (r, v) in enumerate(zip(rows, ms)):
        name, cx = str(r.get("variant")), x0 + slot * i + slot / 2
        if v is None:
            why = r.get("error") or "no time"
            parts.append(f'<path d="M{cx - 5:.1f},{y1 - 15} l10,10 m0,-10 l-10,10" stroke="{FAILED_COLOR}" '
                         f'stroke-width="2"><title>{_e(name)}: failed ({_e(why)})</title></path>'
                         f'<text x="{cx:.1f}" y="{y1 - 20}" text-anchor="middle">failed</text>')
            continue
        top = py(v)
        parts.append(f'<rect x="{cx - bar / 2:.1f}" y="{top:.1f}" width="{bar}" height="{y1 - top:.1f}" '
                     f'fill="{colors[name]}"><title>{_e(name)}: {v:.4g} ms per token</title></rect>'
                     f'<text x="{cx:.1f}" y="{top - 4:.1f}" text-anchor="middle">{v:.3g} ms</text>')
    return svg(x1 + 20, y1 + 8, f"ms per token by variant at context {shape}", "".join(parts))


def _generation_section(gen: list[Any]) -> str:
    rows = [r for r in gen if isinstance(r, dict)]
    if not rows:
        return ""
    variants = list(dict.fromkeys(str(r.get("variant")) for r in rows))
    colors = {v: VARIANT_COLORS[i % len(VARIANT_COLORS)] for i, v in enumerate(variants)}
    by_shape: dict[Any, list[dict]] = {}
    for r in rows:
        by_shape.setdefault(r.get("shape"), []).append(r)
    note = ("<p class='muted'>Each variant generates the new tokens greedily from a KV cache filled to the "
            "context length. ms / token is the median time of the whole loop over the new tokens; tokens / s "
            "counts every sequence of the batch. Tokens and each step's logits are compared with eager's "
            "(steps count from 0), logits up to and including the first step where the tokens differ.</p>")
    out = ["<h3>Greedy generation (decode)</h3>", note,
           legend([(v, colors[v]) for v in variants] + [("failed", FAILED_COLOR)])]
    for shape, rs in by_shape.items():
        new = sorted({str(r.get("new_tokens")) for r in rs if r.get("new_tokens") is not None})
        out.append(f"<h4>context {_e(shape)} tokens · {_e(' / '.join(new) or DASH)} new tokens</h4>"
                   + _generation_svg(shape, rs, colors) + _generation_table(rs))
    return "".join(out)


# ---- the bench part of the page -----------------------------------------------------------

def bench_section(bench: dict) -> str:
    rows = [r for r in bench.get("rows", []) if isinstance(r, dict)]
    cond = bench.get("conditions") or bench.get("meta") or {}
    env = bench.get("environment", {})
    head = " · ".join(_e(f"{k}: {v}") for k, v in list(cond.items()) + list(env.items()))
    applied = [r for r in applied_rows(bench) if r.get("family") != "(all)"]
    fused = _table(("bucket", "family", "sites applied", "left unfused (reason)"),
                   [[(_e("all" if r.get("bucket") == 2**31 - 1 else r.get("bucket")), True),
                     (_e(r.get("family")), False), (_e(r.get("applied")), True),
                     (_e("; ".join(r.get("unfused") or []) or DASH), False)] for r in applied])
    return ("<h2>Bench</h2>" + f"<p class='muted'>{head}</p>"
            + (_latency_table(rows) if rows else "")
            + _generation_section(bench.get("generation") or [])
            + ("<h3>Fusions applied (advisor)</h3>" + fused if applied else ""))
