"""Products with a weight spelled as einsum (graph/linear_forms.py) become nn.Linear's
mm(view(x), t(W)), which the linear patterns match, and so do products by a weight stored
(K, N) (`x @ W`, GPT-2's Conv1D), read through t(W); products that are not x's rows times a
weight are left as they are, and every graph still computes what it did."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from advisor.graph.linear_forms import products_as_linears
from advisor.graph.patterns.linear import find_linears, linear_at
from advisor.runtime.apply import apply
from advisor.runtime.plan import Plan

aten = torch.ops.aten


def _rewritten(fn, x, w, transposed_view: bool = False) -> tuple[int, int]:
    """(products rewritten, linears found after) in fn(x, w)'s graph, w a weight; the graph
    still computes fn. `transposed_view`: count the linears reading t(W) of a W stored
    (K, N) instead (which `find_linears`, for merges, leaves out)."""
    gm = make_fx(fn, tracing_mode="fake")(x, w)
    params = {[n for n in gm.graph.nodes if n.op == "placeholder"][1].name: "w"}
    n = products_as_linears(gm, params)
    torch.testing.assert_close(gm(x, w), fn(x, w))
    if transposed_view:
        return n, sum(1 for node in gm.graph.nodes
                      if (lin := linear_at(node, params)) is not None and lin.transposed_view)
    return n, len(find_linears(gm, params))


X, W = torch.randn(2, 5, 8), torch.randn(6, 8)  # x (B, T, K), W (N, K)


@pytest.mark.parametrize("fn", [
    lambda x, w: torch.einsum("btk,nk->btn", x, w),
    lambda x, w: torch.einsum("...k,nk->...n", x, w),
    lambda x, w: torch.einsum("bti,oi->bto", x, w) + 1.0,
])
def test_einsum_by_a_weights_transpose_becomes_a_linear(fn):
    assert _rewritten(fn, X, W) == (1, 1)


def test_two_dimensional_rows_too():
    assert _rewritten(lambda x, w: torch.einsum("mk,nk->mn", x, w), X[0], W) == (1, 1)


def test_nn_linears_form_is_left_alone():
    assert _rewritten(lambda x, w: F.linear(x, w), X, W) == (0, 1)
    assert _rewritten(lambda x, w: x @ w.T, X, W) == (0, 1)


@pytest.mark.parametrize("fn", [
    lambda x, w: torch.einsum("btk,kn->btn", x, w),
    lambda x, w: x @ w,
    lambda x, w: torch.matmul(x.reshape(-1, 8), w),
    lambda x, w: x.reshape(-1, 8).mm(w) * 2.0,
])
def test_products_by_a_weight_stored_k_by_n_read_it_through_its_transpose(fn):
    assert _rewritten(fn, X, W.T.contiguous(), transposed_view=True) == (1, 1)


@pytest.mark.parametrize("fn, w", [
    (lambda x, w: torch.einsum("btk,nk->btn", x, w[:3]), W),  # a slice of the weight
    (lambda x, w: x @ w[:, :3], W.T.contiguous()),  # columns of a (K, N) weight
    (lambda x, w: torch.einsum("btk,nk->btn", x, w[:, :4].expand(6, 4).repeat(1, 2)), W),  # a copy
])
def test_other_products_with_a_parameter_are_left_as_they_are(fn, w):
    assert _rewritten(fn, X, w)[0] == 0


@pytest.mark.parametrize("spec", ["tbk,nk->btn", "tbk,nk->tbn", "btk,nk->bnt"])
def test_outputs_in_another_order_keep_their_permute(spec):
    # the product's rows are x's in x's order; the output's order is the views' after it
    assert _rewritten(lambda x, w: torch.einsum(spec, x, w), X, W) == (1, 1)


@pytest.mark.parametrize("fn", [
    lambda x, w: torch.einsum("btk,nk->btn", x, w)[:, :-1].reshape(-1, 6),  # next-token logits
    lambda x, w: torch.einsum("btk,nk->btn", x, w)[:, :1].reshape(-1),
    lambda x, w: torch.einsum("btk,nk->btn", x, w)[0].reshape(-1),
])
@pytest.mark.parametrize("batch", [1, 2])
def test_a_reshape_of_part_of_the_product_keeps_reading_that_part(fn, batch):
    # a slice from the start is contiguous at offset 0 too: the reshape after it must not
    # be re-pointed at the whole product (review, session 26)
    assert _rewritten(fn, X[:batch], W) == (1, 1)


def test_batched_products_of_activations_are_not_linears():
    q, k = torch.randn(2, 5, 8), torch.randn(2, 6, 8)
    gm = make_fx(lambda q, k: torch.einsum("btk,bsk->bts", q, k), tracing_mode="fake")(q, k)
    assert products_as_linears(gm, {}) == 0


class _EinsumMLP(torch.nn.Module):
    """A hand-written RMSNorm → SwiGLU MLP whose projections are einsums over (N, K) weights."""

    def __init__(self, d=16, f=24):
        super().__init__()
        self.norm = torch.nn.Parameter(torch.rand(d) + 0.5)
        self.gate, self.up = torch.nn.Parameter(torch.randn(f, d) / 4), torch.nn.Parameter(torch.randn(f, d) / 4)
        self.down = torch.nn.Parameter(torch.randn(d, f) / 5)

    def forward(self, x):
        h = self.norm * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        g = torch.einsum("btd,fd->btf", h, self.gate)
        u = torch.einsum("btd,fd->btf", h, self.up)
        return x + torch.einsum("btf,df->btd", F.silu(g) * u, self.down)


def test_einsum_projections_fuse_in_a_model():
    torch.manual_seed(0)
    model = _EinsumMLP().eval()
    x = torch.randn(2, 7, 16)
    ref = model(x)
    fast = apply(model, Plan(("rms_norm_swiglu", "linear_residual")))
    torch.testing.assert_close(fast(x), ref, rtol=1e-4, atol=1e-4)
    applied = {r["family"]: r["applied"] for r in fast.summary() if r["family"] != "(all)"}
    assert applied == {"rms_norm_swiglu": 1, "linear_residual": 1}, applied


def _conv1d(x, w, b):
    """GPT-2's Conv1D: w stored (K, N), addmm(b, x's rows, w), viewed back."""
    return torch.addmm(b, x.view(-1, x.size(-1)), w).view(*x.shape[:-1], w.size(-1))


class _Conv1DBlock(torch.nn.Module):
    """A GPT-2-style MLP over Conv1D weights, and two Conv1Ds of one input (no merge: a
    merged (ΣN, K) buffer cannot hold (K, N) parameters)."""

    def __init__(self, d=16, f=40):
        super().__init__()
        torch.manual_seed(0)
        self.w_fc, self.b_fc = torch.nn.Parameter(torch.randn(d, f) / 4), torch.nn.Parameter(torch.randn(f) / 4)
        self.w_proj, self.b_proj = torch.nn.Parameter(torch.randn(f, d) / 6), torch.nn.Parameter(torch.randn(d) / 4)
        self.w_a, self.b_a = torch.nn.Parameter(torch.randn(d, d) / 4), torch.nn.Parameter(torch.randn(d) / 4)
        self.w_b, self.b_b = torch.nn.Parameter(torch.randn(d, d) / 4), torch.nn.Parameter(torch.randn(d) / 4)

    def forward(self, x):
        h = x + _conv1d(F.gelu(_conv1d(x, self.w_fc, self.b_fc), approximate="tanh"), self.w_proj, self.b_proj)
        return h + _conv1d(h, self.w_a, self.b_a) * _conv1d(h, self.w_b, self.b_b)


def test_conv1d_projections_take_their_epilogues_and_are_never_merged():
    model = _Conv1DBlock().eval()
    x = torch.randn(2, 7, 16)
    ref = model(x)
    fast = apply(model, Plan(("linear_bias_act", "linear_residual", "linear_merge")))
    torch.testing.assert_close(fast(x), ref, rtol=1e-4, atol=1e-4)
    rows = [r for r in fast.summary() if r["family"] != "(all)"]
    applied = {r["family"]: r["applied"] for r in rows if r.get("applied")}
    assert applied == {"linear_bias_act": 1, "linear_residual": 1}, rows
    assert not [r for r in rows if r.get("unfused")], rows


def test_a_bias_that_is_not_n_wide_is_no_linears():
    """addmm broadcasts a (1, N) or (1,) bias; the GEMM epilogues add an (N,) one: such a
    product is no linear (it was offered, then refused by the kernel's input check), in
    either weight layout."""
    class Broadcast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_kn, self.w_nk = torch.nn.Parameter(torch.randn(16, 16) / 4), torch.nn.Parameter(torch.randn(16, 16) / 4)
            self.b_row, self.b_one = torch.nn.Parameter(torch.randn(1, 16) / 10), torch.nn.Parameter(torch.randn(1) / 10)

        def forward(self, x):
            rows = x.reshape(-1, 16)
            h = x + torch.addmm(self.b_row, rows, self.w_kn).view_as(x)
            return h + F.gelu(torch.addmm(self.b_one, rows, self.w_nk.t())).view_as(x)

    model, x = Broadcast().eval(), torch.randn(2, 5, 16)
    fast = apply(model, Plan(("linear_bias_act", "linear_residual")))
    torch.testing.assert_close(fast(x), model(x))
    rows = [r for r in fast.summary() if r["family"] != "(all)"]
    assert not [r for r in rows if r["applied"] or r["unfused"]], rows


def test_weight_layouts_are_confirmed_and_timed_apart():
    """An (N, K) weight and t(W) of a (K, N) one, equal shapes: one site signature each
    (confirmation and the probe's timing run each layout as it will run)."""
    from advisor.graph.capture import capture
    from advisor.graph.patterns import find_all
    from advisor.runtime.rewrite import site_signature

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w_nk, self.w_kn = torch.nn.Parameter(torch.randn(24, 16)), torch.nn.Parameter(torch.randn(16, 24))
            self.b1, self.b2 = torch.nn.Parameter(torch.randn(24)), torch.nn.Parameter(torch.randn(24))

        def forward(self, x, y):
            return F.gelu(F.linear(x, self.w_nk, self.b1)), F.gelu(_conv1d(y, self.w_kn, self.b2))

    part = capture(Two().eval(), (torch.randn(2, 5, 16), torch.randn(2, 5, 16))).parts[0]
    sites = [m for m in find_all(part.gm, part.params) if m.family == "linear_bias_act"]
    assert len(sites) == 2 and site_signature(sites[0], "") != site_signature(sites[1], "")
