"""graph/cse.py: repeated functional ops merge; mutations, randomness and outputs are honoured."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from advisor.graph.cse import _is_weight, eliminate_common_subexpressions, merge_repeated_tables

aten = torch.ops.aten


def _count(gm, op) -> int:
    return sum(n.op == "call_function" and n.target is op for n in gm.graph.nodes)


def _run(fn, *args):
    gm = make_fx(fn)(*args)
    expected = fn(*[a.clone() for a in args])
    removed = eliminate_common_subexpressions(gm)
    got = gm(*[a.clone() for a in args])
    return gm, removed, expected, got


def test_per_layer_copies_of_one_mask_merge_into_one():
    def layers(mask, q):  # each "layer" turns the same bool mask into an additive one
        out = q
        for _ in range(3):
            add = torch.where(mask, torch.scalar_tensor(0.0), torch.scalar_tensor(float("-inf")))
            out = out + add.softmax(-1)
        return out

    mask = torch.rand(4, 8) > 0.3
    mask[:, 0] = True
    gm, removed, expected, got = _run(layers, mask, torch.randn(4, 8))
    assert removed >= 2 and _count(gm, aten.where.self) == 1
    torch.testing.assert_close(got, expected)


def test_a_write_between_two_reads_keeps_both():
    def f(cache, x):
        a = cache.sum()
        cache.add_(x)  # in place: the second sum reads new values
        b = cache.sum()
        return a * 1.0, b * 1.0

    gm, removed, expected, got = _run(f, torch.randn(5), torch.randn(5))
    assert _count(gm, aten.sum.default) == 2
    torch.testing.assert_close(got, expected)


def test_signed_zero_random_ops_and_outputs_are_not_merged():
    def f(x):
        a = torch.full_like(x, 0.0)
        b = torch.full_like(x, -0.0)  # 1/b differs from 1/a
        r1, r2 = torch.rand_like(x), torch.rand_like(x)
        return 1 / a, 1 / b, r1, r2, x * 2, x * 2

    x = torch.zeros(3)
    gm = make_fx(f)(x)
    eliminate_common_subexpressions(gm)
    one_a, one_b, r1, r2, o1, o2 = gm(x)
    assert torch.all(one_a == float("inf")) and torch.all(one_b == float("-inf"))
    assert _count(gm, aten.rand_like.default) == 2
    assert o1 is not o2  # two outputs stay two tensors


def test_storage_written_later_is_never_shared():
    def f(x):
        a = torch.zeros(3)
        b = torch.zeros(3)
        a.add_(x)
        b.sub_(x)
        return a + 0, b + 0

    gm, removed, expected, got = _run(f, torch.randn(3))
    torch.testing.assert_close(got, expected)


def test_aliases_the_schema_does_not_annotate_and_opaque_writes_are_honoured():
    from torch import fx

    # _unsafe_view(p) is p's storage: a sum of it before and after p.add_ are two values
    g = fx.Graph()
    p = g.placeholder("p")
    u = g.call_function(aten._unsafe_view.default, (p, [6]))
    s1 = g.call_function(aten.sum.default, (u,))
    g.call_function(aten.add_.Tensor, (p, 100))
    s2 = g.call_function(aten.sum.default, (u,))
    g.output((g.call_function(aten.mul.Tensor, (s1, 1)), g.call_function(aten.mul.Tensor, (s2, 1))))
    gm = fx.GraphModule(torch.nn.Module(), g)
    eliminate_common_subexpressions(gm)
    first, second = gm(torch.ones(2, 3))
    assert float(first) == 6 and float(second) == 606
    # a call_method the pass cannot see into may write what it is given
    g = fx.Graph()
    x = g.placeholder("x")
    z1 = g.call_function(aten.zeros.default, ([3],))
    z2 = g.call_function(aten.zeros.default, ([3],))
    g.call_method("add_", (z1, x))
    g.output((g.call_function(aten.mul.Tensor, (z1, 1)), g.call_function(aten.mul.Tensor, (z2, 1))))
    gm = fx.GraphModule(torch.nn.Module(), g)
    eliminate_common_subexpressions(gm)
    a, b = gm(torch.ones(3))
    assert torch.equal(a, torch.ones(3)) and torch.equal(b, torch.zeros(3))


def test_two_outputs_that_view_equal_values_keep_separate_storage():
    def f(x):
        return (x * 2).view(-1), (x * 2).view(-1)

    gm = make_fx(f)(torch.randn(2, 2))
    eliminate_common_subexpressions(gm)
    o1, o2 = gm(torch.randn(2, 2))
    assert o1.data_ptr() != o2.data_ptr()


def test_times_one_and_integer_plus_zero_are_their_input():
    def f(x, i, cache):
        scaled = x * 1.0  # RoPE tables times an attention scaling of 1.0: x itself
        shifted = i + 0  # integer + 0: i itself
        kept_zero = x + 0.0  # float: -0.0 + 0.0 = +0.0, not x
        promoted = i * 1.0  # int64 -> float32: a new value
        before = cache * 1  # cache is written below: the copy must stay
        cache.add_(1.0)
        return scaled.sin(), shifted * 3, kept_zero, promoted, before + cache

    x = torch.tensor([-0.0, 1.5, 2.0])
    gm, removed, expected, got = _run(f, x, torch.arange(3), torch.randn(3))
    assert removed == 2
    # left: i * 1.0, cache * 1, i * 3; x + 0.0, before + cache
    assert _count(gm, aten.mul.Tensor) == 3 and _count(gm, aten.add.Tensor) == 2
    for w, g in zip(expected, got):
        assert torch.equal(w, g) and w.dtype == g.dtype
    assert torch.equal(torch.signbit(got[2]), torch.signbit(x + 0.0))


def test_size_arithmetic_between_two_repeats_does_not_end_the_records():
    def f(x):
        a = x.sum(-1)
        n = x.shape[0] + 1  # operator.add on a SymInt: no tensor written
        b = x.sum(-1)
        return a * n, b * 2

    x = torch.randn(4, 6)
    gm = make_fx(f, tracing_mode="symbolic")(x)
    assert any(n.target.__module__ == "_operator" for n in gm.graph.nodes if n.op == "call_function")
    assert eliminate_common_subexpressions(gm) == 1 and _count(gm, aten.sum.dim_IntList) == 1
    for got, want in zip(gm(x), f(x)):
        torch.testing.assert_close(got, want)


def test_merge_repeated_tables_merges_what_no_weight_goes_into():
    def f(w, c, x):  # w: a weight (a GEMM reads it); c: a table; x: an input
        h = x @ w.t()
        table = c.unsqueeze(0).exp() + c.unsqueeze(0).exp()  # per-call table prep: merged
        return h.exp() + h.exp() + table, x * c.unsqueeze(0)  # activations: left to the later CSE

    args = (torch.randn(6, 6), torch.randn(6), torch.randn(3, 6))
    gm = make_fx(f)(*args)
    weight = next(n for n in gm.graph.nodes if n.op == "placeholder")
    assert merge_repeated_tables(gm, {weight.name: "w"}) == 3  # an unsqueeze twice, an exp
    assert _count(gm, aten.unsqueeze.default) == 1 and _count(gm, aten.exp.default) == 3
    for got, want in zip(gm(*args), f(*args)):
        torch.testing.assert_close(got, want)


def test_a_weight_is_what_a_gemm_or_embedding_reads_as_one():
    def f(w, emb, inv_freq, ids, pos):  # inv_freq: transformers' outer product's left operand
        angles = inv_freq[None, :, None].expand(1, -1, 1) @ pos[None, None, :]
        return torch.nn.functional.embedding(ids, emb) @ w.t(), angles

    args = (torch.randn(6, 6), torch.randn(10, 6), torch.randn(3), torch.tensor([1, 2]), torch.randn(4))
    gm = make_fx(f)(*args)
    w, emb, inv_freq, ids, pos = (n for n in gm.graph.nodes if n.op == "placeholder")
    params = {n.name: n.name for n in (w, emb, inv_freq)}
    assert [_is_weight(n, params) for n in (w, emb, inv_freq, ids, pos)] == [True, True, False, False, False]
