"""Adapters over gemm.py for separate model weights: linear_swiglu and rmsnorm_linear."""

import pytest
import torch
import torch.nn.functional as F

from advisor.kernels import registry
from advisor.kernels.merged_linear import adjacent_view
from advisor.kernels.testing import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_launch_matches_reference_on_every_test_shape(dtype):
    spec = registry.get("linear_swiglu")
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), torch.Generator().manual_seed(3))
        assert adjacent_view(inputs[1]) is not None  # the registry hands adjacent weights
        ref = spec.reference(*inputs)
        for cfg in [None, *spec.space.configs(spec.problem(*inputs))[:1]]:
            out = spec.launch(*inputs, config=cfg)
            assert not torch.isnan(out).any()
            assert_close(out, ref)
        assert_close(spec.unfused_ops()(*inputs).float(), ref.float(), dtype)


def test_custom_op_and_separate_weights():
    spec = registry.get("linear_swiglu")
    x, (wg, wu), act = spec.make_inputs(spec.test_dims[1], torch.float32, torch.device("cpu"),
                                        torch.Generator().manual_seed(4))
    wg, wu = wg.clone(), wu.clone()  # not adjacent: still correct (one copy per call)
    out = torch.ops.advisor.linear_swiglu(x, [wg, wu], act, "")
    assert_close(out, spec.reference(x, [wg, wu], act))
    fn = torch.compile(lambda a, b, c: torch.ops.advisor.linear_swiglu(a, [b, c], act, ""),
                       backend="eager", fullgraph=True)
    assert_close(fn(x, wg, wu), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_linear_matches_reference_and_unfused(dtype):
    spec = registry.get("rmsnorm_linear")
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), torch.Generator().manual_seed(5))
        assert adjacent_view(inputs[2]) is not None and len(inputs[2]) >= 2
        ref = spec.reference(*inputs)
        out = spec.launch(*inputs)
        assert out.shape == ref.shape and not torch.isnan(out).any()
        assert_close(out, ref)
        if dtype == torch.float32:
            assert_close(spec.unfused_ops()(*inputs), ref)


def _default_first_and_split(spec, inputs, ref):
    """The default config, the space's first and its first split-K one each match `ref`."""
    configs = spec.space.configs(spec.problem(*inputs))
    split = [c for c in configs if c["SPLIT_K"] > 1][:1]
    for cfg in [None, *configs[:1], *split]:
        out = spec.launch(*inputs, config=cfg)
        assert out.shape == ref.shape and not torch.isnan(out).any()
        assert_close(out, ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rmsnorm_swiglu_matches_reference_on_both_paths(dtype):
    """Norm prologue and SwiGLU epilogue together: the GEMV path (M = 1, row scale inside
    the kernel) and the tensor-core path (row-scale pre-pass applied to both halves)."""
    spec = registry.get("rmsnorm_swiglu")
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), torch.Generator().manual_seed(6))
        assert adjacent_view(inputs[2]) is not None
        ref = spec.reference(*inputs)
        _default_first_and_split(spec, inputs, ref)
        if dtype == torch.float32:  # eager rounds n, gate, up and act: off by more in 16-bit
            assert_close(spec.unfused_ops()(*inputs), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_layernorm_linear_matches_reference_on_both_paths(dtype, monkeypatch):
    """LayerNorm in the GEMV's prologue (one row: each program's row stats, split K too, the
    PDL form with its first W tile peeled off) and norm.py's LayerNorm ahead of the GEMV
    (3 rows) or the tensor-core GEMM (17); with and without the norm's affine parameters and
    biases, and with an activation in the epilogue (one projection: fc1)."""
    from advisor.kernels import gemm
    spec = registry.get("layernorm_linear")
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), torch.Generator().manual_seed(7))
        assert adjacent_view(inputs[3]) is not None and len(inputs[3]) >= (1 if inputs[-1] != "none" else 2)
        ref = spec.reference(*inputs)
        _default_first_and_split(spec, inputs, ref)
        if dims["M"] == 1:
            monkeypatch.setattr(gemm, "PREFETCH_WITHOUT_PDL", True)
            assert_close(spec.launch(*inputs), ref)
            monkeypatch.setattr(gemm, "PREFETCH_WITHOUT_PDL", False)
        if dtype == torch.float32:  # eager rounds x̂ in 16-bit
            assert_close(spec.unfused_ops()(*inputs), ref)


def test_layernorm_linear_mean_heavy_rows_and_the_custom_op():
    """Rows whose mean dwarfs their spread (4000x: a residual stream's outlier offset): the
    GEMV's variance of centred values is as close to float64 as eager's (E[x²] - mean²
    would lose it all); mixed biases add zeros; the op traces under dynamo."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 3, 72, generator=gen) * 0.01 + 40.0  # (B, T, K): mean 40, std 0.01
    g, b = torch.randn(72, generator=gen), torch.randn(72, generator=gen)
    w1, w2 = torch.randn(16, 72, generator=gen) / 9, torch.randn(8, 72, generator=gen) / 9
    b1 = torch.randn(16, generator=gen)

    def eager(t):
        return torch.cat([F.linear(F.layer_norm(t, (72,), g.to(t), b.to(t), 1e-5), w.to(t),
                                   None if bias is None else bias.to(t))
                          for w, bias in ((w1, b1), (w2, None))], dim=-1)
    exact, ref = eager(x.double()), eager(x)
    for rows in (x[:1, :1], x[:, :1]):  # one row: the GEMV's own stats; two: norm.py's kernel
        out = torch.ops.advisor.layernorm_linear(rows, g, b, [w1, w2], [b1, None], 1e-5, "none", "")
        own_error = (eager(rows.double()) - eager(rows)).abs().max().item()  # eager's own, ~1e-3 here
        assert (out.double() - eager(rows.double())).abs().max().item() <= 2 * own_error + 1e-5
    fn = torch.compile(lambda a: torch.ops.advisor.layernorm_linear(a, g, b, [w1, w2], [b1, None], 1e-5, "none", ""),
                       backend="eager", fullgraph=True)
    assert (fn(x).double() - exact).abs().max().item() <= 2 * (exact - ref).abs().max().item() + 1e-5
    x = torch.randn(2, 3, 72, generator=gen) + 1.0  # a usual row: fp32 tolerance on both paths
    assert_close(fn(x[:, :1]), eager(x[:, :1]))
    assert_close(fn(x), eager(x))
