"""The candidates part of the HTML report: predicted vs measured savings, per family and per plan.

Inputs: one analysis shape (`advisor.analyze.to_json`'s `shapes[i]`), the optional bench
and recipe dicts, and the optional tuning history rows (advisor/report/history.py; rows
without `params` give no per-family estimate).

Per family, the measured saving is estimated from the COMPLETE trials of the tuned bucket
whose representative length equals the shape's length, else the bucket that contains it
(the smallest bound above it), by advisor/report/attribution.py: the median difference of
trials differing in that family alone ("paired"), else a least-squares fit of latency on
the families' on/off (and cuda_graph). A family it cannot separate (always on, always off,
collinear, not tuned there) shows "—" with the reason as a tooltip. The plan row compares
the sum of the predicted savings of the families in the plan with the plan's measured
saving (bench eager − advisor, else the recipe's unfused − tuned). All input text is escaped.

A bench run with `--ablate` measures each family directly (advisor/ablation.py: the plan
without it minus the plan, at this very length); that measurement is preferred to the
trial estimate. Under CUDA graphs a removed launch is worth what a small kernel takes on
the GPU (its launch gap, ramp and tail: the mean device time of this shape's small kernels
in the profile, ~1.6 µs on the H200), not the eager host cost (~8 µs), so the family is
then compared with its prediction re-priced that way (`graph_priced`).
"""

from __future__ import annotations

from advisor.report.accuracy import (
    TOLERANCE,
    ablation_at,
    accuracy,
    alone_at,
    alone_prediction,
    leave_one_out_prediction,
    plan_families,
    price,
    small_kernel_us,
)
from advisor.report.attribution import (
    CUDA_GRAPH,
    PAIRED,
    Attribution,
    FamilySaving,
    attribute,
    trials_from_history,
)
from advisor.report.html_bench import applied_rows, bench_rows
from advisor.report.html_common import DASH, _bytes, _e, _f, _num, _table

HEADS = ("#", "family", "kernel", "sites", "launches removed", "bytes avoided", "predicted saving",
         "plan", "measured saving", "error (measured − predicted)")


def _bucket_of(bounds: list[int], length: int) -> int | None:
    """Recipe.bucket_for on bare bounds: the smallest bound >= length, else the largest."""
    fits = [b for b in sorted(bounds) if b >= length]
    return fits[0] if fits else (max(bounds) if bounds else None)


def _plan_families(bench: dict | None, recipe: dict | None, length: int) -> dict[str, str] | None:
    """family -> what happened to it at this length (from the bench, else the recipe)."""
    rows = [r for r in applied_rows(bench) if r.get("family") != "(all)"]
    if rows:
        b = _bucket_of([r["bucket"] for r in rows if isinstance(r.get("bucket"), int)], length)
        rows = [r for r in rows if r.get("bucket") in (b, None)]
        return {str(r["family"]): f"applied at {r.get('applied', 0)} sites"
                + (f", {len(r['unfused'])} unfused" if r.get("unfused") else "") for r in rows}
    if not recipe:
        return None
    if recipe.get("kind") == "advisor.plan":
        return {f: "in plan" for f in recipe.get("fusions", [])}
    buckets = {b.get("max_len"): b for b in recipe.get("buckets", [])}
    b = _bucket_of([m for m in buckets if isinstance(m, int)], length)
    return None if b is None else {f: "in plan" for f in buckets[b].get("plan", {}).get("fusions", [])}


def _measured_saving(bench: dict | None, recipe: dict | None, length: int) -> tuple[float, str] | None:
    """(ms, source): eager − advisor from the bench at this length, else the recipe's
    unfused − tuned for a bucket tuned at exactly this length."""
    ms = {r.get("variant"): _num(r.get("ms")) for r in bench_rows(bench, length)}
    eager, fused = ms.get("eager"), ms.get("advisor")
    if eager is not None and fused is not None:
        return eager - fused, "bench: eager − advisor"
    for b in (recipe or {}).get("buckets", []):
        m = b.get("measured", {})
        if b.get("max_len") == length and None not in (_num(m.get("unfused_ms")), _num(m.get("tuned_ms"))):
            return m["unfused_ms"] - m["tuned_ms"], "recipe: unfused − tuned"
    return None


def _error_cells(measured: float | None, predicted: float | None,
                 tip: str = "") -> list[tuple[str, bool]]:
    """(measured, measured − predicted) cells; `tip` (plain text) as the measured cell's tooltip."""
    if measured is None:
        return [(f'<span title="{_e(tip)}">{DASH}</span>' if tip else DASH, True), (DASH, True)]
    cell = f"{measured:.3f} ms"
    cell = f'<span title="{_e(tip)}">{cell}</span>' if tip else cell
    if predicted is None:
        return [(cell, True), (DASH, True)]
    rel = f" ({100 * (measured - predicted) / predicted:+.0f}%)" if predicted else ""
    return [(cell, True), (f"{measured - predicted:+.3f} ms{_e(rel)}", True)]


# ---- per-family measured savings from the tuning trials ----------------------------------

def tuned_bucket(history: list[dict] | None, length: int) -> int | None:
    """The bucket with trial parameters at `length`: equal representative length, else the
    smallest bound above it (None if `length` is beyond every bound or nothing was tuned)."""
    bounds = sorted({r["bucket"] for r in history or [] if isinstance(r.get("bucket"), int)
                     and isinstance(r.get("params"), dict)})
    b = _bucket_of(bounds, length)
    return b if b is not None and b >= length else None


def family_attribution(history: list[dict] | None, families: list[str],
                       length: int) -> tuple[int, Attribution] | None:
    bucket = tuned_bucket(history, length)
    if bucket is None:
        return None
    return bucket, attribute(trials_from_history(history or [], bucket), families)


def _tip(fs: FamilySaving, bucket: int, length: int) -> str:
    where = f"bucket ≤ {bucket} tokens" + (f" (trials timed at {bucket}, not {length})" if bucket != length
                                           else "")
    counts = f"on in {fs.trials_on}, off in {fs.trials_off} trials of {where}"
    if fs.saving_ms is None:
        return f"no estimate: {fs.reason}; {counts}"
    lsq = (f"least squares {fs.lstsq_ms:.3f} ms" + (f" ± {fs.stderr_ms:.3f}" if fs.stderr_ms is not None
                                                     else " (exact fit, no residual check)"))
    if fs.method == PAIRED:
        return (f"paired: median over {fs.pairs} pairs of trials differing only in {fs.family} "
                f"({lsq}); {counts}")
    return f"{lsq}: latency ≈ base − Σ saving·on (no pair of trials differs only in {fs.family}); {counts}"


def _caption(bucket: int, att: Attribution) -> str:
    fit = (f", residual RMS {att.residual_ms:.3f} ms over {att.dof} degrees of freedom"
           if att.residual_ms is not None else ", no residual degrees of freedom")
    graph = f", CUDA graphs {att.cuda_graph_ms:+.3f} ms" if att.cuda_graph_ms is not None else ""
    return (f"<p class='muted'>Measured per family from {att.trials} completed trials of bucket ≤ "
            f"{_e(bucket)} tokens{_e(fit)}{_e(graph)}.</p>")


# ---- per-family measured savings from a leave-one-out bench (--ablate) ----------------

def _alone_cells(row: dict, cands: dict[str, dict], ceilings: dict | None,
                 kernel_us: float | None) -> list[tuple[str, bool]]:
    """A family timed alone on the unfused model (advisor/ablation.py `alone_rows`): the
    analyzer's own terms, so compared with its prediction as it stands (re-priced for CUDA
    graphs when the row ran under them), no margin to work out."""
    c = cands[str(row.get("family"))]
    eager = _num(c.get("predicted_saving_ms"))
    predicted = alone_prediction(row, c, ceilings, kernel_us, cands=cands)
    tip = (f"alone in the bench at {row.get('shape')} tokens: unfused {_f(row.get('unfused_ms'))} ms − "
           f"unfused with {row.get('family')} at {_f(row.get('sites'), '.0f')} sites "
           f"{_f(row.get('with_ms'))} ms")
    if row.get("error") or row.get("baseline_error"):
        tip += f" ({row.get('error') or row.get('baseline_error')})"
    if predicted != eager and predicted is not None:
        how = "re-priced for CUDA graphs, " if row.get("cuda_graph") else ""
        tip += (f"; compared with the prediction {how}at the sites applied, {predicted:.3f} ms "
                f"(eager-priced, all sites: {_f(eager)} ms)")
    if (warm := alone_prediction(row, c, ceilings, kernel_us, warm=True, cands=cands)) != predicted \
            and warm is not None:
        tip += f"; with the site's activations in L2 the probe predicted {warm:.3f} ms"
    return _error_cells(_num(row.get("measured_saving_ms")), predicted, tip)


def _ablation_cells(row: dict, cands: dict[str, dict], ceilings: dict | None, graphs: bool,
                    kernel_us: float | None = None, plan: set[str] | None = None) -> list[tuple[str, bool]]:
    fam = row.get("removed")
    c = cands[str(fam)]
    eager = _num(c.get("predicted_saving_ms"))
    tip = (f"leave-one-out in the bench at {row.get('shape')} tokens: plan without {fam} "
           f"{_f(row.get('without_ms'))} ms − plan {_f(row.get('plan_ms'))} ms")
    if row.get("error"):
        tip += f" ({row['error']})"
    if row.get("baseline_error"):
        tip += f"; the plan itself failed to time ({row['baseline_error']}): compared with the recipe's row"
    if row.get("same_graph"):  # advisor/ablation.py: attempted no site, so not timed
        return _error_cells(0.0, 0.0, f"it held no site of the plan at {row.get('shape')} tokens: "
                            "without it the rewrite builds the same graph (not timed, saving 0; "
                            f"the analysis predicted {_f(eager)} ms with its sites)")
    own = price(c, ceilings, kernel_us, graphs)
    if graphs and own is not None:
        timed = _num(c.get("device_saving_ms")) is not None
        per = ("the site timed fused and unfused at analysis" if timed
               else f"{kernel_us:.2f} µs per removed kernel" if kernel_us is not None
               else "the graph launch cost")
        tip += (f"; compared with the prediction re-priced for CUDA graphs ({per}), {own:.3f} ms "
                f"(eager-priced {_f(eager)} ms)")
    predicted = leave_one_out_prediction(row, cands, ceilings, kernel_us, graphs, plan=plan)
    if predicted != own and predicted is not None:
        took = ", ".join(f"{g} {n}" for g, n in row["taken_over"].items()) or "none"
        tip += (f"; it held {row['sites_in_plan']} of its {c.get('count')} sites in the plan, and "
                f"without it other families took sites back ({took}): its predicted margin, "
                f"{predicted:.3f} ms, is what the leave-one-out measures")
    return _error_cells(_num(row.get("measured_saving_ms")), predicted, tip)


# ---- the table --------------------------------------------------------------------------------

def candidates_table(s: dict, bench: dict | None, recipe: dict | None,
                     history: list[dict] | None = None, ceilings: dict | None = None) -> str:
    length, cands = s["seq_len"], s.get("candidates", [])
    plan = _plan_families(bench, recipe, length)
    found = family_attribution(history, [str(c.get("family")) for c in cands], length)
    ablated, alone = ablation_at(bench, length), alone_at(bench, length)
    graphs = CUDA_GRAPH in ablated
    by_family = {str(c.get("family")): c for c in cands}
    rows, in_plan = [], 0.0
    for i, c in enumerate(cands, 1):
        fam = str(c.get("family"))
        status = ("analysis only" if not c.get("kernel") else
                  DASH if plan is None else plan.get(fam, "not in plan"))
        predicted = _num(c.get("predicted_saving_ms"))
        if plan is not None and fam in plan and c.get("applicable", True) and c.get("kernel"):
            in_plan += predicted or 0.0
        fs = found[1].get(fam) if found is not None else None
        if fam in alone:
            measured = _alone_cells(alone[fam], by_family, ceilings, small_kernel_us(s))
        elif fam in ablated:
            measured = _ablation_cells(ablated[fam], by_family, ceilings, graphs, small_kernel_us(s),
                                       plan_families(ablated, by_family))
        elif fs is not None and found is not None:
            measured = _error_cells(fs.saving_ms, predicted, _tip(fs, found[0], length))
        else:
            measured = [(DASH, True), (DASH, True)]
        rows.append([(str(i), True), (_e(fam), False), (_e(c.get("kernel") or DASH), False),
                     (f'<span title="{_e(", ".join(map(str, c.get("sites", []))))}">'
                      f'{_e(c.get("count", DASH))}</span>', True),
                     (_e(c.get("launches_removed", DASH)), True), (_bytes(c.get("bytes_avoided")), True),
                     (_f(c.get("predicted_saving_ms"), unit=" ms"), True), (_e(status), False), *measured])
    total = _measured_saving(bench, recipe, length)
    if total is not None or plan is not None:
        label = f"plan total ({total[1]})" if total else "plan total"
        rows.append([("", False), (_e(label), False), ("", False), ("", True), ("", True), ("", True),
                     (f"{in_plan:.3f} ms", True), ("", False),
                     *_error_cells(total[0] if total else None, in_plan)])
    caption = _caption(*found) if found is not None else ""
    return (f"<h3>Fusion candidates at {_e(length)} tokens</h3>{caption}"
            + _table(HEADS, rows, total=len(cands) if len(rows) > len(cands) else None)
            + _accuracy_line(s, bench, ceilings))


def _accuracy_line(s: dict, bench: dict | None, ceilings: dict | None) -> str:
    """How many families' predictions fall within ±25% of what the bench measured, per
    measurement (report/accuracy.py; issue 7's target). Empty without --alone / --ablate."""
    groups: dict[str, list[bool]] = {}
    for r in accuracy({"ceilings": ceilings, "shapes": [s]}, bench):
        if r.within() is not None:
            groups.setdefault(r.source, []).append(bool(r.within()))
    parts = [f"{sum(ok)} of {len(ok)} families measured {source}" for source, ok in groups.items()]
    return (f"<p>Predicted within ±{TOLERANCE:.0%} of measured: {_e('; '.join(parts))}.</p>"
            if parts else "")


def candidates_section(a: dict, bench: dict | None, recipe: dict | None,
                       history: list[dict] | None = None) -> str:
    note = ("<p class='muted'>A family's measured saving comes from the tuning trials of the bucket "
            "that holds the shape's length: the median latency difference between trials that differ "
            "in that family alone (paired), else a least-squares fit of latency ≈ base − Σ saving × "
            "on/off over the families (and CUDA graphs). It ignores interactions between families and "
            "their configs; hover a cell for the method and trial counts. “—”: no estimate (no tuning "
            "trials with parameters at that length, or the family was always on, always off or toggled "
            "together with another: hover for why). A bench run with --ablate measures each family "
            "directly instead: the plan without it minus the plan, at that length; under CUDA graphs "
            "it is compared with the prediction re-priced at the graph launch cost. With --alone, each "
            "family is timed by itself on the unfused model instead, the very saving the analyzer "
            "predicts, and that measurement is shown where present. The plan row "
            "compares the sum of the predicted savings of the families in the plan with the plan's "
            "measured saving.</p>")
    return "".join(candidates_table(s, bench, recipe, history, a.get("ceilings"))
                   for s in a.get("shapes", [])) + note
