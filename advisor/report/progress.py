"""`advisor tune` on the console: live progress per bucket and the closing summary.

Rendering only: it is told what happened (the `advisor.search.study.Listener` calls) and
draws it; nothing is computed here beyond a speed-up ratio for display.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table


def _fails(counts: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in sorted(counts.items())) or "-"


def _plan(plan: Any) -> str:
    text = ", ".join(plan.fusions) or "unfused"
    return text + (" + cuda graph" if plan.cuda_graph else "") + (" + pdl" if plan.pdl else "")


class TuneProgress:
    """Context manager; one progress row per bucket: trials n/N, best-so-far, failures."""

    def __init__(self, console: Console):
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]len ≤ {task.fields[length]}"), BarColumn(),
            MofNCompleteColumn(), TextColumn("{task.fields[best]}"),
            TextColumn("[red]{task.fields[fails]}"), TimeElapsedColumn(),
            console=console)
        self.tasks: dict[int, TaskID] = {}
        self.unfused: dict[int, float] = {}
        self.failures: dict[int, Counter[str]] = {}

    def __enter__(self) -> TuneProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.progress.stop()

    def bucket_started(self, length: int, done: int, total: int | None, unfused_ms: float) -> None:
        self.unfused[length] = unfused_ms
        self.failures[length] = Counter()
        self.tasks[length] = self.progress.add_task(
            "", total=total, completed=done, length=length, fails="",
            best=f"unfused {unfused_ms:.3f} ms")

    def trial_finished(self, length: int, event: Any) -> None:
        if event.failure:
            self.failures[length][event.failure] += 1
        best = "no plan yet"
        if event.best_ms:
            best = (f"best {event.best_ms:.3f} ms "
                    f"({self.unfused[length] / event.best_ms:.2f}x vs unfused)")
        fails = _fails(dict(self.failures[length])) if self.failures[length] else ""
        self.progress.update(self.tasks[length], completed=event.done, best=best, fails=fails)

    def bucket_finished(self, result: Any) -> None:
        speed = result.unfused_ms / result.tuned_ms if result.tuned_ms else 0.0
        self.progress.update(self.tasks[result.length], total=result.trials,
                             completed=result.trials,
                             best=f"chosen {result.tuned_ms:.3f} ms ({speed:.2f}x, re-timed)")


def render_tune_summary(result: Any, console: Console) -> None:
    """The per-bucket table and where the recipe and the study were written."""
    t = Table(title="tuned plan per bucket (unfused and tuned re-timed in one run)",
              title_justify="left")
    for col in ("bucket", "trials", "failed", "unfused ms", "tuned ms", "speed-up", "max error",
                "plan"):
        t.add_column(col, justify="left" if col in ("bucket", "failed", "plan") else "right")
    for r in result.buckets:
        speed = r.unfused_ms / r.tuned_ms if r.tuned_ms else 0.0
        t.add_row(f"≤ {r.length}", str(r.trials), _fails(r.failures), f"{r.unfused_ms:.3f}",
                  f"{r.tuned_ms:.3f}", f"{speed:.2f}x", f"{r.max_error:.2g}", _plan(r.plan))
    console.print(t)
    if result.worker_restarts:
        console.print(f"[yellow]worker processes replaced: {result.worker_restarts}[/yellow]")
    if note := getattr(result, "kernels_note", ""):
        console.print(f"[yellow]{note}[/yellow]" if "not recorded (" in note else f"[dim]{note}[/dim]")
    console.print(f"[dim]wrote {result.out} (study storage: {result.storage})[/dim]")
