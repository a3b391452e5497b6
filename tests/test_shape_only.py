"""graph/shape_only.py: values derived from sizes alone are computed once per size; anything
written, random, uninitialised or returned is left to run every call."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import advisor.graph.shape_only as so
from advisor.graph.match import launches
from advisor.graph.shape_only import ShapeMemo, memoize_shape_only
from advisor.runtime.apply import apply
from advisor.runtime.plan import Plan
from tests.hf_models import ids, tiny_hf

aten = torch.ops.aten


def _causal_softmax(x):  # x (T, T): a mask built from T alone, then a data op
    t = x.shape[0]
    keep = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    bias = torch.where(keep, torch.scalar_tensor(0.0), torch.scalar_tensor(float("-inf")))
    return (x + bias).softmax(-1)


def _symbolic(fn, *args):
    return make_fx(fn, tracing_mode="symbolic")(*args)


def _memos(gm) -> list[ShapeMemo]:
    return [n.target for n in gm.graph.nodes if isinstance(n.target, ShapeMemo)]


def _count(gm, op) -> int:
    return sum(n.op == "call_function" and n.target is op for n in gm.graph.nodes)


def test_mask_from_sizes_is_computed_once_per_length():
    gm = _symbolic(_causal_softmax, torch.randn(5, 5))
    before = sum(launches(n) for n in gm.graph.nodes)
    saved = memoize_shape_only(gm)
    # arange x2, ge, scalar_tensor x2, where (the unsqueezes are views)
    assert saved == 6 and _count(gm, aten.arange.start_step) + _count(gm, aten.arange.default) == 0
    assert sum(launches(n) for n in gm.graph.nodes) == before - saved
    (memo,) = _memos(gm)
    for t in (5, 7, 5, 1):
        x = torch.randn(t, t)
        torch.testing.assert_close(gm(x), _causal_softmax(x))
    assert len(memo.values) == 3  # lengths 5, 7, 1: one entry each
    kept = memo.values[(5,)]
    assert memo(5) is kept  # a hit returns the kept tensors, no recompute


def _late_size(x, table):  # x (T, D): positions read first, then a size computed after them
    t = x.shape[0]
    h = x + table[torch.arange(t)]  # the first read of a value from sizes alone
    n = t + 1  # GPT-2's `T + past`, traced after its position embedding
    keep = torch.arange(t)[:, None] < torch.arange(n)[None, 1:]  # (T, T): from sizes alone
    return torch.where(keep, h[:, :1], 0.0)


def test_sizes_computed_after_the_first_read_are_moved_up():
    """The memo goes before the first reader of its outputs; integer arithmetic traced after
    that reader moves up with it (it was no memo at all: GPT-2's causal mask, ~19 launches
    a forward)."""
    table = torch.randn(16, 4)
    gm = _symbolic(_late_size, torch.randn(5, 4), table)
    saved = memoize_shape_only(gm)
    assert saved >= 4 and _count(gm, aten.arange.default) + _count(gm, aten.arange.start) == 0, gm.code
    for t in (5, 3, 5):
        x = torch.randn(t, 4)
        torch.testing.assert_close(gm(x, table), _late_size(x, table))


def test_written_random_uninitialised_and_data_dependent_values_stay():
    def f(x):
        t = x.shape[0]
        z = torch.zeros(t)
        z[:1].fill_(2.0)  # a view of z written in place: z is not a constant
        r = torch.rand(t)  # random
        e = torch.empty(t).fill_(3.0)  # uninitialised, then written
        d = torch.ones(t) * x.sum()  # reads data
        return x + z + r * 0 + e + d

    gm = _symbolic(f, torch.randn(4))
    assert memoize_shape_only(gm) == 1  # only ones(t), the factor of the data op
    x = torch.randn(6)
    torch.testing.assert_close(gm(x), f(x))
    assert _count(gm, aten.rand.default) == 1 and _count(gm, aten.fill_.Scalar) == 2


def test_returned_values_are_fresh_every_call():
    def f(x):
        pos = torch.arange(x.shape[0])
        return pos, pos * 2 + x.long()  # pos itself escapes; its use inside may be kept

    gm = _symbolic(f, torch.randn(4))
    memoize_shape_only(gm)
    a, _ = gm(torch.randn(4))
    a.add_(100)  # the caller owns what it gets
    b, c = gm(torch.zeros(4))
    assert torch.equal(b, torch.arange(4)) and torch.equal(c, torch.arange(4) * 2)


def test_no_launch_no_memo():
    def f(x):
        return x + torch.full((x.shape[0],), 2.0)  # one launch: kept
    gm = _symbolic(lambda x: x.view(-1) * 2, torch.randn(3))
    assert memoize_shape_only(gm) == 0 and not _memos(gm)
    gm = _symbolic(f, torch.randn(3))
    assert memoize_shape_only(gm) == 1


def test_nothing_kept_while_capturing_or_past_the_budget(monkeypatch):
    fn = lambda t: (torch.arange(t),)  # noqa: E731
    memo = ShapeMemo(fn, 1, 1, max_bytes=64)
    assert torch.equal(memo(4)[0], torch.arange(4)) and (4,) in memo.values  # 32 bytes
    memo(40)  # 320 bytes: over the budget, computed but not kept
    assert (40,) not in memo.values and torch.equal(memo(40)[0], torch.arange(40))
    few = ShapeMemo(fn, 1, 1, max_keys=1)
    few(1), few(2)
    assert list(few.values) == [(1,)]
    monkeypatch.setattr(so, "_capturing", lambda out: True)
    memo(3)
    assert (3,) not in memo.values


def test_transformers_prefill_mask_is_memoised_and_outputs_match():
    model = tiny_hf("Llama")
    refs = {t: model(**ids(t)).logits for t in (1, 6, 9)}
    fast = apply(model, Plan(fusions=("add_rms_norm", "rms_norm", "gated_act")))
    for t in (1, 6, 9, 6):
        torch.testing.assert_close(fast(**ids(t)).logits, refs[t], rtol=1e-4, atol=1e-4)
    total = [r for r in fast.summary() if r["family"] == "(all)"][0]
    assert total["shape_only_memoized"] >= 10, total  # the mask's ~17 launches, per graph


def test_gpt2_prefill_mask_is_memoised():
    """GPT-2 computes `T + past` after its position embedding reads the arange the mask is
    built from: the memo's integers came after its first reader, and it was no memo."""
    from advisor.loader import build, load_model_file

    mf = load_model_file("examples/gpt2_hf.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    x = {"input_ids": ids(6)["input_ids"] % model.config.vocab_size, "use_cache": False}
    ref = model(**x).logits
    fast = apply(model, Plan(fusions=("add_layer_norm",)))
    torch.testing.assert_close(fast(**x).logits, ref, rtol=1e-4, atol=1e-4)
    total = [r for r in fast.summary() if r["family"] == "(all)"][0]
    assert total["shape_only_memoized"] >= 10, total


def test_decode_with_cache_positions_keeps_the_mask_live():
    """At decode the mask reads cache_position (a tensor input): not shape-only; each step's
    output must still equal eager's (a memoised mask would freeze the first step's)."""
    from transformers import DynamicCache

    model = tiny_hf("Llama")
    prompt = ids(5, batch=1)["input_ids"]
    fast = apply(model, Plan(fusions=("add_rms_norm", "rms_norm", "gated_act")))
    with torch.no_grad():
        caches = [DynamicCache(), DynamicCache()]
        outs = [m(input_ids=prompt, past_key_values=c, use_cache=True).logits
                for m, c in zip((model, fast), caches)]
        token = outs[0][:, -1:].argmax(-1)
        for _ in range(3):
            ref = model(input_ids=token, past_key_values=caches[0], use_cache=True).logits
            got = fast(input_ids=token, past_key_values=caches[1], use_cache=True).logits
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
            token = ref[:, -1:].argmax(-1)
