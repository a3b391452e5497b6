"""layer_norm_linear on hand-written modules: what may stand between a LayerNorm and the
projections it folds into, and what the op refuses (session 33's review, helper-38)."""

import pytest
import torch
from torch import nn

from advisor.errors import KernelInputError
from advisor.kernels import registry
from advisor.runtime.apply import apply
from advisor.runtime.plan import Plan

PLAN = Plan(("layer_norm_linear", "add_layer_norm_linear"))


def _affine(*norms: nn.LayerNorm) -> None:
    with torch.no_grad():  # random affine parameters: a dropped term shows
        for ln in norms:
            ln.weight.uniform_(0.5, 1.5)
            ln.bias.normal_()


class _TwoHeads(nn.Module):
    """h1 reads every row of ln1(x); h2 only the last row of ln2(x) (x: (M, 32) rows)."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(32), nn.LayerNorm(32)
        self.h1, self.h2 = nn.Linear(32, 48), nn.Linear(32, 48)

    def forward(self, x):
        return self.h1(self.ln1(x)), self.h2(self.ln2(x)[-1:])


def test_a_projection_of_some_rows_is_no_site_and_alike_inputs_do_not_share_a_check():
    # The sliced head had the full head's confirmation signature (same input shapes), so it
    # was fused unchecked and computed all M rows: (M, 48) where eager gives (1, 48).
    torch.manual_seed(0)
    model = _TwoHeads().eval()
    _affine(model.ln1, model.ln2)
    fast = apply(model, PLAN)
    for m in (4, 6):
        x = torch.randn(m, 32)
        for got, want in zip(fast(x), model(x)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    row = next(r for r in fast.summary() if r["family"] == "layer_norm_linear")
    assert row["applied"] == 1 and not row["unfused"], row  # h1 only


class _ConvFeatures(nn.Module):
    """Conv features transposed to (B, T, C), then LayerNorm -> projection (HuBERT-style)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(8, 32, 3, padding=1)
        self.ln, self.proj = nn.LayerNorm(32), nn.Linear(32, 48)

    def forward(self, x):  # (B, 8, T)
        return self.proj(self.ln(self.conv(x).transpose(1, 2)))


def test_a_norm_of_a_transposed_view_is_fused():
    # the emitted (M, K) view of x failed on these strides ("Cannot view a tensor ..."): reshape
    torch.manual_seed(0)
    model = _ConvFeatures().eval()
    _affine(model.ln)
    fast = apply(model, PLAN)
    for shape in ((2, 8, 6), (1, 8, 1), (3, 8, 9)):
        x = torch.randn(shape)
        torch.testing.assert_close(fast(x), model(x), atol=1e-5, rtol=1e-5)
    row = next(r for r in fast.summary() if r["family"] == "layer_norm_linear")
    assert row["applied"] > 0 and not row["unfused"], row


def test_the_op_refuses_unmatched_biases_and_leaves_wide_rows_to_the_reference():
    spec = registry.get("layernorm_linear")
    x, g, b, weights, biases, eps, act = spec.make_inputs(
        {"M": 2, "K": 24, "N": 8, "bias": 1}, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(1))
    with pytest.raises(KernelInputError, match="biases"):
        torch.ops.advisor.layernorm_linear(x, g, b, weights[:1], biases, eps, act, "")
    with pytest.raises(KernelInputError, match="biases"):
        torch.ops.advisor.rmsnorm_linear(x, g, weights, biases[:1], eps, 0.0, "")
    # wider rows than norm.py's LayerNorm kernel holds (2+ rows run it first): the reference
    wide = torch.empty(2, 32769)
    assert not spec.usable(wide, g, b, weights, biases, eps, act)
    assert spec.usable(wide[:, :32768], g, b, weights, biases, eps, act)


class _NormFc(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(32), nn.Linear(32, 48)

    def forward(self, x):  # (M, 32)
        return torch.relu(self.fc(self.ln(x)))


def test_the_price_counts_the_fused_ops_own_launches():
    """One row: the norm in the GEMV's prologue, one launch for LN + fc + bias + ReLU (eager:
    3). More rows: the LayerNorm kernel ahead of the GEMM, two."""
    from advisor.graph.candidates import Costs, candidates, matches_of
    from advisor.graph.capture import capture

    model = _NormFc().eval()
    removed = {}
    for m in (1, 6):
        found = candidates(matches_of(capture(model, (torch.randn(m, 32),))), Costs(8.0, 4000.0))
        removed[m] = next(c.launches_removed for c in found if c.family == "layer_norm_linear")
    assert removed == {1: 2, 6: 1}, removed
