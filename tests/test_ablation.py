"""Leave-one-out ablation (advisor/ablation.py): plans, bench rows, and the report's use."""

import json
from pathlib import Path

import pytest
import torch

from advisor.ablation import ablation_rows, alone, alone_rows, leave_one_out, taken_over
from advisor.bench import run_bench, to_json
from advisor.loader import load_model_file
from advisor.report.accuracy import graph_priced, marginal_prediction, small_kernel_us
from advisor.report.html import render_html
from advisor.runtime.plan import Plan
from advisor.runtime.recipe import Recipe

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
PLAN = Plan(("add_rms_norm", "rope", "gated_act"), {"rope": "BLOCK_D=32", "gated_act": ""}, cuda_graph=True)


def test_leave_one_out_drops_each_family_and_its_config_then_graphs():
    out = leave_one_out(PLAN)
    assert [r for r, _ in out] == ["add_rms_norm", "rope", "gated_act", "cuda_graph"]
    no_rope = dict(out)["rope"]
    assert no_rope.fusions == ("add_rms_norm", "gated_act") and "rope" not in no_rope.configs
    assert no_rope.cuda_graph and not dict(out)["cuda_graph"].cuda_graph
    assert [r for r, _ in leave_one_out(Plan(("rope",)))] == ["rope"]
    with_pdl = leave_one_out(Plan(("rope",), cuda_graph=True, pdl=True))
    assert [r for r, _ in with_pdl] == ["rope", "cuda_graph", "pdl"]
    assert dict(with_pdl)["pdl"] == Plan(("rope",), cuda_graph=True)


def test_rows_carry_both_timings_the_sites_taken_over_and_a_failing_plan_is_a_row():
    plan_sites = {"add_rms_norm": ["l0.norm", "l1.norm", "l2.norm", "l3.norm"], "rope": ["l0.attn", "l1.attn"],
                  "gated_act": []}
    baselines = iter([1.9, 2.1])  # the plan itself, timed before and after the others

    def time_plan(p):
        if p == PLAN:
            return next(baselines), plan_sites
        if "rope" not in p.fusions:
            raise RuntimeError("no kernel\nsecond line")
        # without add_rms_norm, gated_act takes 3 of its sites (a shallower family)
        sites = {f: plan_sites[f] for f in p.fusions} | (
            {"gated_act": ["l0.mlp", "l1.mlp", "l2.mlp"]} if "add_rms_norm" not in p.fusions else {})
        return 2.0 + 0.5 * (3 - len(p.fusions)) + (0.0 if p.cuda_graph else 1.0), sites

    rows = {r["removed"]: r for r in ablation_rows(128, PLAN, 2.3, time_plan, plan_sites)}
    # the baseline is the plan timed as the leave-one-outs are (mean of 1.9 and 2.1), not the recipe's 2.3
    assert all(r["plan_ms"] == 2.0 and r["plan_ms_runs"] == [1.9, 2.1] and r["recipe_ms"] == 2.3
               for r in rows.values())
    assert rows["add_rms_norm"]["measured_saving_ms"] == 0.5 and rows["add_rms_norm"]["without_ms"] == 2.5
    assert rows["add_rms_norm"]["sites_in_plan"] == 4 and rows["add_rms_norm"]["taken_over"] == {"gated_act": 3}
    assert rows["add_rms_norm"]["held_sites"] == plan_sites["add_rms_norm"]
    assert rows["add_rms_norm"]["taken_sites"] == {"gated_act": ["l0.mlp", "l1.mlp", "l2.mlp"]}
    # gated_act attempted no site: the same graph without it, not timed, saving 0
    assert rows["gated_act"]["taken_over"] == {} and rows["gated_act"]["sites_in_plan"] == 0
    assert rows["gated_act"]["measured_saving_ms"] == 0.0 and rows["gated_act"]["same_graph"]
    assert rows["cuda_graph"]["measured_saving_ms"] == 1.0 and "sites_in_plan" not in rows["cuda_graph"]
    assert rows["rope"]["measured_saving_ms"] is None and rows["rope"]["error"] == "RuntimeError: no kernel"
    assert not any("baseline_error" in r for r in rows.values())


def test_a_family_that_applied_no_site_is_not_timed_and_a_failing_baseline_is_said():
    """Refused sites stay as they were and the graph-wide passes run either way: without a
    family that applied nothing the graph is the same."""
    plan = Plan(("add_rms_norm", "gated_act"))
    timed = []

    def time_plan(p):
        timed.append(p)
        if p == plan:
            raise RuntimeError("out of memory")
        return 3.0, {}

    rows = {r["removed"]: r for r in ablation_rows(4, plan, 2.5, time_plan, {"add_rms_norm": ["a", "b"]})}
    assert rows["gated_act"]["same_graph"] and rows["gated_act"]["measured_saving_ms"] == 0.0
    assert Plan(("add_rms_norm",)) not in timed  # the plan without gated_act: not timed
    assert all(r["plan_ms"] == 2.5 and r["plan_ms_runs"] == [] and r["baseline_error"] == "RuntimeError: "
               "out of memory" for r in rows.values())
    assert rows["add_rms_norm"]["measured_saving_ms"] == 0.5


def test_sites_taken_over_count_a_module_named_by_several_sites():
    """RoPE's sites are named after its function, the same in every layer."""
    assert taken_over({"rope": ["f"]}, {"rope": ["f", "f", "f"], "gated_act": []}) == {"rope": ["f", "f"]}
    assert taken_over({"rope": ["f", "f"]}, {"rope": ["f", "f"]}) == {}


def test_a_deep_familys_margin_is_priced_site_by_site_where_the_sites_are_named():
    """add_rms_norm_linear holds 2 QKV sites and the lm_head; without it add_rms_norm and
    qkv_merge take the QKV sites back, and the lm_head goes unfused. Its per-site mean
    would price the lm_head like a QKV site."""
    cands = {"add_rms_norm_linear": {"count": 4, "sites": ["l0.in", "l1.in", "l1.post", "norm"],
                                     "site_savings_ms": [0.01, 0.01, 0.02, 0.06], "device_saving_ms": 0.10},
             "add_rms_norm": {"count": 4, "sites": ["l0.in", "l1.in", "l1.post", "norm"],
                              "site_savings_ms": [0.005] * 4, "device_saving_ms": 0.02},
             "qkv_merge": {"count": 2, "sites": ["l0.attn", "l1.attn"], "site_savings_ms": [0.003, 0.003],
                           "device_saving_ms": 0.006}}
    row = {"removed": "add_rms_norm_linear", "sites_in_plan": 3, "held_sites": ["l0.in", "l1.in", "norm"],
           "taken_over": {"add_rms_norm": 2, "qkv_merge": 2},
           "taken_sites": {"add_rms_norm": ["l0.in", "l1.in"], "qkv_merge": ["l0.attn", "l1.attn"]}}
    measured = lambda c: c["device_saving_ms"]  # noqa: E731
    assert marginal_prediction(row, cands, measured) == pytest.approx(0.08 - 0.01 - 0.006)
    # counts only (benches before session 20): the mean per site
    counted = {k: v for k, v in row.items() if k not in ("held_sites", "taken_sites")}
    assert marginal_prediction(counted, cands, measured) == pytest.approx(0.10 * 3 / 4 - 0.01 - 0.006)
    # a family re-priced (here doubled) keeps its sites' proportions
    assert marginal_prediction(row, cands, lambda c: 2 * c["device_saving_ms"]) == pytest.approx(2 * 0.064)
    # per-site proportions of the other sign than the price (a measured loss re-priced
    # as a gain) are not used: the mean instead
    flipped = {**cands, "add_rms_norm": {**cands["add_rms_norm"], "device_saving_ms": -0.02}}
    assert marginal_prediction(row, flipped, lambda c: 0.02 if c["count"] == 4 and c["device_saving_ms"] < 0
                               else c["device_saving_ms"]) == pytest.approx(0.08 - 0.01 - 0.006)
    # a site the analysis did not see is priced at the family's mean
    other = {**row, "held_sites": ["l0.in", "l1.in", "elsewhere"]}
    assert marginal_prediction(other, cands, measured) == pytest.approx(0.02 + 0.025 - 0.016)


def test_the_report_predicts_a_deep_familys_margin_over_the_families_that_take_its_sites_back():
    cands = {"add_rms_norm_linear": {"family": "add_rms_norm_linear", "count": 16, "predicted_saving_ms": 0.32},
             "add_rms_norm": {"family": "add_rms_norm", "count": 16, "predicted_saving_ms": 0.16},
             "qkv_merge": {"family": "qkv_merge", "count": 8, "predicted_saving_ms": 0.08}}
    price = lambda c: c["predicted_saving_ms"]  # noqa: E731
    row = {"removed": "add_rms_norm_linear", "sites_in_plan": 8,
           "taken_over": {"add_rms_norm": 8, "qkv_merge": 8}}
    # its 8 sites' share (0.16) less add_rms_norm's on 8 of 16 sites (0.08) and qkv_merge's 8 of 8
    assert abs(marginal_prediction(row, cands, price) - (0.16 - 0.08 - 0.08)) < 1e-12
    assert abs(marginal_prediction({**row, "taken_over": {}}, cands, price) - 0.16) < 1e-12
    assert marginal_prediction({"removed": "add_rms_norm_linear", "measured_saving_ms": 0.1}, cands, price) is None
    assert marginal_prediction({**row, "taken_over": {"rope": 2}}, cands, price) is None  # no price for rope
    # in the page: an H100 analysis at 1 token (session 14), a row with the site counts
    analysis = json.loads((RESULTS / "h100-s14A-analysis.json").read_text())
    bench = {"schema_version": 1, "kind": "advisor.bench", "rows": [], "applied": [], "ablation": [
        {"shape": 1, "removed": "add_rms_norm_linear", "plan_ms": 1.598, "without_ms": 1.674,
         "measured_saving_ms": 0.076, "sites_in_plan": 8, "taken_over": {"add_rms_norm": 8, "qkv_merge": 8}},
        {"shape": 1, "removed": "rms_norm", "plan_ms": 1.598, "without_ms": 1.598, "measured_saving_ms": 0.0,
         "sites_in_plan": 0, "taken_over": {}, "same_graph": True}]}
    page = render_html(analyses=[analysis], bench=bench, title="t")
    assert "its predicted margin" in page and "took sites back (add_rms_norm 8, qkv_merge 8)" in page
    assert "the rewrite builds the same graph (not timed, saving 0; the analysis predicted" in page


def test_alone_applies_each_family_by_itself_on_the_unfused_graph_without_pdl():
    plan = Plan(("add_rms_norm", "rope"), {"rope": "BLOCK_D=32"}, cuda_graph=True, pdl=True)
    base, each = alone(plan)
    assert base == Plan(cuda_graph=True)  # the probes the prediction comes from launch without PDL
    assert each == [("add_rms_norm", Plan(("add_rms_norm",), cuda_graph=True)),
                    ("rope", Plan(("rope",), {"rope": "BLOCK_D=32"}, cuda_graph=True))]


def test_alone_rows_measure_against_the_unfused_model_timed_before_and_after():
    unfused = iter([3.0, 3.2])

    def time_plan(p):
        if not p.fusions:
            return next(unfused), {}
        if p.fusions == ("gated_act",):
            raise RuntimeError("refused\nmore")
        return {"add_rms_norm": 2.5, "rope": 3.05}[p.fusions[0]], {p.fusions[0]: ["a", "b", "c", "d"]}

    rows = {r["family"]: r for r in alone_rows(8, PLAN, time_plan)}
    assert list(rows) == ["add_rms_norm", "rope", "gated_act"]
    assert all(r["unfused_ms"] == 3.1 and r["unfused_ms_runs"] == [3.0, 3.2] and r["cuda_graph"]
               for r in rows.values())
    assert abs(rows["add_rms_norm"]["measured_saving_ms"] - 0.6) < 1e-12 and rows["add_rms_norm"]["sites"] == 4
    assert abs(rows["rope"]["measured_saving_ms"] - 0.05) < 1e-12
    assert rows["gated_act"]["measured_saving_ms"] is None and rows["gated_act"]["error"] == "RuntimeError: refused"

    def broken(p):
        if not p.fusions:
            raise RuntimeError("out of memory")
        return 1.0, {}
    rows = alone_rows(8, Plan(("rope",)), broken)
    assert rows[0]["measured_saving_ms"] is None and rows[0]["baseline_error"] == "RuntimeError: out of memory"


def test_the_report_compares_an_alone_row_with_the_prediction_as_it_stands():
    analysis = json.loads((RESULTS / "h200-analysis-2026-12-02.json").read_text())
    shape = analysis["shapes"][0]
    t = shape["seq_len"]
    cand = next(c for c in shape["candidates"] if c["family"] == "add_rms_norm")
    repriced = graph_priced(cand, analysis["ceilings"], small_kernel_us(shape))
    bench = {"schema_version": 1, "kind": "advisor.bench", "rows": [], "applied": [],
             "ablation": [{"shape": t, "removed": "add_rms_norm", "plan_ms": 1.45, "without_ms": 1.62,
                           "measured_saving_ms": 0.17, "sites_in_plan": 16, "taken_over": {}}],
             "alone": [{"shape": t, "family": "add_rms_norm", "cuda_graph": True, "unfused_ms": 2.0,
                        "with_ms": 1.8, "sites": 16, "measured_saving_ms": 0.2}]}
    page = render_html(analyses=[analysis], bench=bench, title="t")
    assert "alone in the bench" in page and "leave-one-out in the bench" not in page  # alone preferred
    assert f"{0.2 - repriced:+.3f} ms" in page


def test_bench_ablate_and_alone_on_the_cpu_time_every_family_of_the_plan():
    mf = load_model_file("examples/tiny_llama.py")
    plan = Plan(("add_rms_norm", "gated_act"))
    # 4 tokens: each interpreted kernel runs a few programs (at 16, gated_act's default
    # tile ran 96 per launch, ~75 s in all); the leave-one-out rows do not depend on size.
    result = run_bench(mf, Recipe.from_plan(plan), (4,), 1, torch.device("cpu"), torch.float32, (),
                       truth=False, ablate=True, alone=True)
    rows = to_json(result)["ablation"]
    assert [r["removed"] for r in rows] == ["add_rms_norm", "gated_act"]
    advisor_ms = next(r["ms"] for r in result.rows if r["variant"] == "advisor")
    for r in rows:
        assert r["shape"] == 4 and r["recipe_ms"] == advisor_ms and r["plan_ms"] > 0 and r["without_ms"] > 0
        assert abs(r["measured_saving_ms"] - (r["without_ms"] - r["plan_ms"])) < 1e-12
    rows = to_json(result)["alone"]
    assert [(r["family"], r["sites"]) for r in rows] == [("add_rms_norm", 4), ("gated_act", 2)]  # 2 layers
    assert rows[1]["applied_sites"] == ["layers.0.feed_forward", "layers.1.feed_forward"]
    for r in rows:
        assert abs(r["measured_saving_ms"] - (r["unfused_ms"] - r["with_ms"])) < 1e-12


def test_report_prefers_the_ablation_and_reprices_launches_under_graphs():
    analysis = json.loads((RESULTS / "h200-analysis-2026-12-02.json").read_text())
    shape = analysis["shapes"][0]
    t = shape["seq_len"]
    cand = next(c for c in shape["candidates"] if c["family"] == "add_rms_norm")
    bench = {"schema_version": 1, "kind": "advisor.bench", "rows": [], "applied": [], "ablation": [
        {"shape": t, "removed": "add_rms_norm", "plan_ms": 1.45, "without_ms": 1.62, "measured_saving_ms": 0.17},
        {"shape": t, "removed": "cuda_graph", "plan_ms": 1.45, "without_ms": 6.0, "measured_saving_ms": 4.55}]}
    page = render_html(analyses=[analysis], bench=bench, title="t")
    per_kernel = small_kernel_us(shape)  # the profile's small kernels: 1.60 µs each
    assert per_kernel is not None and 1.5 < per_kernel < 1.7
    assert graph_priced(cand, analysis["ceilings"]) < graph_priced(cand, analysis["ceilings"], per_kernel)
    repriced = graph_priced(cand, analysis["ceilings"], per_kernel)
    # 128 launches at ~1.6 µs + 2 MB at ~4.2 TB/s, far below the eager-priced 1.2 ms
    assert repriced is not None and 0.15 < repriced < 0.25 < cand["predicted_saving_ms"]
    assert "leave-one-out in the bench" in page and "0.170 ms" in page
    assert f"{0.17 - repriced:+.3f} ms" in page


def test_the_unfused_baseline_gets_the_graph_wide_passes_as_every_plan_does():
    """`bench --alone` measures each family against the traced model with no fusion: the
    passes (repeated ops merged, size-only values memoised) must be on that side too, or
    every family would be credited with them."""
    from advisor.loader import build, call, inputs_for
    from advisor.runtime.apply import apply

    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    x = inputs_for(mf, 4, 1, torch.device("cpu"))
    fast = apply(model, Recipe.from_plan(Plan(cuda_graph=True)))
    with torch.no_grad():
        call(fast, x)
    total = next(r for r in fast.summary() if r["family"] == "(all)")
    assert total["repeats_merged"] > 0 and total["shape_only_memoized"] > 0, total


def _scripted(times, sites):
    """A `time_plan` stand-in: each plan's next timing from `times` (by its fusions), or
    the exception there; the sites it applied from `sites`."""
    def time_plan(p):
        t = next(times[p.fusions])
        if isinstance(t, Exception):
            raise t
        return t, {f: sites[f] for f in p.fusions}
    return time_plan


def test_repeats_time_each_row_over_several_applies_and_keep_the_median():
    """One apply of a plan can time tens of µs from another: with repeats, rounds of the
    rows with the baseline between them; a failing later round keeps what worked."""
    plan = Plan(("add_rms_norm", "rope"), cuda_graph=False)
    sites = {"add_rms_norm": ["l0"], "rope": ["l0.attn"]}
    times = {("add_rms_norm", "rope"): iter([2.0, 2.2, 2.1]), ("rope",): iter([2.5, 2.9, 2.6]),
             ("add_rms_norm",): iter([2.4, RuntimeError("flaky"), 2.8])}
    time_plan = _scripted(times, sites)
    rows = {r["removed"]: r for r in ablation_rows(512, plan, 2.3, time_plan, sites, repeats=2)}
    assert rows["add_rms_norm"]["plan_ms_runs"] == [2.0, 2.2, 2.1] and rows["add_rms_norm"]["plan_ms"] == 2.1
    assert rows["add_rms_norm"]["without_ms_runs"] == [2.5, 2.9] and rows["add_rms_norm"]["without_ms"] == 2.7
    assert rows["add_rms_norm"]["measured_saving_ms"] == pytest.approx(0.6)
    assert rows["rope"]["without_ms_runs"] == [2.4] and rows["rope"]["repeat_errors"] == ["RuntimeError: flaky"]

    time_plan = _scripted({(): iter([3.0, 3.1, 3.2]), ("rope",): iter([2.8, 2.6])}, sites)
    (row,) = [r for r in alone_rows(512, Plan(("rope",), cuda_graph=True), time_plan, repeats=2)]
    assert row["with_ms_runs"] == [2.8, 2.6] and row["with_ms"] == pytest.approx(2.7)
    assert row["unfused_ms"] == 3.1 and row["measured_saving_ms"] == pytest.approx(0.4)


def test_a_row_that_fails_its_first_round_is_tried_again_in_the_next():
    plan = Plan(("add_rms_norm", "rope"), cuda_graph=False)
    sites = {"add_rms_norm": ["l0"], "rope": ["l0.attn"]}
    # the baseline: before, between each round, after
    times = {("add_rms_norm", "rope"): iter([2.0, 2.0, 2.0, 2.0]),
             ("rope",): iter([RuntimeError("OOM"), 2.5, 2.7]),
             ("add_rms_norm",): iter([RuntimeError("OOM"), RuntimeError("OOM again"), RuntimeError("x")])}
    time_plan = _scripted(times, sites)
    rows = {r["removed"]: r for r in ablation_rows(512, plan, 2.0, time_plan, sites, repeats=3)}
    late = rows["add_rms_norm"]  # failed round 1, timed in rounds 2 and 3
    assert late["without_ms_runs"] == [2.5, 2.7] and late["measured_saving_ms"] == pytest.approx(0.6)
    assert late["taken_over"] == {} and late["repeat_errors"] == ["RuntimeError: OOM"] and "error" not in late
    assert late["plan_ms_runs"] == [2.0] * 4
    never = rows["rope"]  # failed every round: a row with its error
    assert never["measured_saving_ms"] is None and never["error"] == "RuntimeError: OOM"
    assert never["repeat_errors"] == ["RuntimeError: OOM again", "RuntimeError: x"]

    sites["x"] = []
    time_plan = _scripted({(): iter([3.0, 3.0, 3.0, 3.0]), ("rope",): iter([RuntimeError("OOM"), 2.8, 2.6]),
                           ("x",): iter([RuntimeError("no kernel"), RuntimeError("no kernel")])}, sites)
    row, same = alone_rows(512, Plan(("rope", "x"), cuda_graph=True), time_plan, repeats=3)
    assert row["with_ms"] == pytest.approx(2.7) and row["sites"] == 1 and row["with_ms_runs"] == [2.8, 2.6]
    assert row["measured_saving_ms"] == pytest.approx(0.3) and row["unfused_ms_runs"] == [3.0] * 4
    assert "error" not in row and row["repeat_errors"] == ["RuntimeError: OOM"]
    # the same failure twice is not transient: not tried a third time (its iterator has two)
    assert same["error"] == "RuntimeError: no kernel" and same["repeat_errors"] == ["RuntimeError: no kernel"]
