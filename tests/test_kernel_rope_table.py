"""rope_table (advisor/kernels/rope_table.py): RoPE's cos/sin tables in one launch, against
the eager reference through Triton's interpreter — HF's positions ⊗ inv_freq form and the
bmm form's transposed operands, with and without cat(f, f), scaled, every output dtype."""

import pytest
import torch
from torch.testing import assert_close

import advisor.kernels.rope_table  # noqa: F401  (registers the op)
from advisor.errors import KernelInputError
from advisor.kernels.registry import get
from advisor.kernels.rope_table import launch_rope_table, reference

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_registry_inputs_every_config(dtype):
    spec = get("rope_table")
    gen = torch.Generator().manual_seed(0)
    for dims in spec.test_dims:
        args = spec.make_inputs(dims, dtype, CPU, gen)
        problem = spec.problem(*args)
        configs = spec.space.configs(problem)
        assert len(configs) >= 2
        want = spec.reference(*args)
        for cfg in (configs[0], configs[-1]):
            got = spec.launch(*args, config=cfg)
            for g, w in zip(got, want):
                assert g.dtype == dtype and g.shape == w.shape and g.is_contiguous()
                assert_close(g, w)
        assert spec.spills(*args) is None
        assert spec.bytes_moved(*args) > 0


def test_bmm_form_operands_and_large_angles():
    """transformers' older spelling: (inv_freq[None, :, None] @ pos[:, None, :]).transpose(1, 2),
    i.e. f = Aᵀ·Pᵀ broadcast; positions up to 8191 (angles of thousands of radians)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, 64, 2).float() / 64))
    pos = torch.tensor([[3, 8191, 4000], [0, 1, 2]])
    a = inv[None, :, None].expand(2, -1, 1).transpose(1, 2)  # (2, 1, 32), stride 0 on dim 0
    b = pos[:, None, :].float().transpose(1, 2)  # (2, 3, 1)
    cos, sin = launch_rope_table(a, b, 1.0, 1.0, True, torch.float32)
    f = (inv[None, :, None].expand(2, -1, 1) @ pos[:, None, :].float()).transpose(1, 2)
    e = torch.cat((f, f), dim=-1)
    assert_close(cos, e.cos(), rtol=0, atol=2e-6)
    assert_close(sin, e.sin(), rtol=0, atol=2e-6)


def test_custom_op_matches_reference_and_fake():
    pos = torch.arange(5)[None, :, None]
    inv = torch.rand(6) + 0.1
    got = torch.ops.advisor.rope_table(pos, inv, 2.0, 0.5, True, torch.bfloat16, "")
    want = reference(pos, inv, 2.0, 0.5, True, torch.bfloat16)
    for g, w in zip(got, want):
        assert_close(g, w)
    compiled = torch.compile(lambda p, i: torch.ops.advisor.rope_table(p, i, 1.0, 1.0, False,
                                                                         torch.float16, ""),
                             backend="aot_eager", fullgraph=True)
    c, s = compiled(pos, inv)
    assert c.shape == (1, 5, 6) and c.dtype == torch.float16
    assert_close(s, reference(pos, inv, 1.0, 1.0, False, torch.float16)[1])


def test_rejects_bad_input():
    with pytest.raises(KernelInputError):
        launch_rope_table(torch.zeros(2, 3), torch.zeros(4), 1.0, 1.0, True, torch.float32)
    with pytest.raises(KernelInputError):
        launch_rope_table(torch.zeros(1, 1, 2, 3), torch.zeros(3), 1.0, 1.0, True, torch.float32)
    with pytest.raises(KernelInputError):
        launch_rope_table(torch.zeros(2, 1), torch.zeros(3), 1.0, 1.0, True, torch.int32)
