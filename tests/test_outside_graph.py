"""Large outputs computed after a CUDA-graph replay (runtime/outside_graph.py).

Without a GPU the capture is simulated: the forward runs inside `Deferred.active()`, as
`GraphCache` captures it, and `resolve` stands for what follows each replay. The CUDA test
at the end captures and replays for real."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from advisor.runtime import apply as apply_mod
from advisor.runtime import outside_graph as og
from advisor.runtime.cudagraph import GraphCache
from advisor.runtime.plan import Plan
from tests.hf_models import ids, tiny_hf


def _graphs(monkeypatch) -> list:
    grabbed = []
    rewrite = apply_mod.rewrite
    monkeypatch.setattr(apply_mod, "rewrite", lambda gm, *a, **k: grabbed.append(gm) or rewrite(gm, *a, **k))
    return grabbed


def _cut_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if getattr(n.target, "__name__", "") == "advisor_outside_graph"]


@pytest.fixture
def small_outputs(monkeypatch):
    monkeypatch.setattr(og, "MIN_BYTES", 1)  # the tiny models' logits are a few KB


def test_the_logits_matmul_is_cut_and_runs_inline_without_a_capture(monkeypatch, small_outputs):
    model = tiny_hf("Llama")
    graphs = _graphs(monkeypatch)
    fast = apply_mod.apply(model, Plan(fusions=("rms_norm",), cuda_graph=True))
    x = ids(7)
    torch.testing.assert_close(fast(**x).logits, model(**x).logits, rtol=1e-4, atol=1e-4)
    assert [len(_cut_calls(gm)) for gm in graphs] == [1]
    assert not any(n.target in og.MATMULS for n in graphs[0].graph.find_nodes(op="output")[0].all_input_nodes)
    (row,) = [r for r in fast.summary() if r["family"] == "(all)"]
    assert row["outputs_outside_graph"] == 1


def test_a_capture_gets_a_placeholder_and_each_replay_a_fresh_result(small_outputs):
    model = tiny_hf("Qwen2")
    fast = apply_mod.apply(model, Plan(fusions=("rms_norm",), cuda_graph=True))
    x = ids(6)
    fast(**x)  # trace, as GraphCache's warm-up does
    deferred = og.Deferred()
    with deferred.active():
        out = fast(**x)
    assert len(deferred.cuts) == 1 and deferred.graphs_entered == 1 and deferred.sound(out)
    assert out.logits.untyped_storage().data_ptr() == deferred.cuts[0].placeholder.untyped_storage().data_ptr()
    first = deferred.resolve(out).logits
    torch.testing.assert_close(first, model(**x).logits, rtol=1e-4, atol=1e-4)
    # a replay rewrites the graph's own tensors in place; the cut reads them anew
    (cut,) = deferred.cuts
    hidden = next(t for t in cut.inputs if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == 64)
    kept = first.clone()
    hidden.mul_(2)
    second = deferred.resolve(out).logits
    assert second.data_ptr() != first.data_ptr()  # memory of its own: the caller's
    torch.testing.assert_close(first, kept)  # what the caller held is untouched
    torch.testing.assert_close(second, 2 * first, rtol=1e-4, atol=1e-4)  # linear in hidden


def test_a_model_on_the_cpu_is_never_captured():
    """On a machine with a GPU too: a capture of CPU work records nothing, and replaying it
    would hand back the first call's outputs forever."""
    cache = GraphCache(lambda x: x * 2)
    assert torch.equal(cache(torch.ones(2)), torch.full((2,), 2.0))
    assert torch.equal(cache(torch.full((2,), 3.0)), torch.full((2,), 6.0))
    assert not cache.graphs and not cache.failures and not cache.failed


def test_our_fused_lm_head_is_cut_too(monkeypatch, small_outputs):
    """The final norm fused into lm_head (`add_rms_norm_linear`: our kernel, no matmul) makes
    the logits; its layout comes from the op's fake implementation on the meta device."""
    model = tiny_hf("Llama")
    graphs = _graphs(monkeypatch)
    fast = apply_mod.apply(model, Plan(fusions=("add_rms_norm_linear",), cuda_graph=True))
    x = ids(18)  # 36 rows: the tensor-core path (pre-pass) in the interpreter
    fast(**x)
    (call,) = _cut_calls(graphs[0])
    sub = call.target.__closure__[0].cell_contents
    assert any(getattr(n.target, "namespace", "") == "advisor" for n in sub.graph.nodes), [
        r["unfused"] for r in fast.summary() if r["family"] == "add_rms_norm_linear"]
    deferred = og.Deferred()
    with deferred.active():
        out = fast(**x)
    assert len(deferred.cuts) == 1 and deferred.sound(out)
    torch.testing.assert_close(deferred.resolve(out).logits, model(**x).logits, rtol=1e-4, atol=1e-4)


def _one_cut() -> tuple[og.Deferred, torch.Tensor, torch.Tensor]:
    """A capture of one cut `a @ b` in one graph: (deferred, placeholder, a @ b)."""
    sub = fx.symbolic_trace(lambda a, b: torch.ops.aten.mm.default(a, b))
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    deferred = og.Deferred()
    with deferred.active():
        placeholder = og.outside_graph(sub)(a, b)
    deferred.graphs_entered = 1  # as if one rewritten graph ran and returned the placeholder
    deferred.returned.add(placeholder.untyped_storage().data_ptr())
    return deferred, placeholder, a @ b


def test_views_of_a_placeholder_map_onto_the_fresh_result():
    deferred, placeholder, ab = _one_cut()
    other = torch.ones(2)  # another output of the graph
    deferred.returned.add(other.untyped_storage().data_ptr())
    out = {"full": placeholder, "last": placeholder[-1], "t": placeholder.t(), "other": other}
    assert deferred.sound(out)
    got = deferred.resolve(out)
    torch.testing.assert_close(got["full"], ab)
    torch.testing.assert_close(got["last"], ab[-1])
    torch.testing.assert_close(got["t"], ab.t())
    assert got["other"].data_ptr() != out["other"].data_ptr()  # every other output cloned


def test_a_placeholder_that_does_not_come_back_or_a_graph_break_is_unsound():
    deferred, placeholder, _ = _one_cut()
    assert not deferred.sound((placeholder.sum(),))  # read inside: never resolved
    assert deferred.sound((placeholder,))
    # made by eager code after the graph (a function dynamo skips): it read the placeholder
    assert not deferred.sound((placeholder, placeholder.softmax(-1)))
    state = torch.zeros(3)
    assert deferred.sound((placeholder, state), inputs=[state])  # an input handed back
    deferred.graphs_entered = 2  # a graph break: the second graph could have read it
    assert not deferred.sound((placeholder,))
    assert og.Deferred().sound((torch.ones(1),))  # nothing cut: always sound


def test_only_a_matmul_chain_used_by_the_output_alone_and_large_is_cut():
    def build(logits_too_small: bool, reuse: bool) -> fx.GraphModule:
        g = fx.Graph()
        h, w = g.placeholder("h"), g.placeholder("w")
        wt = g.call_function(torch.ops.aten.t.default, (w,))
        mm = g.call_function(torch.ops.aten.mm.default, (h, wt))
        out = g.call_function(torch.ops.aten.view.default, (mm, [1, 4, 6]))
        outs = [out]
        if reuse:
            outs.append(g.call_function(torch.ops.aten.relu.default, (mm,)))
        g.output(tuple(outs))
        gm = fx.GraphModule(torch.nn.Module(), g)
        numel = 1 if logits_too_small else 24
        for node in gm.graph.nodes:
            node.meta["val"] = torch.empty(numel)
        return gm

    assert og.move_large_outputs(build(False, False), min_bytes=64) == 1
    assert og.move_large_outputs(build(True, False), min_bytes=64) == 0  # under the size
    assert og.move_large_outputs(build(False, True), min_bytes=64) == 0  # mm read twice
    gm = build(False, False)
    og.move_large_outputs(gm, min_bytes=64)
    h, w = torch.randn(4, 5), torch.randn(6, 5)
    torch.testing.assert_close(gm(h, w)[0], (h @ w.t()).view(1, 4, 6))


def test_a_matmul_reading_memory_the_graph_writes_later_stays_in_the_graph():
    """y = state @ W, then state.copy_(x) (an input updated in place, as a cache is): run
    after the replay, the matmul would read x."""
    g = fx.Graph()
    state, w, x = g.placeholder("state"), g.placeholder("w"), g.placeholder("x")
    view = g.call_function(torch.ops.aten.view.default, (state, [4, 5]))
    mm = g.call_function(torch.ops.aten.mm.default, (view, g.call_function(torch.ops.aten.t.default, (w,))))
    g.call_function(torch.ops.aten.copy_.default, (state, x))
    g.output((mm,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    for node in gm.graph.nodes:
        node.meta["val"] = torch.empty(24)
    assert og.move_large_outputs(gm, min_bytes=1) == 0
    g2 = fx.Graph()  # the same without the write: cut
    state, w = g2.placeholder("state"), g2.placeholder("w")
    mm = g2.call_function(torch.ops.aten.mm.default, (state, g2.call_function(torch.ops.aten.t.default, (w,))))
    g2.output((mm,))
    gm2 = fx.GraphModule(torch.nn.Module(), g2)
    for node in gm2.graph.nodes:
        node.meta["val"] = torch.empty(24)
    assert og.move_large_outputs(gm2, min_bytes=1) == 1


def test_a_fresh_result_off_the_placeholder_layout_is_copied_into_it():
    placeholder = torch.empty(3, 4).t()  # (4, 3), strides (1, 4)
    fresh = torch.arange(12.0).view(4, 3)  # contiguous: another layout
    got = og._laid_out_as(fresh, placeholder)
    assert got.stride() == placeholder.stride() and torch.equal(got, fresh)
    assert og._laid_out_as(fresh, torch.empty(4, 3)) is fresh


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_replayed_logits_belong_to_the_caller_on_cuda(small_outputs, dtype):
    with torch.device("cuda"):  # built there: .cuda() leaves plain tensor attributes on the
        model = tiny_hf("Llama", dtype)  # CPU, whose copies in the forward cannot be captured
    # No Triton fusions: the tests run Triton in the interpreter (conftest), which copies
    # through the host, and a capture refuses that. The cut is of torch's own matmul.
    fast = apply_mod.apply(model, Plan(fusions=(), cuda_graph=True))
    x = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in ids(9).items()}
    y = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in ids(9, seed=5).items()}
    first = fast(**x).logits  # trace + capture + the first replay
    kept = first.clone()
    second = fast(**y).logits  # a replay
    third = fast(**x).logits
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == torch.bfloat16 else {"rtol": 1e-3, "atol": 1e-3}
    (row,) = [r for r in fast.summary() if r["family"] == "(all)"]
    assert row["cuda_graphs"] == 1, row["cuda_graph_failures"]
    assert row["outputs_outside_graph"] == 1
    torch.testing.assert_close(first, kept)  # not overwritten by the later replays
    torch.testing.assert_close(first, model(**x).logits, **tol)
    torch.testing.assert_close(second, model(**y).logits, **tol)
    torch.testing.assert_close(third, first)  # the same input, the same kernels
    assert len({first.data_ptr(), second.data_ptr(), third.data_ptr()}) == 3
    state = next(iter(fast.buckets.values()))
    (captured,) = state.graphs.graphs.values()
    assert len(captured.deferred.cuts) == 1  # sound: the capture kept its cut
    assert row["outside_per_graph"] == [1]


@torch.compiler.disable
def _eager_softmax(t: torch.Tensor) -> torch.Tensor:
    return t.softmax(-1)


class _ReadsLogitsEagerly(torch.nn.Module):
    """The logits, then eager code (a function dynamo skips) reading them."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 64)

    def forward(self, x):
        logits = self.head(x * 2)
        return logits, _eager_softmax(logits)


def test_eager_code_after_the_graph_makes_a_capture_unsound(small_outputs):
    model = _ReadsLogitsEagerly()
    fast = apply_mod.apply(model, Plan(fusions=(), cuda_graph=True))
    x = torch.randn(2, 8, 16)
    fast(x)  # trace
    deferred = og.Deferred()
    with deferred.active():
        out = fast(x)
    assert len(deferred.cuts) == 1 and deferred.graphs_entered == 1
    assert not deferred.sound(out)  # the softmax was made outside the graph, from the placeholder


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_placeholder_read_by_eager_code_recaptures_without_the_cut(small_outputs):
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = _ReadsLogitsEagerly()
        xs = [torch.randn(2, 8, 16) for _ in range(2)]
    fast = apply_mod.apply(model, Plan(fusions=(), cuda_graph=True))
    for x in xs * 2:  # capture, then replays
        logits, probs = fast(x)
        want = model(x)[0]
        torch.testing.assert_close(logits, want)
        torch.testing.assert_close(probs, want.softmax(-1))
    state = next(iter(fast.buckets.values()))
    (captured,) = state.graphs.graphs.values()
    assert captured.deferred.cuts == []  # unsound: captured again with nothing cut
    (row,) = [r for r in fast.summary() if r["family"] == "(all)"]
    assert row["outputs_outside_graph"] == 1 and row["outside_per_graph"] == [0]
