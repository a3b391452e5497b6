"""bias_act: the Triton kernel (interpreter on CPU) against `reference`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from advisor.errors import KernelInputError
from advisor.kernels import bias_act as ba
from advisor.kernels.gated_act import ACTIVATIONS
from advisor.kernels.registry import get
from advisor.kernels.space import encode
from advisor.kernels.testing import assert_close, nan_filled, randn_nonzero

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The interpreter evaluates sigmoid's exp(-x) in numpy, which warns where it overflows to inf
# (the result, 1/(1+inf) = 0, is right); compiled kernels do not warn.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = randn_nonzero(shape, dtype, "cpu", gen, 3.0)
    return x, randn_nonzero((shape[-1],), dtype, "cpu", gen)


@pytest.mark.parametrize("shape", [(3, 1000), (1, 4095)])
@pytest.mark.parametrize("activation", tuple(ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_every_element_written(shape, activation, dtype):
    x, bias = _inputs(shape, dtype)
    out = nan_filled(shape, dtype, x.device)
    assert ba.launch_bias_act(x, bias, activation, out=out) is out
    assert_close(out, ba.reference(x, bias, activation))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sum_is_rounded_like_eager(dtype):
    # relu is exact, so the kernel must equal eager `relu(x + b)` bit for bit: the sum is
    # rounded to the input dtype (ties to even) before the activation, as eager does.
    x, bias = _inputs((4, 1000), dtype, seed=5)
    want = F.relu(x + bias)
    assert torch.equal(ba.reference(x, bias, "relu"), want)
    assert torch.equal(ba.launch_bias_act(x, bias, "relu"), want)


def test_3d_batch_and_strided_rows():
    base, bias = _inputs((2, 3, 2 * 333), torch.bfloat16, seed=1)
    x, bias = base[..., :333], bias[:333]  # x: (B, T, N) view, row stride 2N
    assert_close(ba.launch_bias_act(x, bias, "gelu"), ba.reference(x, bias, "gelu"))
    x_t = x.transpose(0, 1)  # (T, B, N): leading dims do not merge, a copy is taken
    assert_close(ba.launch_bias_act(x_t, bias, "gelu"), ba.reference(x_t, bias, "gelu"))


def test_several_configs():
    x, bias = _inputs((5, 1000), torch.float16)
    configs = ba.SPACE.configs({"n_rows": 5, "n_cols": 1000, "dtype": "torch.float16"})
    assert len(configs) >= 2
    want = ba.reference(x, bias, "silu")
    for cfg in (configs[0], configs[len(configs) // 2], configs[-1]):
        assert_close(ba.launch_bias_act(x, bias, "silu", cfg), want)


@pytest.mark.parametrize(
    "rows, n, even", [(4, 1024, (True, True)), (5, 1024, (False, True)),
                      (4, 1000, (True, False)), (5, 1000, (False, False))]
)
def test_even_and_ragged_tiles(rows, n, even):
    """EVEN_M / EVEN_N pick the unmasked loads and stores per axis; every element is written
    and nothing past the output (a poisoned tail of the same buffer) is touched."""
    tile = {"BLOCK_M": 2, "BLOCK_N": 256, "num_warps": 1}
    x, bias = _inputs((rows, n), torch.bfloat16, seed=6)
    buf = nan_filled((rows + 3, n), torch.bfloat16, x.device)
    out = buf[:rows]
    _, meta, grid = ba._prepare(x, bias, out, "gelu_tanh", tile)
    assert {k: meta[k] for k in tile} == tile  # the config was kept, not replaced
    assert (meta["EVEN_M"], meta["EVEN_N"]) == even
    assert len(grid) == 1  # flattened grid, column tiles first (see gated_act.tile_index)
    ba.launch_bias_act(x, bias, "gelu_tanh", tile, out=out)
    assert_close(out, ba.reference(x, bias, "gelu_tanh"))
    assert torch.isnan(buf[rows:]).all()
    assert torch.equal(ba.launch_bias_act(x, bias, "relu", tile), F.relu(x + bias))


def test_custom_op_and_torch_compile():
    x, bias = _inputs((3, 1000), torch.bfloat16)
    cfg = encode(ba.SPACE.configs({"n_rows": 3, "n_cols": 1000})[0])
    want = ba.reference(x, bias, "gelu_tanh")
    assert_close(torch.ops.advisor.bias_act(x, bias, "gelu_tanh", cfg), want)

    def fn(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.ops.advisor.bias_act(x, b, "gelu_tanh", "") * 2

    got = torch.compile(fn, backend="eager", fullgraph=True)(x, bias)
    assert_close(got, want * 2)


def test_custom_op_falls_back_to_reference_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x, bias = _inputs((2, 9), torch.float32)
    got = torch.ops.advisor.bias_act(x, bias, "silu", "")
    assert torch.equal(got, ba.reference(x, bias, "silu"))


def test_empty_input_launches_nothing():
    assert ba.launch_bias_act(torch.empty(0, 77), torch.ones(77), "relu").shape == (0, 77)


def test_rejects_bad_input():
    x, bias = _inputs((2, 8), torch.float32)
    bad = [
        lambda: ba.launch_bias_act(x.int(), bias.int(), "silu"),  # dtype
        lambda: ba.launch_bias_act(x, bias.half(), "silu"),  # bias dtype
        lambda: ba.launch_bias_act(x, bias[:7], "silu"),  # bias width
        lambda: ba.launch_bias_act(x, x, "silu"),  # bias not 1-D
        lambda: ba.launch_bias_act(x, bias, "tanh"),  # unknown activation
        lambda: ba.launch_bias_act(x, bias, "silu", {"BLOCK_N": 64, "BLOCK_M": 3, "num_warps": 1}),
        lambda: ba.launch_bias_act(x, bias, "silu", out=torch.empty(8, 2).t()),  # out layout
    ]
    for call in bad:
        with pytest.raises(KernelInputError):
            call()


def test_registry_entry():
    spec = get("bias_act")
    gen = torch.Generator().manual_seed(3)
    for dims in spec.test_dims:
        for dtype in (torch.float32, torch.bfloat16):
            x, bias, act = spec.make_inputs(dims, dtype, torch.device("cpu"), gen)
            problem = spec.problem(x, bias, act)
            assert (problem["n_rows"], problem["n_cols"]) == (dims["rows"], dims["n"])
            elt = x.element_size()
            want_bytes = (2 * dims["rows"] * dims["n"] + dims["n"]) * elt
            assert spec.bytes_moved(x, bias, act) == want_bytes
            cfg = spec.space.configs(problem)[-1]
            assert_close(spec.launch(x, bias, act, config=cfg), spec.reference(x, bias, act))
            assert spec.spills(x, bias, act, config=cfg) is None
    assert spec.bench_dims(512) == {"rows": 512, "n": 14336}
    assert spec.unfused_launches == 2
