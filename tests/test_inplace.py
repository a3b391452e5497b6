"""Cache writes put back in place: `copy_(cache, index_copy(cache, ...))` -> `index_copy_`;
then RoPE + the k/v cache writes of a decode step fused into one op (rope_kv_cache)."""

import torch
from torch import fx

from advisor.graph.capture import aten_backend
from advisor.graph.inplace import batch_input_increments, write_inputs_in_place

aten = torch.ops.aten


class _Step(torch.nn.Module):
    """A cache update as models write it: scatter this step's rows, then read the cache."""

    def forward(self, cache, pos, k):  # cache (B, H, S, D), pos (T,), k (B, H, T, D)
        cache.index_copy_(2, pos, k)
        return cache.sum(dim=2) * 2


def _captured(model, *args):
    graphs = []

    def keep(gm, params, example):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aten_backend(model, keep), dynamic=False)
    with torch.no_grad():
        compiled(*args)
    torch._dynamo.reset()
    return graphs[0]


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_cache_update_is_written_in_place():
    cache, pos, k = torch.randn(2, 3, 10, 4), torch.tensor([4, 7]), torch.randn(2, 3, 2, 4)
    gm = _captured(_Step(), cache.clone(), pos, k)
    assert aten.index_copy.default in _targets(gm) and aten.copy_.default in _targets(gm)
    assert write_inputs_in_place(gm) == 1
    assert aten.index_copy_.default in _targets(gm)
    assert aten.index_copy.default not in _targets(gm) and aten.copy_.default not in _targets(gm)
    want_cache, got_cache = cache.clone(), cache.clone()
    want = _Step()(want_cache, pos, k)
    (got,) = gm(got_cache, pos, k)
    torch.testing.assert_close(got, want)
    assert torch.equal(got_cache, want_cache)


def test_a_read_of_the_old_cache_after_the_write_keeps_the_copy():
    # old = cache.sum() scheduled after new = index_copy(cache, ...): in place would be wrong
    g = fx.Graph()
    cache, pos, k = g.placeholder("cache"), g.placeholder("pos"), g.placeholder("k")
    new = g.call_function(aten.index_copy.default, (cache, 2, pos, k))
    view = g.call_function(aten.view.default, (cache, [-1]))
    old = g.call_function(aten.sum.default, (view,))
    g.call_function(aten.copy_.default, (cache, new))
    g.output((old,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert write_inputs_in_place(gm) == 0
    c = torch.randn(1, 2, 6, 3)
    (total,) = gm(c.clone(), torch.tensor([1]), torch.randn(1, 2, 1, 3))
    torch.testing.assert_close(total, c.sum())


def _counters_graph(read_after: bool) -> fx.GraphModule:
    """x * a, then the write-back epilogue a += 1, b += 1, c += 2 (per-layer position
    counters); read_after: a sum of b after b's write (the new value)."""
    g = fx.Graph()
    a, b, c, x = (g.placeholder(n) for n in "abcx")
    for p in (a, b, c):
        p.meta["val"] = torch.empty(1, dtype=torch.int64)
    y = g.call_function(aten.mul.Tensor, (x, a))
    adds = [g.call_function(aten.add.Tensor, (p, v)) for p, v in ((a, 1), (b, 1), (c, 2))]
    for p, new in zip((a, b, c), adds):
        g.call_function(aten.copy_.default, (p, new))
    outs = (y, g.call_function(aten.sum.default, (b,))) if read_after else (y,)
    g.output(outs)
    return fx.GraphModule(torch.nn.Module(), g)


def test_counter_increments_become_one_foreach_add():
    args = [torch.tensor([3]), torch.tensor([5]), torch.tensor([7]), torch.randn(4)]
    gm = _counters_graph(read_after=False)
    assert batch_input_increments(gm) == 2  # a and b (+1); c alone (+2) keeps its copy
    assert _targets(gm).count(aten._foreach_add_.Scalar) == 1 and _targets(gm).count(aten.copy_.default) == 1
    got = [t.clone() for t in args]
    (y,) = gm(*got)
    torch.testing.assert_close(y, args[3] * args[0])
    assert [int(t) for t in got[:3]] == [4, 6, 9]
    # b read after its write: the writes stay where they are
    late = _counters_graph(read_after=True)
    assert batch_input_increments(late) == 0


def test_counter_increments_that_would_differ_in_place_stay():
    """An int counter plus a float (promotes, then the copy truncates; refused in place),
    and a counter written between its `p + 1` and the copy back, are left alone."""
    g = fx.Graph()
    a, b, x = g.placeholder("a"), g.placeholder("b"), g.placeholder("x")
    for p in (a, b):
        p.meta["val"] = torch.empty(1, dtype=torch.int64)
    na, nb = g.call_function(aten.add.Tensor, (a, 1.0)), g.call_function(aten.add.Tensor, (b, 1.0))
    g.call_function(aten.copy_.default, (a, na))
    g.call_function(aten.copy_.default, (b, nb))
    g.output((x,))
    assert batch_input_increments(fx.GraphModule(torch.nn.Module(), g)) == 0
    g = fx.Graph()
    a, b, x = g.placeholder("a"), g.placeholder("b"), g.placeholder("x")
    for p in (a, b):
        p.meta["val"] = torch.empty(1, dtype=torch.int64)
    na, nb = g.call_function(aten.add.Tensor, (a, 1)), g.call_function(aten.add.Tensor, (b, 1))
    g.call_function(aten.add_.Tensor, (a, x))  # a changes after a + 1 was taken
    g.call_function(aten.copy_.default, (a, na))
    g.call_function(aten.copy_.default, (b, nb))
    g.output((x,))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert batch_input_increments(gm) == 0
    a_val, b_val = torch.tensor([5]), torch.tensor([7])
    gm(a_val, b_val, torch.tensor([100]))
    assert int(a_val) == 6 and int(b_val) == 8  # the copy wins, as written


def test_decode_step_leaves_the_same_cache_as_eager(decode_steps):
    """`decode_steps` (conftest): each example's step, eager then fused from the restored cache."""
    for path in ("examples/tiny_llama.py", "examples/llama_hf.py"):
        step = decode_steps[path]
        torch.testing.assert_close(step.got, step.ref, atol=1e-4, rtol=1e-4)
        for live, eager in step.after_eager.pairs:  # the cache written as eager wrote it
            torch.testing.assert_close(live, eager, atol=1e-5, rtol=1e-5, msg=path)
        rows = {r["family"]: r for r in step.summary}
        assert rows["(all)"]["in_place_writes"] == 4, (path, rows)  # k and v of 2 layers
        # RoPE + both cache writes as one op per layer, whatever the model's spelling
        assert rows["rope_kv_cache"]["applied"] == 2 and rows["rope"]["applied"] == 0, (path, rows)
