"""Merges priced by their GEMMs timed on the analysis device (advisor/profile/merge_probe.py)."""

import pytest
import torch

from advisor.graph.candidates import Costs, candidates, matches_of
from advisor.graph.capture import capture
from advisor.loader import build, inputs_for, load_model_file
from advisor.profile.merge_probe import MergeShape, MergeTiming, merge_shape, probe_merges, time_merge
from advisor.report.accuracy import graph_priced
from tests.hf_models import ids, tiny_hf

COSTS = Costs(launch_us=8.0, copy_gbps=4000.0)


def _matches(model, inputs):
    return matches_of(capture(model, inputs))


def test_merge_shapes_are_read_from_the_graph():
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    matches = _matches(model, inputs_for(mf, 7, 2, torch.device("cpu")))
    shapes = {m.family: merge_shape(m) for m in matches if merge_shape(m) is not None}
    assert set(shapes) == {"qkv_merge", "gate_up_merge"}
    qkv, gate_up = shapes["qkv_merge"], shapes["gate_up_merge"]
    assert qkv.m == gate_up.m == 2 * 7 and qkv.dtype == torch.float32 and not qkv.bias
    assert len(qkv.ns) == 3 and len(gate_up.ns) == 2 and gate_up.ns[0] == gate_up.ns[1]
    assert qkv.k == gate_up.k
    # Every other family has no probe shape; layers share theirs (probed once).
    assert all(merge_shape(m) is None for m in matches if m.kernel != "merged_linear")
    assert len(probe_merges(matches, "cpu")) == 2


def test_biased_merges_carry_the_bias():
    matches = _matches(tiny_hf("Qwen2"), ids(5, batch=1))
    qkv = [merge_shape(m) for m in matches if m.family == "qkv_merge"]
    assert qkv and all(s is not None and s.bias for s in qkv)
    timing = time_merge(qkv[0], "cpu")
    assert timing.separate_ms > 0 and timing.merged_ms > 0


def test_measured_merges_price_the_candidate():
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    matches = _matches(model, inputs_for(mf, 8, 1, torch.device("cpu")))
    fixed = {"qkv_merge": 0.5, "gate_up_merge": -0.25}  # ms per site, as a probe would return

    def measured(m):
        return fixed.get(m.family) if merge_shape(m) is not None else None

    plain = {c.family: c for c in candidates(matches, COSTS)}
    timed = {c.family: c for c in candidates(matches, COSTS, measured)}
    qkv, gate_up = timed["qkv_merge"], timed["gate_up_merge"]
    assert qkv.device_saving_ms == pytest.approx(0.5 * qkv.count)
    assert qkv.predicted_saving_ms == pytest.approx(max(plain["qkv_merge"].predicted_saving_ms, 0.5 * qkv.count))
    # A merge measured slower on the device is priced as the loss it is (session 13: the
    # max with the launch price hid a -1.5 ms family at 512 tokens behind +1.28 ms).
    assert gate_up.device_saving_ms == pytest.approx(-0.25 * gate_up.count)
    assert gate_up.predicted_saving_ms == pytest.approx(gate_up.device_saving_ms)
    assert timed["add_rms_norm"].device_saving_ms is None
    assert timed["add_rms_norm"].predicted_saving_ms == plain["add_rms_norm"].predicted_saving_ms
    ceilings = {"graph_launch_us": 1.0, "copy_gbps": 4000.0}
    assert graph_priced({"device_saving_ms": qkv.device_saving_ms, "launches_removed": 4,
                         "bytes_avoided": 0}, ceilings, 1.6) == pytest.approx(qkv.device_saving_ms)
    assert graph_priced({"launches_removed": 4, "bytes_avoided": 0}, ceilings, 1.5) == pytest.approx(6e-3)


def test_timing_is_per_site():
    s = MergeShape(m=3, k=64, ns=(48, 16, 16), bias=False, dtype=torch.float32)
    t = time_merge(s, "cpu")
    assert isinstance(t, MergeTiming) and t.saving_ms == pytest.approx(t.separate_ms - t.merged_ms)
    assert 0 < t.merged_ms < 100 and 0 < t.separate_ms < 100


def test_analyze_reports_device_savings_on_the_cpu():
    from advisor.analyze import find_candidates
    from advisor.profile.ceilings import Ceilings

    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    ceil = Ceilings(device_name="cpu", device_type="cpu", copy_gbps=4000.0, matmul_tflops={"float32": 1.0},
                    launch_us=8.0, graph_launch_us=None, env={}, measured_at="", method="test")
    cands = {c.family: c for c in find_candidates(model, inputs_for(mf, 8, 1, torch.device("cpu")), ceil,
                                                  torch.device("cpu"))}
    assert cands["qkv_merge"].device_saving_ms is not None
    assert cands["gate_up_merge"].device_saving_ms is not None
    assert cands["rms_norm"].device_saving_ms is None
