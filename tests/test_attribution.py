"""Per-family measured savings from tuning trials (advisor/report/attribution.py) and their
cells in the HTML candidates table (advisor/report/html_candidates.py). CPU only, no browser."""

import random
import re
import xml.etree.ElementTree as ET

import pytest

from advisor.report.attribution import LSTSQ, PAIRED, Trial, attribute, trials_from_history
from advisor.report.html import render_html
from advisor.report.html_candidates import candidates_table, tuned_bucket

EVIL = '<script>alert("x")</script>'


def _random_trials(n=12, seed=0, noise=0.02, unpaired=False, graph=False):
    """base 10 ms, s_a = 2, s_b = 0.5 (c always on: 0.3), cuda_graph 1.0 when it varies.
    `unpaired`: every trial has its own configs and a distinct value of another parameter, so
    no two trials differ in one family alone: only the least-squares estimate is available."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        a, b, g = rng.random() < 0.5, rng.random() < 0.5, graph and rng.random() < 0.5
        p = {"a": a, "b": b, "c": True}
        if unpaired:
            p.update({"a.config": f"A{i}"} if a else {}, **({"b.config": f"B{i}"} if b else {}), other=f"o{i}")
        if graph:
            p["cuda_graph"] = g
        out.append(Trial(p, 10 - 2 * a - 0.5 * b - 0.3 - 1.0 * g + rng.gauss(0, noise)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_least_squares_recovers_known_savings(seed):
    att = attribute(_random_trials(seed=seed, unpaired=True))
    a, b = att.get("a"), att.get("b")
    assert a.method == b.method == LSTSQ and a.pairs == b.pairs == 0
    assert a.saving_ms == pytest.approx(2.0, abs=0.06) and b.saving_ms == pytest.approx(0.5, abs=0.06)
    assert a.trials_on + a.trials_off == 12 and a.stderr_ms < 0.05
    assert att.dof == 12 - 3 and att.residual_ms == pytest.approx(0.02, abs=0.02)
    assert att.base_ms == pytest.approx(9.7, abs=0.06)  # c always on: inside the base
    assert att.cuda_graph_ms is None


def test_random_trials_with_pairs_use_the_paired_estimate():
    att = attribute(_random_trials(seed=5))
    for fam, true in (("a", 2.0), ("b", 0.5)):
        f = att.get(fam)
        assert f.method == PAIRED and f.pairs > 0 and f.saving_ms == f.paired_ms == pytest.approx(true, abs=0.06)
        assert f.lstsq_ms == pytest.approx(true, abs=0.06)


def test_cuda_graph_term_is_fitted_when_it_varies():
    att = attribute(_random_trials(n=16, seed=3, unpaired=True, graph=True))
    assert att.cuda_graph_ms == pytest.approx(1.0, abs=0.08)
    assert att.get("a").saving_ms == pytest.approx(2.0, abs=0.08)
    assert att.get("b").saving_ms == pytest.approx(0.5, abs=0.08)


def test_family_always_on_or_off_or_untuned_has_no_estimate():
    trials = [Trial({**t.params, "d": False}, t.value) for t in _random_trials()]
    att = attribute(trials, families=["a", "c", "d", "nope"])
    assert [f.family for f in att.families] == ["a", "c", "d", "nope"]
    c, d, nope = att.get("c"), att.get("d"), att.get("nope")
    assert c.saving_ms is None and c.method is None and c.reason == "always on in the 12 trials"
    assert (c.trials_on, c.trials_off) == (12, 0)
    assert d.saving_ms is None and d.reason == "always off in the 12 trials"
    assert nope.saving_ms is None and nope.reason == "not a tuning parameter at this length"
    assert att.get("a").saving_ms == pytest.approx(2.0, abs=0.06)  # "b" is still fitted, not reported
    empty = attribute([], families=["a"])
    assert empty.trials == 0 and empty.get("a").reason == "no completed trials" and empty.base_ms is None


def test_collinear_families_have_no_estimate():
    rng = random.Random(4)
    trials = []
    for _ in range(12):
        a, b = rng.random() < 0.5, rng.random() < 0.5
        # x always toggled with a; y always opposite to b; only a + x and b - y are measured
        trials.append(Trial({"a": a, "x": a, "b": b, "y": not b}, 10 - 2 * a - 0.5 * b + rng.gauss(0, 0.01)))
    att = attribute(trials)
    for fam, twin in (("a", "x"), ("x", "a"), ("b", "y"), ("y", "b")):
        f = att.get(fam)
        assert f.saving_ms is None and f.lstsq_ms is None and f.method is None
        assert f.reason.startswith(f"collinear with {twin}"), f.reason
    # a three-way dependency: z = a + b (a and b never both on), no column equals another
    tri = [Trial({"a": bool(a), "b": bool(b), "z": a != b}, 10 - a - b)
           for a, b in ((0, 1), (1, 0), (0, 0), (0, 1), (1, 0))]
    assert len(attribute(tri).families) == 3
    for f in attribute(tri).families:
        assert f.reason == "collinear with a combination of other parameters"


def test_paired_difference_is_preferred_and_configs_of_others_break_pairs():
    # a's effect depends on b (an interaction the additive fit averages away)
    trials = [Trial({"a": False, "b": False}, 10.0), Trial({"a": True, "a.config": "k1", "b": False}, 8.0),
              Trial({"a": False, "b": True, "b.config": "x"}, 9.5),
              Trial({"a": True, "a.config": "k2", "b": True, "b.config": "x"}, 7.0),
              Trial({"a": True, "b": True, "b.config": "other"}, 6.0)]  # pairs with nothing on a
    att = attribute(trials)
    a = att.get("a")
    assert a.method == PAIRED and a.pairs == 2 and a.paired_ms == a.saving_ms == pytest.approx(2.25)
    assert a.lstsq_ms is not None and a.lstsq_ms != pytest.approx(a.paired_ms)
    b = att.get("b")  # (F,F) vs (F,T): a pair; (T k1,F) vs (T k2,T): a.config differs, not a pair
    assert b.method == PAIRED and b.pairs == 1 and b.saving_ms == pytest.approx(0.5)


def test_history_rows_become_trials_of_one_bucket():
    rows = [{"bucket": 128, "number": 0, "state": "COMPLETE", "value": 9.0, "params": {"a": False}},
            {"bucket": 128, "number": 1, "state": "COMPLETE", "value": 7.0, "params": {"a": True}, "applied": 8},
            {"bucket": 128, "number": 2, "state": "COMPLETE", "value": 7.0, "params": {"a": True},
             "repeat_of": 1},
            {"bucket": 128, "number": 3, "state": "COMPLETE", "value": 9.4, "params": {"a": True}, "applied": 0},
            {"bucket": 128, "number": 4, "state": "FAIL", "value": None, "params": {"a": True}},
            {"bucket": 128, "number": 5, "state": "COMPLETE", "value": 8.0},  # no params (TrialEvent)
            {"bucket": 128, "number": 6, "state": "COMPLETE", "value": float("inf"), "params": {"a": True}},
            {"bucket": 512, "number": 0, "state": "COMPLETE", "value": 20.0, "params": {"a": True}}]
    trials = trials_from_history(rows, 128)
    assert [t.value for t in trials] == [9.0, 7.0]
    assert attribute(trials).get("a").saving_ms == pytest.approx(2.0)
    assert tuned_bucket(rows, 128) == 128 and tuned_bucket(rows, 100) == 128 and tuned_bucket(rows, 300) == 512
    assert tuned_bucket(rows, 600) is None and tuned_bucket(None, 1) is None


def test_load_history_carries_params(tmp_path):
    import optuna
    from optuna.distributions import CategoricalDistribution
    from optuna.trial import TrialState, create_trial

    from advisor.report.history import load_history

    path = str(tmp_path / "t.journal")
    from advisor.search.study import TuneOptions, open_storage
    store, _ = open_storage(TuneOptions(model="", shapes=(1,), out=tmp_path / "r", dtype=None, storage=path))
    study = optuna.create_study(study_name="m-len128", storage=store)
    dist = {"a": CategoricalDistribution([True, False])}
    study.add_trial(create_trial(params={"a": True}, distributions=dist, value=7.0,
                                 user_attrs={"applied": 4}))
    study.add_trial(create_trial(params={"a": True}, distributions=dist, value=7.0,
                                 user_attrs={"repeat_of": 0, "applied": 4}))
    study.add_trial(create_trial(params={"a": False}, distributions=dist, state=TrialState.FAIL,
                                 user_attrs={"failure": "timeout"}))
    rows = load_history(path)
    assert [(r["params"], r["repeat_of"], r["applied"]) for r in rows] == [
        ({"a": True}, None, 4), ({"a": True}, 0, 4), ({"a": False}, None, None)]


# ---- HTML ---------------------------------------------------------------------------------

def _shape(length, fam_a="a"):
    cands = [{"family": fam_a, "kernel": "k_a", "sites": ["m.0"], "count": 1, "launches_removed": 2,
              "bytes_avoided": 100, "predicted_saving_ms": 1.6, "applicable": True},
             {"family": "b", "kernel": "k_b", "sites": ["m.1"], "count": 1, "predicted_saving_ms": 0.5},
             {"family": "c", "kernel": "k_c", "count": 1, "predicted_saving_ms": 0.2},
             {"family": "only_analysis", "kernel": None, "count": 1, "predicted_saving_ms": 0.1}]
    return {"seq_len": length, "candidates": cands}


def _rows(bucket, trials):
    return [{"bucket": bucket, "number": i, "state": "COMPLETE", "value": t.value, "params": dict(t.params)}
            for i, t in enumerate(trials)]


def _cells(table, family):
    row = re.search(rf"<tr><td class=\"n\">\d+</td><td>{re.escape(family)}</td>(.*?)</tr>", table).group(1)
    return re.findall(r"<td[^>]*>(.*?)</td>", row)[-2:]


def test_table_shows_measured_saving_error_and_tooltips():
    trials = _random_trials(seed=0, unpaired=True)
    table = candidates_table(_shape(128), None, None, _rows(128, trials))
    measured, error = _cells(table, "a")
    got = attribute(trials).get("a").saving_ms
    assert f"{got:.3f} ms</span>" in measured and "least squares" in measured
    assert "on in " in measured and "trials of bucket ≤ 128 tokens" in measured
    assert error == f"{got - 1.6:+.3f} ms ({100 * (got - 1.6) / 1.6:+.0f}%)"
    measured, error = _cells(table, "c")
    assert measured == '<span title="no estimate: always on in the 12 trials; on in 12, off in 0 trials of ' \
                       'bucket ≤ 128 tokens">—</span>' and error == "—"
    assert "not a tuning parameter" in _cells(table, "only_analysis")[0]
    assert "Measured per family from 12 completed trials of bucket ≤ 128 tokens" in table
    ET.fromstring(table[table.index("<table>"):])  # well-formed: every tooltip quote escaped
    # a shorter analysis length inside the bucket: estimated from the bucket, and said so
    inside = candidates_table(_shape(100), None, None, _rows(128, trials))
    assert "trials timed at 128, not 100" in _cells(inside, "a")[0]
    # beyond every tuned bucket, or no params in the history: plain dashes
    for hist in (_rows(64, trials), [{k: v for k, v in r.items() if k != "params"} for r in _rows(128, trials)]):
        assert _cells(candidates_table(_shape(128), None, None, hist), "a") == ["—", "—"]


def test_paired_tooltip_and_escaped_family_names():
    trials = [Trial({EVIL: False, "b": False}, 10.0), Trial({EVIL: True, "b": False}, 8.0),
              Trial({EVIL: False, "b": True}, 9.5)]
    shape = _shape(64, fam_a=EVIL)
    recipe = {"kind": "advisor.recipe", "buckets": [
        {"max_len": 64, "plan": {"fusions": [EVIL, "b"]}, "measured": {"unfused_ms": 10.0, "tuned_ms": 7.6}}]}
    analysis = {"model": "m", "shapes": [shape]}
    page = render_html(analyses=[analysis], recipe=recipe, history=_rows(64, trials), title="t")
    assert "<script" not in page
    esc = "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;"
    table = page[page.index("<h3>Fusion candidates at 64 tokens</h3>"):]
    table = table[:table.index("</table>") + 8]
    measured, error = _cells(table, esc)
    assert f"paired: median over 1 pairs of trials differing only in {esc}" in measured
    assert "2.000 ms</span>" in measured and error == "+0.400 ms (+25%)"
    assert _cells(table, "b")[1] == "+0.000 ms (+0%)" and "paired" in _cells(table, "b")[0]
    assert "plan total (recipe: unfused − tuned)" in table and "2.400 ms" in table  # the plan row stays
    assert "exact fit, no residual check" in measured and "no residual degrees of freedom" in table
    assert "A family's measured saving comes from the tuning trials" in page
    ET.fromstring(table[table.index("<table>"):])
