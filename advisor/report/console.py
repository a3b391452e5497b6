"""Rich console rendering of what the computations return (no computation here)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from advisor.analyze import Analysis, ShapeAnalysis
from advisor.profile import Ceilings, top_ops
from advisor.report.accuracy import TOLERANCE, Accuracy

CATEGORY_STYLE = {
    "launch_host": ("launch/host", "magenta"),
    "memory": ("memory", "cyan"),
    "compute": ("compute", "green"),
    "idle_sync": ("idle/sync", "grey50"),
}
BAR_WIDTH = 60


def budget_bar(categories: dict[str, float], width: int = BAR_WIDTH) -> Text:
    """A stacked bar of the wall-time split, with a legend of shares."""
    total = sum(categories.values()) or 1.0
    bar, legend = Text(), Text()
    for key, (label, style) in CATEGORY_STYLE.items():
        ms = categories.get(key, 0.0)
        bar.append("█" * round(width * ms / total), style=style)
        legend.append(f"  {label} {ms:.3f} ms ({100 * ms / total:.0f}%)", style=style)
    return Text.assemble(bar, "\n", legend)


def _ops_table(s: ShapeAnalysis, n: int) -> Table:
    t = Table(title=f"top ops at {s.seq_len} tokens", title_justify="left", show_lines=False)
    for col in ("op", "module", "calls", "device ms", "launch/host ms", "roofline", "GB/s", "TFLOP/s"):
        t.add_column(col, justify="left" if col in ("op", "module", "roofline") else "right")
    for r in top_ops(s.budget, n):
        t.add_row(r.op, r.module or "-", str(r.calls), f"{r.device_ms:.3f}",
                  f"{r.launch_host_ms:.3f}", r.roofline, f"{r.achieved_gbps:.0f}",
                  f"{r.achieved_tflops:.1f}")
    return t


def _candidates_table(s: ShapeAnalysis) -> Table:
    t = Table(title=f"fusion candidates at {s.seq_len} tokens (ranked by predicted saving)",
              title_justify="left")
    for col in ("#", "family", "sites", "launches removed", "bytes avoided", "predicted saving",
                "device saving (timed)", "kernel"):
        t.add_column(col, justify="left" if col in ("family", "kernel") else "right")
    for i, c in enumerate(s.candidates, 1):
        timed = "-" if c.device_saving_ms is None else f"{c.device_saving_ms:.3f} ms"
        t.add_row(str(i), c.family, str(c.count), str(c.launches_removed), _bytes(c.bytes_avoided),
                  f"{c.predicted_saving_ms:.3f} ms", timed, c.kernel or "[dim]analysis only[/dim]")
    return t


def _bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def render_analysis(a: Analysis, console: Console, top: int = 10) -> None:
    console.print(f"[bold]{a.model}[/bold] on {a.ceilings.device_name} ({a.device}), "
                  f"{a.dtype}, batch {a.batch}")
    for s in a.shapes:
        b = s.budget
        head = Text.assemble(
            (f"\n{s.seq_len} tokens: ", "bold"), f"{b.wall_ms:.3f} ms per forward (profiled; ",
            f"{b.plain_wall_ms:.3f} ms unprofiled), GPU busy {100 * s.gpu_busy_fraction:.0f}% → ",
            (s.verdict, "bold yellow"))
        console.print(Group(head, budget_bar(b.categories)))
        console.print(_ops_table(s, top))
        console.print(_candidates_table(s))


def render_ceilings(c: Ceilings, console: Console) -> None:
    t = Table(title=f"measured ceilings: {c.device_name}", title_justify="left")
    t.add_column("ceiling")
    t.add_column("value", justify="right")
    t.add_row("copy bandwidth (read+write)", f"{c.copy_gbps:.0f} GB/s")
    for dtype, tf in sorted(c.matmul_tflops.items()):
        t.add_row(f"matmul {dtype}", f"{tf:.1f} TFLOP/s")
    t.add_row("eager launch (host)", f"{c.launch_us:.2f} µs")
    t.add_row("launch in CUDA graph", "-" if c.graph_launch_us is None else f"{c.graph_launch_us:.2f} µs")
    t.add_row("measured", c.measured_at)
    console.print(t)
    console.print(f"[dim]{c.method}[/dim]")


def render_rows(title: str, rows: Iterable[dict[str, Any]], console: Console) -> None:
    """A plain table of dict rows (apply summaries, bench results)."""
    rows = list(rows)
    if not rows:
        return
    cols = list(dict.fromkeys(k for r in rows for k in r))
    t = Table(title=title, title_justify="left")
    for col in cols:
        t.add_column(col)
    for r in rows:
        t.add_row(*[_cell(r.get(c)) for c in cols])
    console.print(t)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "; ".join(map(str, v))[:120] or "-"
    return str(v)


GENERATION_COLUMNS = {
    "shape": "context", "variant": "variant", "ms_per_token": "ms/token", "tokens_per_s": "tokens/s",
    "speedup_vs_eager": "speed-up", "x_floor": "× floor", "tokens_match": "same tokens",
    "first_divergence": "diverges at",
    "max_error": "max |Δlogit|", "matches_eager": "ok",
}
TOKENS_SHOWN = 5


def render_generation(rows: Iterable[dict[str, Any]], console: Console) -> None:
    """Greedy generation rows (bench --generate): per-token latency, tokens/s, agreement
    with eager, and the first tokens of the first sequence."""
    rows = list(rows)
    if not rows:
        return
    t = Table(title=f"greedy generation: {rows[0].get('new_tokens')} new tokens per context "
                    "(ms/token = whole loop / tokens)", title_justify="left")
    for label in GENERATION_COLUMNS.values():
        t.add_column(label)
    t.add_column("first tokens", no_wrap=True, overflow="ellipsis", max_width=18)
    for r in rows:
        first = (r.get("tokens") or [[]])[0]
        shown = ",".join(map(str, first[:TOKENS_SHOWN])) + ("…" if len(first) > TOKENS_SHOWN else "")
        t.add_row(*[_cell(r.get(k)) for k in GENERATION_COLUMNS], shown)
    console.print(t)


def render_accuracy(rows: Iterable[Accuracy], console: Console) -> None:
    """Predicted vs measured saving per family (report/accuracy.py), then per length and
    source how many are within the tolerance."""
    rows = list(rows)
    if not rows:
        return
    t = Table(title=f"predicted vs measured saving per fusion (within ±{TOLERANCE:.0%}: issue 7)",
              title_justify="left")
    for col in ("tokens", "family", "measured as", "sites", "predicted ms", "warm ms", "measured ms",
                "noise ms", "error", "within"):
        t.add_column(col, justify="left" if col in ("family", "measured as") else "right")
    ms = lambda v: "-" if v is None else f"{v:.4f}"  # noqa: E731
    for r in rows:
        within = r.within()
        t.add_row(str(r.shape), r.family, r.source, _cell(r.sites), ms(r.predicted_ms), ms(r.warm_ms),
                  ms(r.measured_ms), ms(r.noise_ms), "-" if r.error is None else f"{r.error:+.0%}",
                  "-" if within is None else ("yes" if within else "[red]no[/red]"))
    console.print(t)
    for (shape, source), group in _groups(rows).items():
        judged = [r for r in group if r.within() is not None]
        hits = sum(bool(r.within()) for r in judged)
        noisy = sum(not r.within() and bool(r.within_noise()) for r in judged)
        console.print(f"{shape} tokens, {source}: {hits} of {len(judged)} families within ±{TOLERANCE:.0%}"
                      + (f"; {noisy} more miss by less than the measurement's noise" if noisy else ""))


def _groups(rows: list[Accuracy]) -> dict[tuple[int, str], list[Accuracy]]:
    out: dict[tuple[int, str], list[Accuracy]] = {}
    for r in rows:
        out.setdefault((r.shape, r.source), []).append(r)
    return out
