"""Adapters over gemm.py for separate model weights: linear_swiglu and rmsnorm_linear."""

import pytest
import torch

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rmsnorm_swiglu_matches_reference_on_both_paths(dtype):
    """Norm prologue and SwiGLU epilogue together: the GEMV path (M = 1, row scale inside
    the kernel) and the tensor-core path (row-scale pre-pass applied to both halves)."""
    spec = registry.get("rmsnorm_swiglu")
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), torch.Generator().manual_seed(6))
        assert adjacent_view(inputs[2]) is not None
        ref = spec.reference(*inputs)
        configs = spec.space.configs(spec.problem(*inputs))
        split = [c for c in configs if c["SPLIT_K"] > 1][:1]
        for cfg in [None, *configs[:1], *split]:
            out = spec.launch(*inputs, config=cfg)
            assert out.shape == ref.shape and not torch.isnan(out).any()
            assert_close(out, ref)
        if dtype == torch.float32:  # eager rounds n, gate, up and act: off by more in 16-bit
            assert_close(spec.unfused_ops()(*inputs), ref)
