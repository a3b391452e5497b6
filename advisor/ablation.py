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
(`sites_in_plan`, their modules in `held_sites`) and the sites other families took over
without it (`taken_over`: counts; `taken_sites`: modules), so the report can predict that
margin site by site (report/html_candidates.py, `marginal_prediction`).

The baseline t(plan) is timed the way each t(plan − f) is (a fresh apply of the one
bucket), before and after them, not taken from the recipe's own row: on an H100 (session
15) every leave-one-out of a family that held no site — the same graph — read 0.009 ms
slower than the recipe's row, a bias as large as some savings. A family that applied no
site in the plan is not timed at all: without it the rewrite builds the same graph (a
refused site is left as it was; the graph-wide passes run either way), so its saving is 0
by construction.

Alone (`alone_rows`): the analyzer predicts each family's saving over the *unfused* graph,
under CUDA graphs, its sites timed without PDL (runtime/site_probe.py). A leave-one-out
measures something else, a margin inside the plan. So each family of the plan is also
applied by itself to the unfused model, with the plan's CUDA-graph flag and without PDL:

    measured_saving_ms(f) = t(unfused) − t(f alone)

the quantity the prediction names (every site f matches, none taken by a deeper family).
"Unfused" is the runtime's own baseline: the traced graph with the graph-wide passes
(runtime/rewrite.py: repeated ops merged, the causal mask computed once per length),
which every plan gets, so they are in neither side of the difference. t(unfused) is timed
before and after the families, as the plan is above (the causal-SDPA pass turns the
baseline's SDPA on a kept causal mask into flash attention; the site probe reads that
mask the same way, runtime/site_probe.py). Limit: a plan without CUDA graphs
has no traced baseline (an empty bucket without graphs runs the original module), so
its alone rows also carry the traced path's host cost and the passes; every bucket of
the committed recipes uses graphs.

Repeats (`repeats` > 1, `bench --repeats`): one apply of a plan can time up to 50 µs
apart from another apply of the same plan at 512 tokens on an H100 (session 21), while
each apply's own replays agree within a few µs; so every row is applied and timed
`repeats` times, in rounds with the baseline timed between them, and its median is kept
(`without_ms_runs`, `with_ms_runs`: all of them). A row that fails its first round is
tried again in the next ones, unless it fails the same way again (errors in
`repeat_errors`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from statistics import median
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


def alone(plan: Plan) -> tuple[Plan, list[tuple[str, Plan]]]:
    """The unfused baseline (the plan's CUDA-graph flag, no PDL: the analyzer's site probes
    launch without it) and each family of the plan applied alone on it, with its config."""
    base = replace(plan, fusions=(), configs={}, pdl=False)
    return base, [(f, replace(base, fusions=(f,), configs={f: plan.configs[f]} if f in plan.configs else {}))
                  for f in plan.fusions]


def taken_over(plan_sites: Mapping[str, Sequence[str]],
               without_sites: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """Families applied at sites without the removed one that they did not hold with it:
    family -> those sites' modules (as a multiset: a module may name several sites, RoPE's
    function in every layer)."""
    out = {f: list((Counter(mods) - Counter(plan_sites.get(f, ()))).elements())
           for f, mods in without_sites.items()}
    return {f: mods for f, mods in out.items() if mods}


def ablation_rows(shape: int, plan: Plan, recipe_ms: float,
                  time_plan: Callable[[Plan], tuple[float, dict[str, list[str]]]],
                  plan_sites: Mapping[str, Sequence[str]], repeats: int = 1) -> list[dict[str, Any]]:
    """One row per removed family: `time_plan(p)` gives p's median ms at `shape` and the
    modules of its sites applied per family; `plan_sites` the same for the whole plan,
    `recipe_ms` the recipe's own timing (kept). The baseline `plan_ms` is `time_plan(plan)`
    timed before and after the leave-one-outs (their median, all kept in `plan_ms_runs`:
    drift shows as their spread), and between the rounds when `repeats` > 1 (module doc);
    if neither run works it is recipe_ms and every row says so (`baseline_error`). A plan
    that raises is a row with its error. Rows carry both timings so a reader can recompute
    the saving."""
    baseline = _Baseline(lambda: time_plan(plan)[0])
    rows, timed, failed = [], [], []

    def first(row: dict[str, Any], ms: float, sites: dict[str, list[str]]) -> bool:
        taken = taken_over(plan_sites, sites)
        row.update(without_ms_runs=[ms], taken_over={f: len(m) for f, m in taken.items()}, taken_sites=taken)
        return True
    for removed, without in leave_one_out(plan):
        row: dict[str, Any] = {"shape": shape, "removed": removed, "recipe_ms": recipe_ms}
        if removed in plan.fusions:
            held = list(plan_sites.get(removed, ()))
            row.update(sites_in_plan=len(held), held_sites=held)
            if not held:  # it applied no site: without it the rewrite builds the same graph
                row.update(without_ms=None, measured_saving_ms=0.0, taken_over={}, taken_sites={},
                           same_graph=True)
                rows.append(row)
                continue
        try:
            first(row, *time_plan(without))
            timed.append((row, without))
        except Exception as exc:  # a plan that fails here is a result, not a crash
            row.update(without_ms=None, measured_saving_ms=None, error=one_line(exc))
            failed.append((row, without, first))
        rows.append(row)
    _again(timed, "without_ms_runs", repeats, baseline, time_plan, failed)
    baseline.again()
    plan_ms = baseline.ms if baseline.runs else recipe_ms
    for row in rows:
        row.update(plan_ms=plan_ms, plan_ms_runs=list(baseline.runs))
        if baseline.errors and not baseline.runs:
            row["baseline_error"] = baseline.errors[0]
        if row.get("same_graph"):
            row["without_ms"] = plan_ms
        elif row.get("without_ms") is not None:
            row["measured_saving_ms"] = row["without_ms"] - plan_ms
    return rows


First = Callable[[dict[str, Any], float, dict[str, list[str]]], bool]  # fills a row's first timing


def _again(timed: list[tuple[dict[str, Any], Plan]], key: str, repeats: int, baseline: _Baseline,
           time_plan: Callable[[Plan], tuple[float, Any]],
           failed: Sequence[tuple[dict[str, Any], Plan, First]] = ()) -> None:
    """Rounds 2..repeats of the timed rows, the baseline timed before each; each row's
    timing is then the median of its runs (`key`). A later round that fails keeps the
    runs that worked; a row that failed the first round (`failed`, with what fills its
    first timing: True where it is to be timed again) is tried again in each round until
    it works (its first error then kept in `repeat_errors`) or fails as it did first."""
    failed = list(failed)
    for _ in range(repeats - 1):
        baseline.again()
        for row, p in timed:
            try:
                row[key].append(time_plan(p)[0])
            except Exception as exc:  # noqa: BLE001 - the first round's timing stands
                row.setdefault("repeat_errors", []).append(one_line(exc))
        for entry in list(failed):
            row, p, first = entry
            try:
                again = first(row, *time_plan(p))
            except Exception as exc:  # noqa: BLE001 - it stays a row with its error
                row.setdefault("repeat_errors", []).append(one_line(exc))
                if one_line(exc) == row["error"]:  # the same failure again: not transient
                    failed.remove(entry)
                continue
            failed.remove(entry)
            row.setdefault("repeat_errors", []).insert(0, row.pop("error"))
            if again:
                timed.append((row, p))
    for row, _ in timed:
        row[key.removesuffix("_runs")] = median(row[key])


class _Baseline:
    """A reference timing taken before and after the rows it serves (their median: drift
    between them shows as their spread); a failure is kept as text, never raised."""

    def __init__(self, time: Callable[[], float]):
        self.time, self.runs, self.errors = time, [], []
        self.again()

    def again(self) -> None:
        try:
            self.runs.append(self.time())
        except Exception as exc:  # rows still stand: compared with another timing, or none
            self.errors.append(one_line(exc))

    @property
    def ms(self) -> float | None:
        return median(self.runs) if self.runs else None


def alone_rows(shape: int, plan: Plan,
               time_plan: Callable[[Plan], tuple[float, dict[str, list[str]]]],
               repeats: int = 1) -> list[dict[str, Any]]:
    """One row per family of `plan`: the unfused model with it alone (`alone`), timed by
    `time_plan` like the plan, against the unfused model timed before and after. Each row:
    `unfused_ms` (+ `unfused_ms_runs`), `with_ms`, the sites it applied alone (`sites`, their
    modules in `applied_sites`), and
    `measured_saving_ms` = unfused − with; a family that fails is a row with its error, an
    unfused model that fails to time leaves every saving None with `baseline_error`.
    `repeats`: each row applied and timed that many times, its median kept (module doc)."""
    base, each = alone(plan)
    baseline = _Baseline(lambda: time_plan(base)[0])
    rows: list[dict[str, Any]] = []
    timed, failed = [], []

    def first(row: dict[str, Any], ms: float, sites: dict[str, list[str]]) -> bool:
        applied = list(sites.get(row["family"], ()))
        row.update(with_ms_runs=[ms], sites=len(applied), applied_sites=applied, with_ms=ms)
        return bool(applied)  # a family that found no site is not compared: one timing will do
    for family, only in each:
        row: dict[str, Any] = {"shape": shape, "family": family, "cuda_graph": base.cuda_graph}
        try:
            if first(row, *time_plan(only)):
                timed.append((row, only))
        except Exception as exc:  # a family that fails alone is a result, not a crash
            row.update(with_ms=None, sites=None, error=one_line(exc))
            failed.append((row, only, first))
        rows.append(row)
    _again(timed, "with_ms_runs", repeats, baseline, time_plan, failed)
    baseline.again()
    for row in rows:
        row.update(unfused_ms=baseline.ms, unfused_ms_runs=list(baseline.runs), measured_saving_ms=None)
        if baseline.errors and not baseline.runs:
            row["baseline_error"] = baseline.errors[0]
        elif row["with_ms"] is not None and baseline.ms is not None:
            row["measured_saving_ms"] = baseline.ms - row["with_ms"]
    return rows
