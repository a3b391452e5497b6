"""Copies that change nothing (graph/copies.py): eval-mode dropout's clone and the cat of a
rotation with an empty pass-through part are dropped or seen through, so the fusions on
either side of them match; copies that do change something are kept."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from advisor.graph.copies import drop_identity_copies, through_copies
from advisor.runtime.apply import apply
from advisor.runtime.plan import Plan

aten = torch.ops.aten


def _traced(fn, *args):
    return make_fx(fn, tracing_mode="fake")(*args)


def _clones_and_cats(gm) -> int:
    return sum(n.target in (aten.clone.default, aten.cat.default) for n in gm.graph.nodes)


def _dropped(fn, *args) -> int:
    """How many copies the pass drops from `fn`'s graph; the graph still computes `fn`."""
    gm = _traced(fn, *args)
    want = fn(*[a.clone() for a in args])
    dropped = drop_identity_copies(gm)
    got = gm(*args)
    for g, w in zip(got if isinstance(got, (tuple, list)) else (got,), want if isinstance(want, tuple) else (want,)):
        torch.testing.assert_close(g, w)
    return dropped


def test_copies_with_the_inputs_layout_are_dropped():
    x = torch.randn(5, 7)
    assert _dropped(lambda x: x.clone() + 1, x) == 1
    assert _dropped(lambda x: x.t().clone() * 2, x) == 1  # preserve_format keeps the strides
    assert _dropped(lambda x: torch.cat([x, x[:, :0]], dim=1) + 1, x) == 1
    assert _dropped(lambda x: F.dropout(x, 0.1, training=False) + 1, x) in (0, 1)  # no node or a clone


def test_copies_that_change_something_are_kept():
    x = torch.randn(5, 7)
    assert _dropped(lambda x: x.t().contiguous() + 1, x) == 0  # another layout
    assert _dropped(lambda x: torch.cat([x, x], dim=1) + 1, x) == 0
    assert _dropped(lambda x: (x.clone(), x + 1), x) == 0  # the caller gets it: not an alias
    # a copy of a view starts at offset 0 of its own storage: as_strided reads another element
    rows = torch.arange(12.0).view(4, 3)
    assert _dropped(lambda x: x[1:].clone().as_strided((2, 3), (3, 1), 0) * 2, rows) == 0
    xb = torch.randn(5, 7, dtype=torch.bfloat16)
    # promoted by the empty fp32 operand: another dtype
    assert _dropped(lambda x: torch.cat([x, torch.zeros(5, 0)], dim=1) + 1, xb) == 0

    def written_later(x):
        y = x.clone()
        x.add_(1)  # y must keep the old values
        return y * 2
    assert _dropped(written_later, x.clone()) == 0


def test_a_reshape_round_trip_is_dropped_and_others_kept():
    x = torch.randn(2, 5, 7)
    assert _dropped(lambda x: x.reshape(10, 7).view(2, 5, 7) * 2, x) == 1
    assert _dropped(lambda x: x.reshape(10, 7) * 2, x) == 0  # another shape
    assert _dropped(lambda x: x.reshape(2, 7, 5) * 2, x) == 0  # same numel, other sizes
    assert _dropped(lambda x: x.transpose(1, 2).reshape(2, 5, 7) * 2, x) == 0  # a transpose between


class _InPlaceSwiGLU(torch.nn.Module):
    """`F.silu(g, inplace=True); g.mul_(u)`: functionalised, silu and mul read and are read
    through view(view(·, (B·T, N)), (B, T, N)) round trips."""

    def __init__(self):
        super().__init__()
        self.g, self.u = torch.nn.Linear(32, 48, bias=False), torch.nn.Linear(32, 48, bias=False)
        self.d = torch.nn.Linear(48, 32, bias=False)

    def forward(self, x):
        g = F.silu(self.g(x), inplace=True)
        g.mul_(self.u(x))
        return x + self.d(g)


def test_swiglu_written_in_place_is_one_gemm():
    model = _InPlaceSwiGLU().eval()
    x = torch.randn(2, 5, 32)
    ref = model(x)
    fast = apply(model, Plan(("gate_up_swiglu",)))
    torch.testing.assert_close(fast(x), ref)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["gate_up_swiglu"]["applied"] == 1, rows


def test_through_copies_sees_a_cat_into_another_layout():
    def fn(x):
        r = x.transpose(1, 2) * 2  # (B, H, T, D) strides of a transposed view
        return torch.cat([r, r[..., :0]], dim=-1) + 1  # contiguous: not the same layout
    gm = _traced(fn, torch.randn(2, 3, 4, 8))
    assert drop_identity_copies(gm) == 0
    cat = next(n for n in gm.graph.nodes if n.target is aten.cat.default)
    mul = next(n for n in gm.graph.nodes if n.target is aten.mul.Tensor)
    assert through_copies(cat) == (mul, [cat])
    assert through_copies(mul) == (mul, [])


class _DropoutBlock(torch.nn.Module):
    """o_proj, eval-mode dropout, residual add (Phi-3's spelling)."""

    def __init__(self, d=32):
        super().__init__()
        self.o = torch.nn.Linear(d, d, bias=False)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x, residual):
        return residual + self.drop(self.o(x))


def test_eval_dropout_between_a_projection_and_its_residual_add_is_fused():
    model = _DropoutBlock().eval()
    x, res = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    ref = model(x, res)
    fast = apply(model, Plan(("linear_residual",)))
    torch.testing.assert_close(fast(x, res), ref)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["linear_residual"]["applied"] == 1, rows
    # torch <= 2.13 traces eval dropout as a clone (dropped here); 2.14 traces nothing
    assert rows["(all)"]["identity_copies_dropped"] == int(torch.__version__ < "2.14"), rows


def _full_partial_rope(x, c, s):
    """Partial-rotary spelling whose rotary width is the whole head dim: x[..., 16:] is empty."""
    xr, xp = x[..., :16], x[..., 16:]
    half = torch.cat((-xr[..., 8:], xr[..., :8]), dim=-1)
    return torch.cat((xr * c + half * s, xp), dim=-1)


class _RopeAttention(torch.nn.Module):
    def forward(self, q, k, v, cos, sin):  # q (B, 4, T, 16), k/v (B, 2, T, 16), cos/sin (B, T, 16)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _full_partial_rope(q, c, s), _full_partial_rope(k, c, s)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _rope_inputs(t=5, b=2):
    g = torch.Generator().manual_seed(3)
    return (torch.randn(b, 4, t, 16, generator=g), torch.randn(b, 2, t, 16, generator=g),
            torch.randn(b, 2, t, 16, generator=g), torch.randn(b, t, 16, generator=g),
            torch.randn(b, t, 16, generator=g))


def test_rope_copied_by_an_empty_cat_folds_into_the_attention():
    model, x = _RopeAttention(), _rope_inputs()
    ref = model(*x)
    fast = apply(model, Plan(("attention_rope",)))
    torch.testing.assert_close(fast(*x), ref, atol=1e-4, rtol=1e-4)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["attention_rope"]["applied"] == 1, rows


class _CachedRope(torch.nn.Module):
    """A decode step writing the rotated k (through the empty cat) and v into static caches."""

    def forward(self, q, k, v, cos, sin, k_cache, v_cache, pos):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        q, k = _full_partial_rope(q, c, s), _full_partial_rope(k, c, s)
        k_cache.index_copy_(2, pos, k)
        v_cache.index_copy_(2, pos, v)
        return F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)


def test_rotated_k_copied_by_an_empty_cat_is_written_by_the_fused_cache_op():
    model, (q, k, v, cos, sin) = _CachedRope(), _rope_inputs(t=1)
    caches = [torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)]
    pos = torch.tensor([3])
    eager = [c.clone() for c in caches]
    ref = model(q, k, v, cos, sin, *eager, pos)
    fast = apply(model, Plan(("rope_kv_cache",)))
    torch.testing.assert_close(fast(q, k, v, cos, sin, *caches, pos), ref, atol=1e-4, rtol=1e-4)
    for live, want in zip(caches, eager):
        torch.testing.assert_close(live, want)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["rope_kv_cache"]["applied"] == 1, rows
