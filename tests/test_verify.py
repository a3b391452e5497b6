"""advisor.verify.judge: the whole-model verdict shared by tune and bench."""

from __future__ import annotations

import torch

from advisor.kernels.testing import max_violation, tolerance
from advisor.verify import judge


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(4, 1000, generator=g) * 3  # fp32 "exact" logits
    eager = (truth + 0.05 * torch.randn(truth.shape, generator=g)).bfloat16()  # rounding noise
    return truth, eager


def test_identical_and_within_tolerance_pass():
    truth, eager = _case()
    assert judge(eager.clone(), eager, torch.bfloat16, truth).ok
    v = judge(eager.clone(), eager, torch.bfloat16)  # no truth needed when element-wise close
    assert v.ok and v.max_error == 0 and v.reason == ""


def test_reordered_rounding_passes_only_with_an_fp32_truth():
    """Another rounding of the same computation: element-wise far from eager (beyond
    atol+rtol somewhere), as near the truth as eager is."""
    truth, eager = _case()
    g = torch.Generator().manual_seed(1)
    fused = (truth + 0.05 * torch.randn(truth.shape, generator=g)).bfloat16()
    assert max_violation(fused, eager, tolerance(torch.bfloat16, model=True)) > 0
    without = judge(fused, eager, torch.bfloat16)
    assert not without.ok and without.reason == "mismatch"
    with_truth = judge(fused, eager, torch.bfloat16, truth)
    assert with_truth.ok, with_truth.detail
    assert with_truth.rel_error_vs_fp32 is not None and with_truth.eager_rel_error_vs_fp32 is not None


def test_wrong_values_and_nans_fail():
    truth, eager = _case()
    wrong = judge((eager.float() * 1.5 + 0.1).bfloat16(), eager, torch.bfloat16, truth)
    assert not wrong.ok and wrong.reason == "mismatch" and "less accurate" in wrong.detail
    holes = eager.clone()
    holes.view(-1)[holes.numel() // 2:] = float("nan")
    nan = judge(holes, eager, torch.bfloat16, truth)
    assert not nan.ok and nan.reason == "nan"


def test_slightly_noisier_than_eager_fails():
    """Twice eager's distance from the truth is beyond the margin."""
    truth, eager = _case()
    g = torch.Generator().manual_seed(2)
    noisy = (truth + 0.1 * torch.randn(truth.shape, generator=g)).bfloat16()
    assert not judge(noisy, eager, torch.bfloat16, truth).ok


def test_tune_worker_judges_bf16_against_an_fp32_copy():
    """The worker's check (search/objective.py) on a real model in bf16: eager passes, a
    scaled output fails as mismatch, the fp32 copy is built once and leaves the model bf16."""
    import pytest

    from advisor.search.objective import TrialFailed, _forward, _inputs, _verify, load_context

    ctx = load_context("examples/tiny_llama.py", "cpu", torch.bfloat16, 1)
    ref = _forward(ctx.model, _inputs(ctx, 8, 3))
    assert _verify(ref.clone(), ref, ctx, 8, 3) == 0.0
    fp32 = ctx.fp32
    assert fp32 is not None and next(fp32.parameters()).dtype == torch.float32
    assert next(ctx.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(TrialFailed, match="mismatch"):
        _verify((ref.float() * 1.5 + 0.1).bfloat16(), ref, ctx, 8, 3)
    assert ctx.fp32 is fp32


def test_comparisons_in_slices_find_what_the_whole_tensor_shows(monkeypatch):
    """max_violation / max_abs_error work through float64 slices on the tensors' device
    (logits of 2048 x 128256 in one float64 copy on the host took seconds): the same
    answers when the worst element, a NaN or an inf sits in a later slice, and for a
    transposed view."""
    from advisor.kernels import testing

    tol = tolerance(torch.float32)
    ref = torch.randn(13, 11, generator=torch.Generator().manual_seed(2))
    out = ref + 1e-6
    out[12, 3] += 0.5  # the worst, in the last slice
    whole = (max_violation(out, ref, tol), testing.max_abs_error(out, ref))
    monkeypatch.setattr(testing, "CHUNK", 10)
    assert (max_violation(out, ref, tol), testing.max_abs_error(out, ref)) == whole
    assert abs(whole[1] - 0.5) < 1e-5
    nan = out.clone()
    nan[11, 0] = float("nan")
    assert max_violation(nan, ref, tol) == float("inf") and testing.max_abs_error(nan, ref) == float("inf")
    inf_ref, inf_out = ref.clone(), ref.clone()
    inf_ref[10, 1] = inf_out[10, 1] = float("inf")
    assert max_violation(inf_out, inf_ref, tol) <= 0
    inf_out[10, 1] = float("-inf")
    assert max_violation(inf_out, inf_ref, tol) == float("inf")
    assert max_violation(ref.t().contiguous().t(), ref, tol) <= 0  # strided view, same values
    assert testing.max_abs_error(torch.empty(0), torch.empty(0)) == 0.0
    # flattening must not make other shapes match: a (B·T, N) output for a (B, T, N) one
    assert testing.max_abs_error(ref.reshape(11, 13), ref) == float("inf")
    assert testing.max_abs_error(torch.empty(0), ref) == float("inf")
    assert max_violation(ref.reshape(11, 13), ref, tol) == float("inf")
