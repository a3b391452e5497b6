"""Sites reading merged GEMMs' outputs as column blocks (advisor/runtime/column_blocks.py)
and their second probe timing (runtime/site_probe.py): which inputs are blocks, that the
replayed views read the same values at the merged layout's strides, and that the timings
reach the candidates."""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")

from advisor.graph.candidates import Costs, candidates  # noqa: E402
from advisor.graph.capture import fake, hint  # noqa: E402
from advisor.graph.cse import storage_bases  # noqa: E402
from advisor.runtime import site_probe  # noqa: E402
from advisor.runtime.column_blocks import as_in_block, blocks_read, column_blocks  # noqa: E402
from advisor.runtime.rewrite import extract  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def matches(example_matches):
    return example_matches("examples/llama_hf.py")


def _site(matches, family):
    return next(m for m in matches if m.family == family)


def test_readers_of_merged_projections_read_their_blocks(matches):
    blocks = column_blocks(matches)
    rope = _site(matches, "rope")
    inputs = rope.external_inputs()
    read = blocks_read(inputs, storage_bases(inputs[0].graph), blocks)
    # q and k: columns [0, 96) and [96, 128) of the layer's one (M, 160) QKV result
    assert sorted((b.start, b.cols, b.width) for b in read.values()) == [(0, 96, 160), (96, 32, 160)]
    assert len({b.group for b in read.values()}) == 1
    # layer 0 reads a plain norm: its QKV is merged by qkv_merge or by the norm folded in
    assert all(set(b.by) == {"qkv_merge", "rms_norm_linear"} for b in read.values())
    swiglu = _site(matches, "gated_act")
    ins = swiglu.external_inputs()
    assert {(b.start, b.cols) for b in blocks_read(ins, storage_bases(ins[0].graph), blocks).values()} == {
        (0, 200), (200, 200)}
    norm = _site(matches, "add_rms_norm")  # reads the residual stream: no block
    ins = norm.external_inputs()
    assert not blocks_read(ins, storage_bases(ins[0].graph), blocks)


def test_a_block_read_through_the_graph_views_has_the_values_and_the_merged_strides(matches):
    blocks = column_blocks(matches)
    m = _site(matches, "rope")
    ref_gm, inputs, _ = extract(m)
    bases = storage_bases(inputs[0].graph)
    read = blocks_read(inputs, bases, blocks)
    i, b = next(iter(read.items()))
    rows = hint(fake(bases[inputs[i]]).shape[0])
    buffer = torch.randn(rows, b.width)
    got = as_in_block(inputs[i], bases[inputs[i]], b, buffer)
    want = fake(inputs[i])
    assert tuple(got.shape) == tuple(hint(s) for s in want.shape)
    assert b.width in got.stride()  # a row of the merged result is `width` apart
    # the same values as the view of a contiguous (M, cols) output
    dense = buffer[:, b.start:b.start + b.cols].contiguous()
    assert torch.equal(got, as_in_block(inputs[i], bases[inputs[i]],
                                        type(b)(b.by, b.group, b.cols, 0, b.cols), dense))
    # and the site computes the same on them
    sets = site_probe._arg_sets(m, inputs, 1, seed=0)
    sliced = site_probe._in_blocks(inputs, sets, read, bases, seed=3)
    contiguous = [a.contiguous() if isinstance(a, torch.Tensor) else a for a in sliced[0]]
    for x, y in zip(ref_gm(*sliced[0]), ref_gm(*contiguous)):
        torch.testing.assert_close(x, y)
    # q and k of one merge share one buffer
    qk = [sliced[0][j] for j in read]
    assert qk[0].untyped_storage().data_ptr() == qk[1].untyped_storage().data_ptr()


def test_block_readers_are_timed_again_and_priced(matches, monkeypatch):
    """On CUDA (spellings_ms stubbed: calls counted) a block reader gets a second timing;
    its candidate carries the saving and the unfused spelling's penalty per site."""
    m = _site(matches, "gated_act")
    facts = site_probe.GraphFacts(column_blocks(matches))
    calls = []

    def fake_ms(runs, device):
        calls.append(runs)
        # (unfused, fused), then (unfused again, both in blocks): the blocks' cost is taken
        # beside the second unfused timing (11: drifted) and re-based on the first
        return {1: [10.0, 4.0], 2: [11.0, 16.0, 6.0]}[len(calls)]
    monkeypatch.setattr(site_probe, "spellings_ms", fake_ms)
    monkeypatch.setattr(site_probe, "copies_past_l2", lambda b, d: 2)
    monkeypatch.setattr(site_probe, "activations", lambda inputs, args, bases: [])  # no warm timing
    monkeypatch.setattr(site_probe, "_in_blocks", lambda inputs, sets, blocks, bases, seed: sets)
    t = site_probe.time_site(m, torch.device("cuda"), facts=facts)
    assert (t.unfused_ms, t.fused_ms, t.sliced_unfused_ms, t.sliced_fused_ms) == (5.0, 2.0, 7.5, 2.5)
    assert t.sliced_saving_ms == 5.0

    probe = site_probe.SiteProbe({site_probe.probe_key(m, facts): t}, {}, facts)
    s = probe.sliced(m)
    assert (s.saving_ms, s.unfused_penalty_ms) == (5.0, 2.5) and "gate_up_merge" in s.by  # 8 − 5.5
    assert probe.sliced(_site(matches, "add_rms_norm")) is None  # not timed here
    cands = {c.family: c for c in candidates(matches, Costs(8.0, 4000.0), probe.saving_ms,
                                             probe.reason, probe.warm_saving_ms, probe.sliced)}
    gated = cands["gated_act"]
    assert gated.site_sliced[0] == s and len(gated.site_sliced) == gated.count
    assert all(x is None for x in cands["add_rms_norm"].site_sliced)


def test_readers_name_the_blocks_they_read_so_overlapping_families_meet(matches):
    """RoPE reads q's and k's blocks, attention v's, attention with RoPE all three: named by
    the block itself (graph, merged result, first column), not by the view that reads it."""
    facts = site_probe.GraphFacts(column_blocks(matches))
    layer0 = {}  # each family's first site: layer 0's (RoPE's sites share one module name)
    for m in matches:
        if m.family in ("rope", "attention", "attention_rope"):
            layer0.setdefault(m.family, m)
    t = site_probe.SiteTiming(2.0, 1.0, sliced_unfused_ms=2.5, sliced_fused_ms=1.2)
    probe = site_probe.SiteProbe({site_probe.probe_key(m, facts): t for m in layer0.values()}, {}, facts)
    reads = {f: set(probe.sliced(m).reads) for f, m in layer0.items()}
    assert reads["rope"] | reads["attention"] == reads["attention_rope"] and len(reads["attention_rope"]) == 3
    assert not reads["rope"] & reads["attention"]
    assert probe.sliced(layer0["rope"]).unfused_penalty_ms == pytest.approx(0.5)


def test_a_block_that_cannot_be_read_leaves_the_cold_timing(matches, monkeypatch):
    m = _site(matches, "gated_act")
    facts = site_probe.GraphFacts(column_blocks(matches))
    monkeypatch.setattr(site_probe, "spellings_ms", lambda runs, device: [1.0] * len(runs))
    monkeypatch.setattr(site_probe, "copies_past_l2", lambda b, d: 1)
    monkeypatch.setattr(site_probe, "activations", lambda inputs, args, bases: [])

    def broken(*args):
        raise RuntimeError("view size is not compatible with input tensor's size and stride")
    monkeypatch.setattr(site_probe, "_in_blocks", broken)
    t = site_probe.time_site(m, torch.device("cuda"), facts=facts)
    assert (t.unfused_ms, t.fused_ms, t.sliced_saving_ms) == (1.0, 1.0, None)


def test_only_views_are_replayed_on_a_block():
    from torch import fx
    g = fx.Graph()
    x = g.placeholder("x")
    mm = g.call_function(torch.ops.aten.mm.default, (x, x))
    v = g.call_function(torch.ops.aten.view.default, (mm, [4, 2]))
    t = g.call_function(torch.ops.aten.t.default, (v,))
    written = g.call_function(torch.ops.aten.mul_.Tensor, (mm, 2.0))
    restrided = g.call_function(torch.ops.aten.as_strided.default, (mm, [2, 4], [4, 1]))
    g.output((t, written, restrided))
    bases = storage_bases(g)
    from advisor.graph.cse import view_chain
    assert bases[t] is mm and view_chain(t, mm) == [v, t] and view_chain(mm, mm) == []
    assert view_chain(written, mm) is None and view_chain(restrided, mm) is None
