"""Sites timed fused vs captured on the analysis device (advisor/runtime/site_probe.py).

The CPU cannot time the fused side (Triton's interpreter), so these tests check the
machinery — which sites are probed, the extracted graphs run on the probe's inputs, the
weights laid out as apply lays them, the timings flow into the candidates — and leave
the numbers to the H200 (benchmarks/next_gpu_session.sh, stage tune: analyze)."""

import contextlib
import os

import pytest
import torch
from torch import fx

os.environ.setdefault("TRITON_INTERPRET", "1")

from advisor.graph.candidates import Costs, candidates, matches_of  # noqa: E402
from advisor.graph.capture import capture  # noqa: E402
from advisor.graph.cse import storage_bases  # noqa: E402
from advisor.kernels.merged_linear import adjacent_view  # noqa: E402
from advisor.loader import build, inputs_for, load_model_file  # noqa: E402
from advisor.runtime import site_probe  # noqa: E402
from advisor.runtime.rewrite import extract  # noqa: E402

COSTS = Costs(launch_us=8.0, copy_gbps=4000.0)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def matches(example_matches):
    return example_matches("examples/tiny_llama.py")


def test_off_cuda_nothing_is_timed_and_the_reason_is_kept(matches):
    probe = site_probe.probe_sites(matches, CPU)
    assert probe.timings == {} and probe.skipped
    assert all("CUDA" in why for why in probe.skipped.values())
    assert all(probe.saving_ms(m) is None and "CUDA" in probe.reason(m) for m in matches)


def test_only_merges_are_left_to_their_own_probe(matches):
    cuda = torch.device("cuda")
    for m in matches:
        why = site_probe.skip_reason(m, cuda)
        if m.kernel == "merged_linear":
            assert "merge_probe" in why
        elif m.kernel is not None:
            assert why is None


def test_shared_nodes_are_computed_on_both_sides():
    """transformers' decode step: every layer's attention reads one causal mask built from
    the cache position (Match.shared). Both spellings output the shared nodes, so the
    site's saving does not count the mask once per layer."""
    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, CPU, torch.float32)
    found = matches_of(capture(model, inputs_for(mf, 12, 1, CPU, phase="decode", dtype=torch.float32)))
    shared = [m for m in found if m.shared and m.kernel is not None]
    assert shared, "the static cache's mask is shared by the attention sites"
    m = shared[0]
    ref, _, _ = extract(m, keep=m.shared)
    plain, _, _ = extract(m)
    n_out = lambda gm: len(next(n for n in gm.graph.nodes if n.op == "output").args[0])  # noqa: E731
    assert n_out(ref) == n_out(plain) + len([n for n in m.shared if n not in m.outputs.values()])
    t = site_probe.time_site(m, CPU)
    assert t.unfused_ms > 0 and t.fused_ms > 0
    # the warm probe leaves the static cache cold, read through a view or an in-place write
    site = next(m for m in found if m.family.startswith("attention") and m.kernel is not None)
    _, inputs, _ = extract(site)
    (args,) = site_probe._arg_sets(site, inputs, 1, seed=0)
    warm = {inputs[i] for i in site_probe.activations(inputs, args, storage_bases(inputs[0].graph))}
    big = [n for n in inputs if n.meta.get("val") is not None and n.meta["val"].dim() == 4
           and n.meta["val"].shape[2] >= 12]  # (b, kv heads, cache slots, d): the cache
    assert big and not warm & set(big)


def test_an_attention_site_reads_the_real_causal_mask_as_the_runtime_does():
    """transformers' prefill mask is computed from sizes alone: the runtime keeps it and
    reads it as `causal=True` (SDPA's flash kernel, our causal path). The probe gives the
    site that very mask, marked, and its captured SDPA the same reading; a random mask
    would time both masked kernels instead (session 14: attention priced as a loss)."""
    from advisor.graph.shape_only import shape_only_value
    from advisor.kernels.masks import is_causal_mask
    from advisor.runtime.causal_sdpa import CausalWhenMarked

    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, CPU, torch.float32)
    found = matches_of(capture(model, inputs_for(mf, 8, 1, CPU)))
    sites = [m for m in found if m.family == "attention"]
    m = sites[0]
    facts = site_probe.GraphFacts()
    region = facts.region(m.nodes[0].graph)
    ref, _, inputs, kept = site_probe.spellings(m, region)
    assert len(kept) == 1
    mask = shape_only_value(inputs[kept[0]], region)
    assert mask.shape[-2:] == (8, 8) and is_causal_mask(mask) and getattr(mask, "_advisor_causal_mask", False)
    assert any(isinstance(n.target, CausalWhenMarked) for n in ref.graph.nodes)
    t = site_probe.time_site(m, CPU, facts=facts)
    assert t.unfused_ms > 0 and t.fused_ms > 0
    # every layer builds its own copy of one mask: one probe for all of them
    keys = {site_probe.probe_key(s, facts) for s in sites}
    assert len(sites) == 2 and len(keys) == 1
    # a mask the runtime would not keep (past a memo's byte budget) is not marked: masked on both sides
    import advisor.graph.shape_only as shape_only
    try:
        shape_only.MEMO_BYTES, budget = 16, shape_only.MEMO_BYTES
        assert not getattr(shape_only_value(inputs[kept[0]], region), "_advisor_causal_mask", False)
    finally:
        shape_only.MEMO_BYTES = budget


def test_time_site_runs_both_spellings_on_the_probe_inputs(matches):
    """Each probed family's captured and fused graphs run on the random inputs (here on
    the CPU, through the interpreter: times are not meaningful, only present)."""
    seen = set()
    for m in matches:
        if m.family in seen or site_probe.skip_reason(m, torch.device("cuda")) is not None:
            continue
        seen.add(m.family)
        t = site_probe.time_site(m, CPU)
        assert t.unfused_ms > 0 and t.fused_ms > 0
        assert t.saving_ms == pytest.approx(t.unfused_ms - t.fused_ms)
    assert {"rms_norm", "add_rms_norm"} & seen and len(seen) >= 3


def test_the_warm_probe_reads_what_the_forward_computed_and_leaves_graph_inputs_cold(matches):
    m = next(m for m in matches if len(m.operands.get("weights", [])) > 1
             and m.kernel != "merged_linear")  # norm -> q/k/v: x (+ residual), norm weight, 3 weights
    _, inputs, _ = extract(m)
    (args,) = site_probe._arg_sets(m, inputs, 1, seed=0)
    warm = [inputs[i] for i in site_probe.activations(inputs, args, storage_bases(inputs[0].graph))]
    assert warm and all(n.op != "placeholder" for n in warm)
    assert not any(w in warm for w in m.operands["weights"])  # parameters: graph inputs
    # a broadcast view is read once, over the memory it spans
    wide = torch.arange(4.0).expand(3, 4)
    assert site_probe._span(wide).shape == (4,) and site_probe._span(torch.ones(2, 3)).shape == (6,)


def test_warm_timings_subtract_the_touch_and_a_failing_one_keeps_the_cold(matches, monkeypatch):
    """On CUDA each site is also timed with its activations read first; the reads' own
    time (timed with them, in turn) is taken off. spellings_ms is stubbed per call."""
    m = next(m for m in matches if m.family == "add_rms_norm")
    calls = []

    def fake_ms(runs, device):
        calls.append(runs)
        return {1: [10.0, 4.0], 2: [3.0, 12.0, 5.5]}[len(calls)]  # (unfused, fused), (touch, +touch)
    monkeypatch.setattr(site_probe, "spellings_ms", fake_ms)
    monkeypatch.setattr(site_probe, "copies_past_l2", lambda b, d: 2)
    cuda = torch.device("cuda")
    monkeypatch.setattr(site_probe, "_arg_sets", lambda m, inputs, n, seed, kept: [[
        torch.ones(1) if i == 0 else torch.zeros(1) for i in range(len(inputs))] for _ in range(n)])
    monkeypatch.setattr(site_probe, "activations", lambda inputs, args, bases: [0])
    t = site_probe.time_site(m, cuda)
    assert (t.unfused_ms, t.fused_ms) == (5.0, 2.0)
    assert (t.warm_unfused_ms, t.warm_fused_ms) == (4.5, 1.25) and t.warm_saving_ms == 3.25

    def broken(runs, device):
        calls.append(runs)
        if len(calls) > 1:
            raise RuntimeError("sum of float8 not implemented")
        return [1.0] * len(runs)
    calls.clear()
    monkeypatch.setattr(site_probe, "spellings_ms", broken)
    t = site_probe.time_site(m, cuda)
    assert t.saving_ms == 0.0 and t.warm_saving_ms is None


def test_weight_lists_are_adjacent_as_apply_lays_them(matches):
    norm_linear = [m for m in matches if len(m.operands.get("weights", [])) > 1
                   and m.kernel != "merged_linear"]
    assert norm_linear, "tiny_llama has norm -> q/k/v sites"
    m = norm_linear[0]
    _, inputs, _ = extract(m)
    (args,) = site_probe._arg_sets(m, inputs, 1, seed=0)
    ws = [args[inputs.index(w)] for w in m.operands["weights"]]
    assert adjacent_view(ws) is not None
    two = site_probe._arg_sets(m, inputs, 2, seed=0)
    assert not torch.equal(two[0][0], two[1][0])  # copies are distinct (no L2 reuse)


def test_probe_timings_price_the_candidates(matches):
    """A probe's timings become device_saving_ms; a family with an untimed site keeps
    the launch + bytes price and says why."""
    fixed = {"rms_norm": 0.004, "add_rms_norm": 0.002}

    def measured(m):
        return fixed.get(m.family)

    def unmeasured(m):
        return "skipped in this test"
    cands = {c.family: c for c in candidates(matches, COSTS, measured, unmeasured)}
    for fam, per_site in fixed.items():
        if fam in cands:
            assert cands[fam].device_saving_ms == pytest.approx(per_site * cands[fam].count)
            assert cands[fam].probe_note == ""
        assert cands[fam].site_savings_ms == (per_site,) * cands[fam].count
        assert cands[fam].device_saving_warm_ms is None  # no warm timings given
    warmed = {c.family: c for c in candidates(matches, COSTS, measured, unmeasured,
                                              lambda m: 0.001 if m.family == "rms_norm" else None)}
    assert warmed["rms_norm"].device_saving_warm_ms == pytest.approx(0.001 * warmed["rms_norm"].count)
    assert warmed["add_rms_norm"].device_saving_warm_ms is None  # no site of it was warm-timed
    first = next(m for m in matches if m.family == "add_rms_norm")  # one site warm: the rest count cold
    mixed = {c.family: c for c in candidates(matches, COSTS, measured, unmeasured,
                                             lambda m: 0.0 if m is first else None)}
    n = mixed["add_rms_norm"].count
    assert mixed["add_rms_norm"].device_saving_warm_ms == pytest.approx(0.002 * (n - 1))
    others = [c for f, c in cands.items() if f not in fixed]
    assert others and all(c.device_saving_ms is None and c.probe_note == "skipped in this test"
                          for c in others)


def test_a_recipes_configs_are_probed_and_keyed(matches, monkeypatch):
    """analyze --recipe: a family's sites run its kernel in the recipe's config (the tuned
    plan's saving), and the probe's answers are keyed by that config."""
    m = next(m for m in matches if m.family == "add_rms_norm")
    config = "BLOCK_N=128,ROWS_PER_PROG=2,STATS=1,ROW_TILE=1,num_warps=2"
    _, fused_gm, _, _ = site_probe.spellings(m, {}, config)
    assert [n for n in fused_gm.graph.nodes if config in n.args], "the fused op runs the config"
    probed = []

    def timed(m, device, seed=0, facts=None, config=""):
        probed.append((m.family, config))
        return site_probe.SiteTiming(2.0, 1.0)
    monkeypatch.setattr(site_probe, "time_site", timed)
    monkeypatch.setattr(site_probe, "skip_reason", lambda m, device: None)
    probe = site_probe.probe_sites(matches, CPU, {"add_rms_norm": config})
    assert ("add_rms_norm", config) in probed and ("rms_norm", "") in probed
    assert probe.saving_ms(m) == 1.0 and probe.reason(m) == ""
    assert site_probe.SiteProbe(probe.timings, {}, probe.facts).saving_ms(m) is None  # keyed by config


def test_a_failing_site_is_skipped_with_its_error(matches, monkeypatch):
    def boom(m, device, seed=0, facts=None, config=""):
        raise RuntimeError("kernel failed to compile\nsecond line")
    monkeypatch.setattr(site_probe, "time_site", boom)
    monkeypatch.setattr(site_probe, "skip_reason", lambda m, device: None)
    probe = site_probe.probe_sites(matches, CPU)
    assert probe.timings == {}
    assert all(why == "RuntimeError: kernel failed to compile" for why in probe.skipped.values())


def test_analyze_probe_switch():
    """`advisor analyze --no-probe` prices by launches and bytes only; with the probe on the
    CPU, merges are timed and the other families say why they were not."""
    from advisor.analyze import analyze, to_json
    from advisor.profile.ceilings import Ceilings

    mf = load_model_file("examples/tiny_llama.py")
    ceil = Ceilings(device_name="cpu", device_type="cpu", copy_gbps=4000.0, matmul_tflops={"float32": 1.0},
                    launch_us=8.0, graph_launch_us=None, env={}, measured_at="", method="test")
    off = analyze(mf, (5,), 1, CPU, torch.float32, ceil, iters=1, probe=False)
    assert all(c.device_saving_ms is None and c.probe_note == "" for c in off.shapes[0].candidates)
    on = to_json(analyze(mf, (5,), 1, CPU, torch.float32, ceil, iters=1))
    cands = {c["family"]: c for c in on["shapes"][0]["candidates"]}
    assert cands["qkv_merge"]["device_saving_ms"] is not None
    assert len(cands["qkv_merge"]["site_savings_ms"]) == cands["qkv_merge"]["count"]
    assert cands["rms_norm"]["device_saving_ms"] is None and "CUDA" in cands["rms_norm"]["probe_note"]
    assert on["shapes"][0]["probe_configs"] == {}
    from advisor.runtime.plan import Plan
    from advisor.runtime.recipe import Bucket, Recipe

    tuned = Recipe.from_plan(Plan(("add_rms_norm",), {"add_rms_norm": "BLOCK_N=128,ROWS_PER_PROG=2,STATS=1,ROW_TILE=1,num_warps=2"}))
    probed = analyze(mf, (5,), 1, CPU, torch.float32, ceil, iters=1, recipe=tuned)
    assert probed.shapes[0].probe_configs == {"add_rms_norm": "BLOCK_N=128,ROWS_PER_PROG=2,STATS=1,ROW_TILE=1,num_warps=2"}
    short = Recipe(buckets=(Bucket(3, tuned.buckets[0].plan),), beyond_largest="unfused")
    unfused_here = to_json(analyze(mf, (5,), 1, CPU, torch.float32, ceil, iters=1, recipe=short))
    assert unfused_here["shapes"][0]["probe_configs"] is None  # the recipe runs unfused at 5


def test_masks_built_alike_share_a_key_and_a_window_does_not():
    """probe_key tells a sliding-window layer's mask from a causal layer's of one shape."""
    from advisor.graph.shape_only import shape_only_key

    aten = torch.ops.aten
    g = fx.Graph()

    def node(op, *args, **kwargs):
        n = g.call_function(op, args, kwargs)
        n.meta["val"] = torch.zeros(8, 8, dtype=torch.bool)
        return n
    pos = [node(aten.arange.default, 8) for _ in range(3)]
    causal = [node(aten.le.Tensor, p, p) for p in pos[:2]]
    window = node(aten.gt.Scalar, node(aten.sub.Tensor, pos[2], pos[2]), -4)
    g.output((*causal, window))
    region, memo = {n: None for n in g.nodes if n.op == "call_function"}, {}
    keys = [shape_only_key(n, region, memo) for n in (*causal, window)]
    assert keys[0] == keys[1] != keys[2]


def test_the_fused_attention_site_runs_without_the_captured_sdpa(example_matches):
    """The captured SDPA is a random op (it takes a dropout): fx's dead-code elimination
    keeps it outside a dynamo tracing context, which is where the probe runs. Ours drops
    it there as in the runtime (graph/dce.py), with repeat_kv's copies."""
    m = next(m for m in example_matches("examples/llama_hf.py", 1) if m.family == "attention")
    facts = site_probe.GraphFacts()
    ref, fused, _, _ = site_probe.spellings(m, facts.region(m.nodes[0].graph))
    calls = [str(n.target) for n in fused.graph.nodes if n.op == "call_function"]
    assert not any("attention" in c and "advisor" not in c for c in calls), calls  # no aten SDPA
    assert not any("clone" in c for c in calls), calls
    assert any("attention" in str(n.target) for n in ref.graph.nodes)


def test_spellings_are_timed_in_turn_so_drift_falls_on_both():
    """A B A B, not A A B B: a device drifting over a probe moves both sides of a saving
    (session 21: one GEMV site read +3.8 µs in one run and -0.6 in the next)."""
    from advisor.profile.replay import spellings_ms

    order = []
    times = spellings_ms([lambda: order.append("a"), lambda: order.append("b")], torch.device("cpu"))
    assert len(times) == 2 and all(t >= 0 for t in times)
    assert order == ["a", "b"] * (len(order) // 2) and len(order) >= 4


def test_the_pdl_variant_launches_the_fused_spelling_with_pdl(matches, monkeypatch):
    """On a device with PDL the fused spelling is timed again launched so, against the
    captured one (whose aten kernels never launch with it), in turn."""
    m = next(m for m in matches if m.family == "add_rms_norm")
    flags, calls = [], []

    @contextlib.contextmanager
    def recorded(on):
        flags[-1].append(on)
        yield

    def fake_ms(runs, device):
        calls.append(runs)
        flags.append([])
        for run in runs:
            try:
                run()
            except Exception:  # noqa: BLE001  (stub inputs: only the launch flag matters)
                pass
        return {1: [10.0, 4.0], 2: [9.0, 2.0]}[len(calls)]
    monkeypatch.setattr(site_probe, "spellings_ms", fake_ms)
    monkeypatch.setattr(site_probe, "programmatic_launch", recorded)
    monkeypatch.setattr(site_probe, "pdl_supported", lambda device: True)
    monkeypatch.setattr(site_probe, "copies_past_l2", lambda b, d: 2)
    monkeypatch.setattr(site_probe, "activations", lambda inputs, args, bases: [])  # no warm timing
    t = site_probe.time_site(m, torch.device("cuda"))
    assert flags == [[False, False], [False, True]]
    assert (t.saving_ms, t.pdl_saving_ms) == (3.0, 3.5)
    probe = site_probe.SiteProbe({site_probe.probe_key(m, site_probe.GraphFacts()): t}, {})
    assert probe.pdl_saving_ms(m) == 3.5 and probe.warm_saving_ms(m) is None
    cands = {c.family: c for c in candidates(matches, Costs(8.0, 4000.0), probe.saving_ms,
                                             probe.reason, probe.warm_saving_ms, None, probe.pdl_saving_ms)}
    norm = cands["add_rms_norm"]  # every layer's site shares the one timing
    assert norm.device_saving_pdl_ms == pytest.approx(3.5 * norm.count)
    assert norm.device_saving_ms == pytest.approx(3.0 * norm.count)
    monkeypatch.setattr(site_probe, "pdl_supported", lambda device: False)
    calls.clear()
    assert site_probe.time_site(m, torch.device("cuda")).pdl_saving_ms is None and len(calls) == 1


@pytest.mark.parametrize("family,calls", [("add_rms_norm", 3), ("rope", 4)])  # + warm, pdl; rope: + blocks
def test_spellings_timed_together_read_their_own_copies(matches, monkeypatch, family, calls):
    """Replayed in turn, a spelling reading the memory the other just read would time the
    L2 hits it left (session 23: a 117 MB GEMV 6.7 µs faster after cuBLAS read its weights).
    Every graph of one spellings_ms call reads its own storage (kept inputs aside, shared on
    purpose: none here); the copies per site stay."""
    from advisor.runtime.column_blocks import column_blocks

    m = next(m for m in matches if m.family == family)
    spellings, seen = site_probe.spellings, []

    def recording(m, region, config=""):
        _, _, inputs, kept = spellings(m, region, config)
        assert not kept

        def read(*args):
            seen[-1][-1].update(a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor))
        return read, read, inputs, kept

    def fake_ms(runs, device):
        seen.append([])
        for run in runs:
            seen[-1].append(set())
            run()
        return [1.0] * len(runs)
    monkeypatch.setattr(site_probe, "spellings", recording)
    monkeypatch.setattr(site_probe, "spellings_ms", fake_ms)
    monkeypatch.setattr(site_probe, "pdl_supported", lambda device: True)
    monkeypatch.setattr(site_probe, "programmatic_launch", lambda on: contextlib.nullcontext())
    monkeypatch.setattr(site_probe, "copies_past_l2", lambda b, d: 3)
    facts = site_probe.GraphFacts(column_blocks(matches))
    t = site_probe.time_site(m, torch.device("cuda"), facts=facts)
    assert len(seen) == calls and t.pdl_saving_ms is not None
    assert (t.sliced_saving_ms is not None) == (family == "rope")
    for call in seen:
        graphs = [ptrs for ptrs in call if ptrs]  # the touch-only graph runs no spelling
        assert len(graphs) >= 2
        assert len(set().union(*graphs)) == sum(len(p) for p in graphs), "spellings share storage"


def test_a_pdl_capture_that_fails_on_a_working_device_leaves_the_cold_timing(matches, monkeypatch):
    from advisor.profile.replay import CaptureFailed

    m = next(m for m in matches if m.family == "add_rms_norm")
    calls = []

    def fake_ms(runs, device):
        calls.append(runs)
        if len(calls) == 2:
            raise CaptureFailed("operation not permitted when stream is capturing")
        return [10.0, 4.0]
    monkeypatch.setattr(site_probe, "spellings_ms", fake_ms)
    monkeypatch.setattr(site_probe, "pdl_supported", lambda device: True)
    monkeypatch.setattr(site_probe, "copies_past_l2", lambda b, d: 2)
    monkeypatch.setattr(site_probe, "activations", lambda inputs, args, bases: [])
    monkeypatch.setattr(site_probe, "_usable", lambda device: True)
    t = site_probe.time_site(m, torch.device("cuda"))
    assert t.saving_ms == 3.0 and t.pdl_saving_ms is None
    calls.clear()
    monkeypatch.setattr(site_probe, "_usable", lambda device: False)  # the device is gone: stop probing
    with pytest.raises(CaptureFailed):
        site_probe.time_site(m, torch.device("cuda"))
