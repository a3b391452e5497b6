"""Predicted vs measured savings (advisor/report/accuracy.py) and their console table."""

import io
import json

import pytest
from rich.console import Console

from advisor.report.accuracy import ALONE, LEAVE_ONE_OUT, Accuracy, accuracy
from advisor.report.console import render_accuracy

ANALYSIS = {"ceilings": {"graph_launch_us": 1.0, "copy_gbps": 3000.0}, "shapes": [{
    "seq_len": 512, "budget": {"ops": []},
    "candidates": [
        {"family": "add_rms_norm", "count": 2, "sites": ["l0.post", "l1.in"], "predicted_saving_ms": 0.9,
         "device_saving_ms": 0.08, "device_saving_warm_ms": 0.06, "site_savings_ms": [0.04, 0.04]},
        {"family": "add_rms_norm_linear", "count": 2, "sites": ["l0.post", "l1.in"], "predicted_saving_ms": 1.0,
         "device_saving_ms": 0.10, "site_savings_ms": [0.03, 0.07]},
        # no probe: priced by 4 launches at the graph launch cost + 3 MB at copy bandwidth
        {"family": "rope", "count": 2, "sites": ["f", "f"], "predicted_saving_ms": 0.5,
         "launches_removed": 4, "bytes_avoided": 3_000_000},
    ]}]}
BENCH = {
    "alone": [
        {"shape": 512, "family": "add_rms_norm", "cuda_graph": True, "sites": 2, "unfused_ms": 2.0,
         "unfused_ms_runs": [1.999, 2.001], "with_ms": 1.9, "measured_saving_ms": 0.1},
        {"shape": 512, "family": "rope", "cuda_graph": False, "sites": 2, "unfused_ms_runs": [3.0],
         "measured_saving_ms": 0.42},
        # alone, one of its two sites refused: priced at the site it applied (0.07 of 0.10)
        {"shape": 512, "family": "add_rms_norm_linear", "cuda_graph": True, "sites": 1,
         "applied_sites": ["l1.in"], "measured_saving_ms": 0.08},
        {"shape": 512, "family": "gated_act", "cuda_graph": True, "sites": 0, "measured_saving_ms": 0.001},
        {"shape": 128, "family": "rope", "cuda_graph": True, "measured_saving_ms": 0.1},  # not analysed
    ],
    "ablation": [
        {"shape": 512, "removed": "add_rms_norm_linear", "sites_in_plan": 1, "held_sites": ["l1.in"],
         "taken_over": {"add_rms_norm": 1}, "taken_sites": {"add_rms_norm": ["l1.in"]},
         "plan_ms_runs": [1.0, 1.002], "measured_saving_ms": 0.03},
        {"shape": 512, "removed": "rope", "sites_in_plan": 0, "same_graph": True, "measured_saving_ms": 0.0},
        {"shape": 512, "removed": "cuda_graph", "measured_saving_ms": 5.0},
    ]}


def test_each_measurement_meets_the_prediction_it_measures():
    rows = {(r.source, r.family): r for r in accuracy(ANALYSIS, BENCH)}
    # gated_act found no site alone (and has no candidate): not judged
    assert set(rows) == {(ALONE, "add_rms_norm"), (ALONE, "rope"), (ALONE, "add_rms_norm_linear"),
                         (LEAVE_ONE_OUT, "add_rms_norm_linear")}
    partial = rows[ALONE, "add_rms_norm_linear"]
    assert partial.predicted_ms == pytest.approx(0.07) and partial.warm_ms is None  # no warm timing
    alone = rows[ALONE, "add_rms_norm"]  # under CUDA graphs: the probes' device saving, and the warm one
    assert (alone.predicted_ms, alone.warm_ms, alone.measured_ms, alone.sites) == (0.08, 0.06, 0.1, 2)
    assert alone.noise_ms == pytest.approx(0.002) and alone.error == pytest.approx(-0.2) and alone.within()
    eager = rows[ALONE, "rope"]  # timed without graphs: the eager-priced prediction, no noise estimate
    assert eager.predicted_ms == 0.5 and eager.warm_ms is None and eager.noise_ms is None
    assert eager.error == pytest.approx(0.08 / 0.42) and eager.within()
    # the deep family's margin at its one held site (0.07) over add_rms_norm's there (0.04)
    margin = rows[LEAVE_ONE_OUT, "add_rms_norm_linear"]
    assert margin.predicted_ms == pytest.approx(0.03) and margin.within()
    # no graphs in the ablation: eager prices, split as the sites' savings are (0.07 of 0.10, 0.04 of 0.08)
    no_graphs = json.loads(json.dumps(BENCH))
    no_graphs["ablation"] = no_graphs["ablation"][:1]
    deep = next(r for r in accuracy(ANALYSIS, no_graphs) if r.source == LEAVE_ONE_OUT)
    assert deep.predicted_ms == pytest.approx(1.0 * 0.7 - 0.9 * 0.5)


def test_error_and_within_need_both_numbers():
    row = Accuracy(1, "rope", ALONE, None, None, 0.1, None, 8)
    assert row.error is None and row.within() is None
    assert Accuracy(1, "rope", ALONE, 0.1, None, 0.0, None, 8).error is None  # nothing measured
    assert not Accuracy(1, "rope", ALONE, -0.03, None, 0.01, None, 8).within()  # the wrong sign


def test_the_console_table_counts_the_families_within_the_tolerance():
    out = io.StringIO()
    render_accuracy(accuracy(ANALYSIS, BENCH), Console(file=out, width=200))
    text = out.getvalue()
    assert "512 tokens, alone: 3 of 3 families within ±25%" in text
    assert "512 tokens, leave-one-out: 1 of 1 families within ±25%" in text
    render_accuracy([], Console(file=out, width=200))  # nothing measured: nothing printed
    assert out.getvalue() == text


def _block(saving, penalty, reads):
    return {"saving_ms": saving, "unfused_penalty_ms": penalty, "by": ["gate_up_merge"], "reads": reads}


# Two MLPs: the gate/up merge turns gate and up into column blocks of one result; SwiGLU
# (gated_act) and SwiGLU in down_proj's prologue (gated_act_linear) read the same blocks.
MERGED = {"ceilings": {"graph_launch_us": 1.0, "copy_gbps": 3000.0}, "shapes": [{
    "seq_len": 512, "budget": {"ops": []},
    "candidates": [
        {"family": "gate_up_merge", "count": 2, "sites": ["l0.mlp", "l1.mlp"], "device_saving_ms": 0.2,
         "site_savings_ms": [0.1, 0.1], "site_sliced": [None, None]},
        {"family": "gated_act", "count": 2, "sites": ["l0.mlp", "l1.mlp"], "device_saving_ms": 0.08,
         "site_savings_ms": [0.04, 0.04],
         "site_sliced": [_block(0.12, 0.09, ["g0", "u0"]), _block(0.12, 0.09, ["g1", "u1"])]},
        {"family": "gated_act_linear", "count": 2, "sites": ["l0.down", "l1.down"], "device_saving_ms": 0.02,
         "site_savings_ms": [0.01, 0.01],
         "site_sliced": [_block(0.02, 0.085, ["g0", "u0"]), _block(0.02, 0.085, ["g1", "u1"])]},
    ]}]}


def _row(family, source):
    return next(r for r in accuracy(MERGED, MERGED_BENCH) if r.family == family and r.source == source)


MERGED_BENCH = {
    "alone": [{"shape": 512, "family": f, "cuda_graph": True, "sites": 2, "applied_sites": s,
               "measured_saving_ms": 0.1} for f, s in (("gate_up_merge", ["l0.mlp", "l1.mlp"]),
                                                       ("gated_act", ["l0.mlp", "l1.mlp"]))],
    "ablation": [
        {"shape": 512, "removed": f, "sites_in_plan": 2, "held_sites": ["l0.mlp", "l1.mlp"], "taken_over": {},
         "taken_sites": {}, "measured_saving_ms": 0.1} for f in ("gate_up_merge", "gated_act")
    ] + [{"shape": 512, "removed": "cuda_graph", "measured_saving_ms": 5.0}],
}


def test_merges_column_blocks_price_their_readers():
    # alone, the merge leaves its blocks to the unfused SwiGLUs: 0.2 − 2 × 0.09 (each block
    # input counted once: gated_act and gated_act_linear read the same gate and up)
    assert _row("gate_up_merge", ALONE).predicted_ms == pytest.approx(0.2 - 2 * 0.09)
    # SwiGLU alone reads contiguous gate/up: its own saving
    assert _row("gated_act", ALONE).predicted_ms == pytest.approx(0.08)
    # left out of a plan that merges gate/up: SwiGLU's saving on the blocks
    assert _row("gated_act", LEAVE_ONE_OUT).predicted_ms == pytest.approx(2 * 0.12)
    # the merge left out: its own saving, less what the blocks cost the fused SwiGLU
    # (its penalty on blocks: 0.09 unfused, 0.12 − 0.04 of it saved by fusing)
    assert _row("gate_up_merge", LEAVE_ONE_OUT).predicted_ms == pytest.approx(0.2 - 2 * (0.09 - 0.08))


def test_the_recipes_own_row_counts_in_a_leave_one_outs_noise():
    """The plan timed before and after the leave-one-outs may agree while another apply of
    it (the recipe's row) differs: the noise is the spread of all three."""
    bench = json.loads(json.dumps(BENCH))
    bench["ablation"][0]["recipe_ms"] = 1.05
    (row,) = [r for r in accuracy(ANALYSIS, bench) if r.source == LEAVE_ONE_OUT]
    assert row.noise_ms == pytest.approx(0.05)
    missed = Accuracy(512, "rope", LEAVE_ONE_OUT, 0.10, None, 0.06, 0.05, 8)
    assert not missed.within() and missed.within_noise()
    assert Accuracy(512, "rope", LEAVE_ONE_OUT, 0.10, None, 0.06, None, 8).within_noise() is None
    out = io.StringIO()
    render_accuracy([missed], Console(file=out, width=200))
    assert "0 of 1 families within ±25%; 1 more miss by less than the measurement's noise" in out.getvalue()


def test_a_merge_that_holds_no_site_merges_nothing_and_an_old_alone_row_pays_the_penalty():
    from advisor.report.accuracy import alone_prediction, plan_families
    cands = {c["family"]: c for c in MERGED["shapes"][0]["candidates"]}
    ablated = {"gate_up_merge": {"same_graph": True, "sites_in_plan": 0}, "gated_act": {"sites_in_plan": 2},
               "cuda_graph": {}}
    assert plan_families(ablated, cands) == {"gated_act"}
    bench = json.loads(json.dumps(MERGED_BENCH))
    bench["ablation"][0] = {"shape": 512, "removed": "gate_up_merge", "sites_in_plan": 0, "same_graph": True,
                            "measured_saving_ms": 0.0}
    gated = next(r for r in accuracy(MERGED, bench) if r.family == "gated_act" and r.source == LEAVE_ONE_OUT)
    assert gated.predicted_ms == pytest.approx(0.08)  # no merge ran: contiguous gate/up
    merge = cands["gate_up_merge"]
    graphs = {"graph_launch_us": 1.0, "copy_gbps": 3000.0}
    old = {"shape": 512, "family": "gate_up_merge", "cuda_graph": True}  # no applied_sites (before session 20)
    assert alone_prediction(old, merge, graphs, None, cands=cands) == pytest.approx(0.2 - 0.18)
    half = {**old, "applied_sites": ["l0.mlp"]}  # one of two sites applied: half the readers pay
    assert alone_prediction(half, merge, graphs, None, cands=cands) == pytest.approx(0.1 - 0.09)


def test_a_plan_with_pdl_prices_its_families_launched_with_it():
    """The plan's `pdl` row says it launched our kernels with PDL: each family's margin is
    then its PDL-variant saving where the analysis has one (session 21: the one-token GEMV
    families' margins measured twice their saving without PDL); alone rows run without it."""
    analysis = json.loads(json.dumps(ANALYSIS))
    deep, norm = analysis["shapes"][0]["candidates"][1], analysis["shapes"][0]["candidates"][0]
    deep["device_saving_pdl_ms"] = 0.16     # sites 0.03 / 0.07 scaled by 1.6
    norm["device_saving_pdl_ms"] = 0.12     # sites 0.04 scaled by 1.5
    bench = json.loads(json.dumps(BENCH))
    rows = {(r.source, r.family): r for r in accuracy(analysis, bench)}
    assert rows[LEAVE_ONE_OUT, "add_rms_norm_linear"].predicted_ms == pytest.approx(0.03)  # no pdl row
    bench["ablation"].append({"shape": 512, "removed": "pdl", "measured_saving_ms": 0.05})
    rows = {(r.source, r.family): r for r in accuracy(analysis, bench)}
    deep_out = rows[LEAVE_ONE_OUT, "add_rms_norm_linear"]
    assert deep_out.predicted_ms == pytest.approx(0.07 * 1.6 - 0.04 * 1.5)
    assert deep_out.warm_ms is None  # the deep family has no warm figure; none is made of PDL ones
    assert rows[ALONE, "add_rms_norm"].predicted_ms == pytest.approx(0.08)  # alone: without PDL
    assert rows[ALONE, "add_rms_norm_linear"].predicted_ms == pytest.approx(0.07)
    assert (LEAVE_ONE_OUT, "pdl") not in rows  # a plan flag, not a family
