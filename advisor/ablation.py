"""Leave-one-out ablation: what each fusion of a plan is worth, measured.

The analyzer predicts a saving per fusion family; tuning trials only estimate it (they
are not a designed experiment, see report/attribution.py). Here it is measured directly:
at each shape, the bucket's plan with one family removed (and, for a plan with CUDA
graphs, without graphs) is applied and timed like the plan itself, in the same process:

    measured_saving_ms(f) = t(plan − f) − t(plan)

positive when f makes the forward faster. Savings of different families need not add up
(two fusions can remove the same launch; under CUDA graphs a launch costs ~1 µs instead of
~8 µs of host time), which is why each is measured against the whole plan.

A deep fusion left out hands its sites back to shallower families still in the plan
(add_rms_norm_linear's to add_rms_norm and qkv_merge): its measured saving is its margin
over them, not over the unfused graph. Each row records the sites f held in the plan
(`sites_in_plan`) and the sites other families took over without it (`taken_over`), so
the report can predict that margin (report/html_candidates.py, `marginal_prediction`).

The baseline t(plan) is timed the way each t(plan − f) is (a fresh apply of the one
bucket), before and after them, not taken from the recipe's own row: on an H100 (session
15) every leave-one-out of a family that held no site — the same graph — read 0.009 ms
slower than the recipe's row, a bias as large as some savings. A family that attempted no
site in the plan is not timed at all: without it the rewrite builds the same graph, so its
saving is 0 by construction (one whose sites were all refused is timed: the graph-wide
passes run only where some family tried a site).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
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


def taken_over(plan_sites: Mapping[str, int], without_sites: Mapping[str, int]) -> dict[str, int]:
    """Families applied at more sites without the removed one than with it: family -> how
    many more."""
    return {f: n - plan_sites.get(f, 0) for f, n in without_sites.items() if n > plan_sites.get(f, 0)}


def ablation_rows(shape: int, plan: Plan, recipe_ms: float,
                  time_plan: Callable[[Plan], tuple[float, dict[str, int]]],
                  plan_sites: Mapping[str, int], tried: Collection[str] = ()) -> list[dict[str, Any]]:
    """One row per removed family: `time_plan(p)` gives p's median ms at `shape` and its
    sites applied per family; `plan_sites` the same for the whole plan, `tried` the
    families that attempted a site in it (applied or refused), `recipe_ms` the recipe's own
    timing (kept). The baseline `plan_ms` is `time_plan(plan)` timed before and after the
    leave-one-outs (their mean, both kept in `plan_ms_runs`: drift shows as their spread);
    if neither run works it is recipe_ms and every row says so (`baseline_error`). A plan
    that raises is a row with its error. Rows carry both timings so a reader can recompute
    the saving."""
    runs: list[float] = []
    errors: list[str] = []

    def baseline() -> None:
        try:
            runs.append(time_plan(plan)[0])
        except Exception as exc:  # the rows still compare with the recipe's own timing
            errors.append(one_line(exc))

    baseline()
    rows = []
    for removed, without in leave_one_out(plan):
        row: dict[str, Any] = {"shape": shape, "removed": removed, "recipe_ms": recipe_ms}
        if removed in plan.fusions:
            row["sites_in_plan"] = plan_sites.get(removed, 0)
            if row["sites_in_plan"] == 0 and removed not in tried:
                # it attempted no site: without it the rewrite builds the same graph
                row.update(without_ms=None, measured_saving_ms=0.0, taken_over={}, same_graph=True)
                rows.append(row)
                continue
        try:
            ms, sites = time_plan(without)
            row.update(without_ms=ms, taken_over=taken_over(plan_sites, sites))
        except Exception as exc:  # a plan that fails here is a result, not a crash
            row.update(without_ms=None, measured_saving_ms=None, error=one_line(exc))
        rows.append(row)
    baseline()
    plan_ms = sum(runs) / len(runs) if runs else recipe_ms
    for row in rows:
        row.update(plan_ms=plan_ms, plan_ms_runs=list(runs))
        if errors and not runs:
            row["baseline_error"] = errors[0]
        if row.get("same_graph"):
            row["without_ms"] = plan_ms
        elif row.get("without_ms") is not None:
            row["measured_saving_ms"] = row["without_ms"] - plan_ms
    return rows
