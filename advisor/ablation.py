"""Leave-one-out ablation: what each fusion of a plan is worth, measured.

The analyzer predicts a saving per fusion family; tuning trials only estimate it (they
are not a designed experiment, see report/attribution.py). Here it is measured directly:
at each shape, the bucket's plan with one family removed (and, for a plan with CUDA
graphs, without graphs) is applied and timed like the plan itself, in the same process:

    measured_saving_ms(f) = t(plan − f) − t(plan)

positive when f makes the forward faster. Savings of different families need not add up
(two fusions can remove the same launch; under CUDA graphs a launch costs ~1 µs instead of
~8 µs of host time), which is why each is measured against the whole plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from advisor.errors import one_line
from advisor.runtime.plan import PLAN_FLAGS, Plan


def leave_one_out(plan: Plan) -> list[tuple[str, Plan]]:
    """(what was removed, the plan without it): each fusion family in plan order, then
    `cuda_graph` and `pdl` where the plan uses them. Configs of the remaining families are kept."""
    out = []
    for family in plan.fusions:
        rest = tuple(f for f in plan.fusions if f != family)
        configs = {k: v for k, v in plan.configs.items() if k != family}
        out.append((family, replace(plan, fusions=rest, configs=configs)))
    for flag in PLAN_FLAGS:
        if getattr(plan, flag):
            out.append((flag, replace(plan, **{flag: False})))
    return out


def ablation_rows(shape: int, plan: Plan, plan_ms: float,
                  time_plan: Callable[[Plan], float]) -> list[dict[str, Any]]:
    """One row per removed family: `time_plan(p)` gives p's median ms at `shape`; a plan
    that raises is a row with its error. Rows carry both timings so a reader can recompute
    the saving."""
    rows = []
    for removed, without in leave_one_out(plan):
        row: dict[str, Any] = {"shape": shape, "removed": removed, "plan_ms": plan_ms}
        try:
            ms = time_plan(without)
            row.update(without_ms=ms, measured_saving_ms=ms - plan_ms)
        except Exception as exc:  # a plan that fails here is a result, not a crash
            row.update(without_ms=None, measured_saving_ms=None, error=one_line(exc))
        rows.append(row)
    return rows
