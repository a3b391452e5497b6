"""gemm_epilogue / gemm_swiglu / gemm_rmsnorm: the Triton GEMM (interpreter on CPU) vs reference.

Sizes are tiny (M in {1, 3, 17}, K in {24, 40}, N in {8, 40}): every tile is masked on
some side, since tl.dot blocks are >= 16 wide.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton

from advisor.errors import KernelInputError
from advisor.kernels import gemm
from advisor.kernels._triton import tma_ok
from advisor.kernels.registry import get
from advisor.kernels.space import encode
from advisor.kernels.testing import assert_close, randn_nonzero

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The interpreter evaluates sigmoid's exp(-x) in numpy, which warns where it overflows to inf.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _rand(shape, dtype, seed, scale=1.0):
    return randn_nonzero(shape, dtype, "cpu", torch.Generator().manual_seed(seed), scale)


def _xw(m, k, n, dtype, seed=0):
    """x (m, k) ~ N(0, 4) (reaches every activation's tails), w (n, k) ~ N(0, 1/k)."""
    return _rand((m, k), dtype, seed, 2.0), _rand((n, k), dtype, seed + 1, k ** -0.5)


def _split(k_cfg: dict, split: int, block_k: int = 32) -> dict:
    return {**k_cfg, "SPLIT_K": split, "BLOCK_K": block_k}


def _cfg(m, n, k, dtype, gated=False, **over):
    problem = {"M": m, "N": n, "K": k, "dtype": str(dtype), "gated": int(gated)}
    return {**gemm.SPACE.default(problem), **over}


@pytest.mark.parametrize("activation", list(gemm.GEMM_ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_epilogue_every_activation_and_dtype(activation, dtype):
    x, w = _xw(17, 40, 40, dtype)
    b, r = _rand((40,), dtype, 5, 0.5), _rand((17, 40), dtype, 6)
    out = gemm.launch_gemm_epilogue(x, w, b, r, activation)
    assert_close(out, gemm.reference(x, w, b, r, activation))


@pytest.mark.parametrize("bias, residual", [(False, False), (True, False), (False, True)])
@pytest.mark.parametrize("m, k, n", [(1, 24, 8), (3, 40, 40)])
def test_epilogue_bias_residual_combinations(bias, residual, m, k, n):
    x, w = _xw(m, k, n, torch.float16)
    b = _rand((n,), torch.float16, 7) if bias else None
    r = _rand((m, n), torch.float16, 8) if residual else None
    assert_close(gemm.launch_gemm_epilogue(x, w, b, r, "gelu"), gemm.reference(x, w, b, r, "gelu"))


def test_reference_is_eager_math():
    x, w = _xw(3, 24, 8, torch.float32)
    b, r = _rand((8,), torch.float32, 2), _rand((3, 8), torch.float32, 3)
    torch.testing.assert_close(gemm.reference(x, w, b, r, "silu"), F.silu(F.linear(x, w, b)) + r)
    wg, wu = w.chunk(2)
    torch.testing.assert_close(gemm.reference_swiglu(x, w, "gelu_tanh"),
                               F.gelu(x @ wg.T, approximate="tanh") * (x @ wu.T))
    g = _rand((24,), torch.float32, 4)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + g)
    torch.testing.assert_close(gemm.reference_rmsnorm(x, g, w, 1e-6, 1.0), normed @ w.T)


@pytest.mark.parametrize("activation", list(gemm.ACTIVATIONS))
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_every_activation_and_dtype(activation, dtype):
    for m, k, n in ((3, 24, 8), (17, 40, 40)):
        x, w_gu = _xw(m, k, 2 * n, dtype)
        out = gemm.launch_gemm_swiglu(x, w_gu, activation)
        assert out.shape == (m, n)
        assert_close(out, gemm.reference_swiglu(x, w_gu, activation))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("m", [9, 17])  # the norm in the GEMM's prologue / in a pre-pass
def test_rmsnorm_exact_scales(dtype, offset, m):
    """g + offset = ±2^j makes x·g exact in every dtype, so only fp32 rounding remains
    (and, past NORM_IN_GEMM_MAX_M rows, x̂'s one rounding to the dtype)."""
    x, w = _xw(m, 40, 40, dtype)
    power = torch.randint(-1, 2, (40,), generator=torch.Generator().manual_seed(9))
    g = (torch.sign(_rand((40,), torch.float32, 10)) * 2.0 ** power - offset).to(dtype)
    out = gemm.launch_gemm_rmsnorm(x, g, w, 1e-6, offset)
    assert_close(out, gemm.reference_rmsnorm(x, g, w, 1e-6, offset))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_random_scale_and_fp32_norm_weight(dtype):
    x, w = _xw(3, 40, 8, dtype)
    for g in (_rand((40,), dtype, 11, 0.5), _rand((40,), torch.float32, 12, 0.5)):
        assert_close(gemm.launch_gemm_rmsnorm(x, g, w, 1e-5, 0.0),
                     gemm.reference_rmsnorm(x, g, w, 1e-5, 0.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("split, k", [(2, 40), (4, 40), (4, 128), (8, 250)])
def test_split_k_every_op(dtype, split, k):
    """BLOCK_K=32 slices: K=40 ragged (and empty slices at SPLIT_K=4); K=128 four full
    EVEN_K slices; K=250 eight slices, the last ragged."""
    m, n = (1, 40) if split != 2 else (3, 8)
    x, w = _xw(m, k, n, dtype)
    b, r = _rand((n,), dtype, 3), _rand((m, n), dtype, 4)
    cfg = _split(_cfg(m, n, k, dtype), split)
    assert_close(gemm.launch_gemm_epilogue(x, w, b, r, "silu", cfg),
                 gemm.reference(x, w, b, r, "silu"))
    x2, w_gu = _xw(m, k, 2 * n, dtype, seed=3)
    assert_close(gemm.launch_gemm_swiglu(x2, w_gu, "gelu", cfg),
                 gemm.reference_swiglu(x2, w_gu, "gelu"))
    g = _rand((k,), dtype, 5, 0.5)
    assert_close(gemm.launch_gemm_rmsnorm(x, g, w, 1e-6, 1.0, cfg),
                 gemm.reference_rmsnorm(x, g, w, 1e-6, 1.0))


@pytest.mark.parametrize("op", ["epilogue", "swiglu", "rmsnorm"])
def test_two_configs_from_the_space(op):
    m, k, n = 17, 40, 40
    x, w = _xw(m, k, 2 * n if op == "swiglu" else n, torch.bfloat16)
    configs = gemm.SPACE.configs({"M": m, "N": n, "K": k, "dtype": "torch.bfloat16",
                                  "gated": int(op == "swiglu")})
    assert len(configs) >= 2
    g = _rand((k,), torch.bfloat16, 6, 0.5)
    for cfg in (configs[0], configs[-1]):
        if op == "epilogue":
            assert_close(gemm.launch_gemm_epilogue(x, w, None, None, "relu", cfg),
                         gemm.reference(x, w, None, None, "relu"))
        elif op == "swiglu":
            assert_close(gemm.launch_gemm_swiglu(x, w, "silu", cfg),
                         gemm.reference_swiglu(x, w, "silu"))
        else:
            assert_close(gemm.launch_gemm_rmsnorm(x, g, w, 1e-6, 0.0, cfg),
                         gemm.reference_rmsnorm(x, g, w, 1e-6, 0.0))


def test_3d_batch_and_strided_operands():
    x, w = _xw(6, 24, 40, torch.float16)
    x3 = x.view(2, 3, 24)  # (B, T, K)
    r3 = _rand((2, 3, 40), torch.float16, 7)
    out = gemm.launch_gemm_epilogue(x3, w, None, r3, "none")
    assert out.shape == (2, 3, 40)
    assert_close(out, gemm.reference(x3, w, None, r3, "none"))
    # a row-strided slice of x; x and W column-major; two K-steps (K=40, BLOCK_K=32)
    wide, w40 = _xw(6, 64, 40, torch.float16, seed=8)
    cfg = _cfg(6, 40, 40, torch.float16, BLOCK_K=32)
    for xs in (wide[:, 8:48], wide[:, 8:48].t().contiguous().t()):  # strides (64, 1), (1, 6)
        wt = w40[:, :40].t().contiguous().t()  # (40, 40) stride (1, 40)
        assert_close(gemm.launch_gemm_epilogue(xs, wt, None, None, "relu", cfg),
                     gemm.reference(xs, wt, None, None, "relu"))
    xt = x3.transpose(0, 1)  # (T, B, K): reshape copies
    wt = w.t().contiguous().t()
    assert_close(gemm.launch_gemm_swiglu(xt, w, "silu"), gemm.reference_swiglu(xt, w, "silu"))
    g = _rand((24,), torch.float16, 9, 0.5)
    assert_close(gemm.launch_gemm_rmsnorm(xt, g, wt, 1e-6, 0.0),
                 gemm.reference_rmsnorm(xt, g, wt, 1e-6, 0.0))


def test_custom_ops_and_torch_compile():
    x, w = _xw(3, 40, 40, torch.bfloat16)
    b, r, g = _rand((40,), torch.bfloat16, 1), _rand((3, 40), torch.bfloat16, 2), _rand(
        (40,), torch.bfloat16, 3, 0.5)
    cfg = encode(_split(_cfg(3, 20, 40, torch.bfloat16, gated=True), 2))
    assert_close(torch.ops.advisor.gemm_epilogue(x, w, b, r, "gelu_tanh", ""),
                 gemm.reference(x, w, b, r, "gelu_tanh"))
    assert_close(torch.ops.advisor.gemm_swiglu(x, w, "silu", cfg), gemm.reference_swiglu(x, w, "silu"))
    assert_close(torch.ops.advisor.gemm_rmsnorm(x, g, w, 1e-6, 0.0, ""),
                 gemm.reference_rmsnorm(x, g, w, 1e-6, 0.0))

    def block(x, w, b, r, g):
        h = torch.ops.advisor.gemm_rmsnorm(x, g, w, 1e-6, 0.0, "")
        h = torch.ops.advisor.gemm_epilogue(h, w, b, r, "none", "")
        return torch.ops.advisor.gemm_swiglu(h, w, "silu", cfg)

    got = torch.compile(block, backend="eager", fullgraph=True)(x, w, b, r, g)
    assert got.shape == (3, 20)
    assert torch.equal(got, block(x, w, b, r, g))  # the same kernels, traced by dynamo


def test_custom_ops_fall_back_to_reference_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, no interpreter: eager path
    x, w = _xw(2, 24, 8, torch.float32)
    g = _rand((24,), torch.float32, 1)
    assert torch.equal(torch.ops.advisor.gemm_epilogue(x, w, None, None, "relu", ""),
                       gemm.reference(x, w, None, None, "relu"))
    assert torch.equal(torch.ops.advisor.gemm_swiglu(x, w, "silu", ""),
                       gemm.reference_swiglu(x, w, "silu"))
    assert torch.equal(torch.ops.advisor.gemm_rmsnorm(x, g, w, 1e-6, 0.0, ""),
                       gemm.reference_rmsnorm(x, g, w, 1e-6, 0.0))


def test_empty_rows_launch_nothing():
    x, w = torch.empty(2, 0, 24), torch.randn(8, 24)
    assert gemm.launch_gemm_epilogue(x, w).shape == (2, 0, 8)
    assert gemm.launch_gemm_swiglu(x, w).shape == (2, 0, 4)
    assert gemm.launch_gemm_rmsnorm(x, torch.ones(24), w, 1e-6).shape == (2, 0, 8)


def test_rejects_bad_input():
    x, w = _xw(3, 24, 8, torch.float32)
    ok = _cfg(3, 8, 24, torch.float32)
    bad = [
        lambda: gemm.launch_gemm_epilogue(x.int(), w.int()),  # dtype
        lambda: gemm.launch_gemm_epilogue(x, w.half()),  # mixed dtypes
        lambda: gemm.launch_gemm_epilogue(x, w[:, :23]),  # K mismatch
        lambda: gemm.launch_gemm_epilogue(x, w[0]),  # 1-D weight
        lambda: gemm.launch_gemm_epilogue(x[:, :0], w[:, :0]),  # K = 0
        lambda: gemm.launch_gemm_epilogue(x, w, torch.ones(7)),  # bias shape
        lambda: gemm.launch_gemm_epilogue(x, w, None, torch.ones(3, 7)),  # residual shape
        lambda: gemm.launch_gemm_epilogue(x, w, None, None, "swish"),  # activation
        lambda: gemm.launch_gemm_swiglu(x, w[:7]),  # odd merged rows
        lambda: gemm.launch_gemm_swiglu(x, w, "none"),  # swiglu needs an activation
        lambda: gemm.launch_gemm_rmsnorm(x, torch.ones(23), w, 1e-6),  # norm_w shape
        lambda: gemm.launch_gemm_epilogue(x, w, config={"BLOCK_M": 16}),  # missing axes
        lambda: gemm.launch_gemm_epilogue(x, w, config={**ok, "SPLIT_K": 3}),  # off the axis
    ]
    for call in bad:
        with pytest.raises(KernelInputError):
            call()


@pytest.mark.parametrize("m", [1, 4, 16, 17, 64, 128, 512, 2048, 8192])
@pytest.mark.parametrize("dtype", ["torch.bfloat16", "torch.float32"])
def test_space_bounded_default_kept_fits_smem(m, dtype):
    for name in ("gemm_epilogue", "gemm_swiglu", "gemm_rmsnorm"):
        spec = get(name)
        dims = spec.bench_dims(m)
        gated = int(name == "gemm_swiglu")
        problem = {"M": m, "N": dims["N"], "K": dims["K"], "dtype": dtype, "gated": gated}
        configs = spec.space.configs(problem)
        assert 1 <= len(configs) <= 96  # x2 past 16 rows: the TMA axis
        assert spec.space.default(problem) in configs
        elt = 4 if dtype.endswith("32") else 2
        for c in configs:
            tile = c["BLOCK_M"] * c["BLOCK_K"] + (1 + gated) * c["BLOCK_N"] * c["BLOCK_K"]
            assert tile * elt * c["num_stages"] <= gemm.SMEM_BUDGET
            # M <= 4: the GEMV path holds every row (BLOCK_M = M rounded up); M <= 16:
            # 16-row tensor-core tiles
            if m <= gemm.GEMV_MAX_M:
                assert c["BLOCK_M"] == triton.next_power_of_2(m)
            elif m <= 16:
                assert c["BLOCK_M"] == 16
    # The H200 probe's best configs (benchmarks/results/h200-gemv-probe-2026-12-03.json)
    def gemv(n, k, gated=0):
        c = gemm.SPACE.default({"M": 1, "N": n, "K": k, "dtype": "torch.bfloat16", "gated": gated})
        return c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"], c["SPLIT_K"]
    assert gemv(4096, 4096) == gemv(4096, 14336) == (1, 32, 256, 4)  # o_proj, down_proj
    assert gemv(1024, 4096) == (1, 16, 256, 4)  # k_proj alone: 64 tiles, split K to fill
    assert gemv(14336, 4096, gated=1) == (1, 8, 256, 1)  # gate/up + SwiGLU


def _gemv(m, k, n, dtype, gated=False, **over):
    cfg = _cfg(m, n, k, dtype, gated, **over)
    problem = {"M": m, "N": n, "K": k, "dtype": str(dtype), "gated": int(gated)}
    assert cfg["BLOCK_M"] < 16 and gemm.keep(cfg, problem), cfg  # the GEMV path, as asked
    return cfg


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, split, block_k", [(1, 512, 1, 128), (2, 520, 2, 128), (3, 1030, 4, 128),
                                                  (4, 40, 1, 64), (1, 1030, 2, 256)])
def test_gemv_every_op(dtype, m, k, split, block_k):
    """The GEMV path (M <= 4): EVEN_K (512 / 128) and ragged K, split-K slices, all three ops,
    N = 40 (wrapped W rows, masked stores); gemm_rmsnorm computes its row scales inline."""
    n = 40
    x, w = _xw(m, k, n, dtype)
    b, r = _rand((n,), dtype, 3), _rand((m, n), dtype, 4)
    cfg = _gemv(m, k, n, dtype, SPLIT_K=split, BLOCK_K=block_k)
    assert_close(gemm.launch_gemm_epilogue(x, w, b, r, "silu", cfg), gemm.reference(x, w, b, r, "silu"))
    assert_close(gemm.launch_gemm_epilogue(x, w, None, None, "none", cfg), gemm.reference(x, w, None, None, "none"))
    x2, w_gu = _xw(m, k, 2 * n, dtype, seed=3)
    cfg_g = _gemv(m, k, n, dtype, gated=True, SPLIT_K=split, BLOCK_K=block_k)
    assert_close(gemm.launch_gemm_swiglu(x2, w_gu, "gelu", cfg_g), gemm.reference_swiglu(x2, w_gu, "gelu"))
    g = _rand((k,), dtype, 5, 0.5)
    for offset in (0.0, 1.0):
        assert_close(gemm.launch_gemm_rmsnorm(x, g, w, 1e-6, offset, cfg),
                     gemm.reference_rmsnorm(x, g, w, 1e-6, offset))


@pytest.mark.parametrize("m, k, split", [(1, 1152, 4), (3, 1030, 2)])
def test_gemv_pdl_prefetch_path(monkeypatch, m, k, split):
    """The code a PDL launch runs (first W tile loaded before the wait, the K loop from the
    second step), here without PDL: ragged K, and K = 9·128 split 4 ways, whose last slice
    (k_lo = K) is empty and must add nothing."""
    monkeypatch.setattr(gemm, "PREFETCH_WITHOUT_PDL", True)
    n, dtype = 40, torch.bfloat16
    x, w = _xw(m, k, n, dtype)
    r = _rand((m, n), dtype, 4)
    cfg = _gemv(m, k, n, dtype, SPLIT_K=split, BLOCK_K=128)
    assert_close(gemm.launch_gemm_epilogue(x, w, None, r, "none", cfg), gemm.reference(x, w, None, r, "none"))
    x2, w_gu = _xw(m, k, 2 * n, dtype, seed=3)
    cfg_g = _gemv(m, k, n, dtype, gated=True, SPLIT_K=split, BLOCK_K=128)
    assert_close(gemm.launch_gemm_swiglu(x2, w_gu, "silu", cfg_g), gemm.reference_swiglu(x2, w_gu, "silu"))
    g = _rand((k,), dtype, 5, 0.5)
    assert_close(gemm.launch_gemm_rmsnorm(x, g, w, 1e-6, 1.0, cfg), gemm.reference_rmsnorm(x, g, w, 1e-6, 1.0))


def test_pdl_only_on_sm90_cuda_inside_the_plan_option():
    """PDL launch options: off by default, off on the CPU/interpreter even when a plan asks."""
    from advisor.kernels._triton import pdl_launch, programmatic_launch

    x = torch.zeros(2)
    assert pdl_launch(x) == {"GDC": False}
    with programmatic_launch(True):
        assert pdl_launch(x) == {"GDC": False}
        with programmatic_launch(False):
            assert pdl_launch(x) == {"GDC": False}


def test_gemv_strided_x():
    """x as a strided view (a row of a wider buffer, e.g. the last position of a prefill),
    bf16."""
    base = _rand((2, 3, 100), torch.bfloat16, 0, 2.0)
    x = base[:, -1, 4:68]  # (2, 64), row stride 300
    w = _rand((24, 64), torch.bfloat16, 1, 0.125)
    cfg = _gemv(2, 64, 24, torch.bfloat16)
    out = gemm.launch_gemm_epilogue(x, w, None, None, "none", cfg)
    assert_close(out, gemm.reference(x, w, None, None, "none"))
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_weight_stored_k_by_n(dtype):
    """W stored (K, N) (GPT-2's Conv1D), read as t(W): strides (1, N), odd sizes, bias and
    GELU in the epilogue, one row and a few (split-K too)."""
    w_kn = _rand((45, 37), dtype, 1, 0.25)  # (K, N)
    w, b = w_kn.t(), _rand((37,), dtype, 2)  # (N, K), strides (1, 37)
    for m in (1, 3):
        x = _rand((m, 45), dtype, 3)
        for cfg in (_gemv(m, 45, 37, dtype), _split(_gemv(m, 45, 37, dtype), 2)):
            assert_close(gemm.launch_gemm_epilogue(x, w, b, None, "gelu_tanh", cfg),
                         gemm.reference(x, w, b, None, "gelu_tanh"))


@pytest.mark.parametrize("name", ["gemm_epilogue", "gemm_swiglu", "gemm_rmsnorm"])
def test_registry_entry(name):
    spec = get(name)
    gen = torch.Generator().manual_seed(3)
    for dims in spec.test_dims:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), gen)
            problem = spec.problem(*inputs)
            m, k, n = dims["M"], dims["K"], dims["N"]
            assert (problem["M"], problem["K"], problem["N"]) == (m, k, n)
            elt = inputs[0].element_size()
            extra = {"gemm_epilogue": dims.get("bias", 0) * n + dims.get("residual", 0) * m * n,
                     "gemm_swiglu": n * k, "gemm_rmsnorm": k}[name]
            assert spec.bytes_moved(*inputs) == (m * k + n * k + m * n + extra) * elt
            for cfg in spec.space.configs(problem)[:2]:
                assert_close(spec.launch(*inputs, config=cfg), spec.reference(*inputs))
                assert spec.spills(*inputs, config=cfg) is None  # interpreter: nothing compiled
    assert spec.bench_dims(2048)["M"] == 2048 and spec.bench_dims(1)["K"] == 4096
    assert spec.unfused_launches >= 2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, split, pdl_path", [(1, 1, False), (3, 2, True), (17, 1, False)])
def test_gated_linear_prologue(monkeypatch, dtype, m, split, pdl_path):
    """(act(gate)·up)·Wᵀ + residual with gate/up the strided halves of a merged [g | u]:
    the GEMV path computes the product in its prologue (also the PDL code path, split K);
    at 17 rows the gated_act kernel runs first, then the tensor-core GEMM."""
    monkeypatch.setattr(gemm, "PREFETCH_WITHOUT_PDL", pdl_path)
    k, n = 1030, 40
    gu = _rand((m, 2 * k), dtype, 7, 2.0)
    gate, up = gu[:, :k], gu[:, k:]  # views, rows 2k apart
    w, r = _rand((n, k), dtype, 8, k ** -0.5), _rand((m, n), dtype, 9)
    over = {"SPLIT_K": split, "BLOCK_K": 128} if m <= gemm.GEMV_MAX_M else {}
    cfg = _cfg(m, n, k, dtype, **over)
    for act in ("silu", "gelu_tanh"):
        want = gemm.reference_gated(gate, up, w, None, r, act)
        assert_close(gemm.launch_gated_linear(gate, up, w, None, r, act, cfg), want)
    with pytest.raises(KernelInputError, match="up"):
        gemm.launch_gated_linear(gate, up[:, :-1], w)


def test_gated_linear_registry_and_custom_op():
    spec = get("gated_linear")
    gen = torch.Generator().manual_seed(4)
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, torch.bfloat16, torch.device("cpu"), gen)
        gate, up, w, b, r, act = inputs
        m, k, n = dims["M"], dims["K"], dims["N"]
        assert spec.bytes_moved(*inputs) == (2 * m * k + n * k + m * n + (b is not None) * n
                                             + (r is not None) * m * n) * 2
        for cfg in spec.space.configs(spec.problem(*inputs))[:2]:
            assert_close(spec.launch(*inputs, config=cfg), spec.reference(*inputs))
        got = torch.ops.advisor.gated_linear(gate, up, w, b, r, act, "")
        assert_close(got, spec.reference(*inputs))
        f32 = spec.make_inputs(dims, torch.float32, torch.device("cpu"), gen)
        assert_close(spec.unfused_ops()(*f32), spec.reference(*f32), torch.float32)
    assert spec.bench_dims(1) == {"M": 1, "K": 14336, "N": 4096, "residual": 1}


@pytest.mark.parametrize("name", ["gemm_epilogue", "gemm_swiglu", "gemm_rmsnorm"])
def test_unfused_baseline_computes_the_same_function(name):
    """The benchmark's eager baseline (model-dtype ops) must compute what the reference does."""
    from advisor.kernels import registry

    spec = registry.get(name)
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
        assert_close(spec.unfused_ops()(*inputs), spec.reference(*inputs), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, k, n", [(17, 40, 40), (33, 72, 24)])
def test_tma_path_every_op(monkeypatch, dtype, m, k, n):
    """TMA=1 (tensor descriptors; the interpreter runs them on the CPU): ragged M, N and K
    read zeros past the bounds; the gated form's last gate tile passes N into the up rows."""
    cfg = _cfg(m, n, k, dtype, TMA=1)
    grids = _every_op_through_tma(monkeypatch, cfg, m, k, n, dtype)
    assert len(grids) == 4  # none fell back to pointer loads


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_persistent_tma_every_op(monkeypatch, dtype):
    """TMA=2: sm_count programs (3 in the interpreter) walk 16 tiles of 64x64, ragged at
    M, N and K."""
    m, k, n = 200, 136, 200  # three K steps, the last ragged
    cfg = _cfg(m, n, k, dtype, BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3, TMA=2)
    # weight_offset 0: with (1 + g) at this K the reference's two roundings of the normed
    # x and ours (x·g once) differ by 1-2 fp16 ulps, past the tolerance table (pointer
    # loads alike)
    grids = _every_op_through_tma(monkeypatch, cfg, m, k, n, dtype, weight_offset=0.0)
    assert [grid[0] for grid in grids] == [3] * 4


def _every_op_through_tma(monkeypatch, cfg, m, k, n, dtype, weight_offset=1.0) -> list:
    """Each of the four GEMM ops with `cfg` (kept for the plain and the gated problem)
    against its reference; returns the grids `_gemm_tma_kernel` was launched with."""
    for gated in (0, 1):
        assert gemm.SPACE.keep(cfg, {"M": m, "N": n, "K": k, "dtype": str(dtype), "gated": gated})
    launches = _count_tma_launches(monkeypatch)
    x, w = _xw(m, k, n, dtype)
    b, r = _rand((n,), dtype, 3), _rand((m, n), dtype, 4)
    assert tma_ok(x, w)
    assert_close(gemm.launch_gemm_epilogue(x, w, b, r, "gelu_tanh", cfg),
                 gemm.reference(x, w, b, r, "gelu_tanh"))
    x2, w_gu = _xw(m, k, 2 * n, dtype, seed=3)
    assert_close(gemm.launch_gemm_swiglu(x2, w_gu, "silu", cfg), gemm.reference_swiglu(x2, w_gu, "silu"))
    g = _rand((k,), dtype, 5, 0.5)
    assert_close(gemm.launch_gemm_rmsnorm(x, g, w, 1e-6, weight_offset, cfg),
                 gemm.reference_rmsnorm(x, g, w, 1e-6, weight_offset))
    assert_close(gemm.launch_gemm_rmsnorm_swiglu(x2, g, w_gu, 1e-6, 0.0, "silu", cfg),
                 gemm.reference_rmsnorm_swiglu(x2, g, w_gu, 1e-6, 0.0, "silu"))
    return launches


def test_large_m_16_bit_menu_is_tma_only():
    """Past 128 rows (16-bit) the menu holds TMA tiles only, plain and persistent; fp32
    keeps pointer loads."""
    problem = {"M": 512, "N": 4096, "K": 4096, "dtype": "torch.bfloat16", "gated": 0}
    assert {c["TMA"] for c in gemm.SPACE.configs(problem)} == {1, 2}
    fp32 = {**problem, "dtype": "torch.float32"}
    assert {c["TMA"] for c in gemm.SPACE.configs(fp32)} == {0, 1}


def _count_tma_launches(monkeypatch) -> list:
    launches, kernel = [], gemm._gemm_tma_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(gemm, "_gemm_tma_kernel", Counting())
    return launches


def test_tma_falls_back_to_pointer_loads_where_descriptors_cannot_read(monkeypatch):
    m, k, n = 17, 40, 24
    x_wide, w = _rand((m, 2 * k), torch.float16, 0), _rand((n, k), torch.float16, 1, k ** -0.5)
    x = x_wide[:, ::2]  # strided columns: no descriptor
    ragged = _rand((m, k + 1), torch.float16, 2)[:, :k]  # rows 82 bytes apart: not 16-aligned
    assert not tma_ok(x, w) and not tma_ok(ragged, w) and tma_ok(x.contiguous(), w)
    cfg = _cfg(m, n, k, torch.float16, TMA=1)
    assert gemm.SPACE.keep(cfg, {"M": m, "N": n, "K": k, "dtype": "torch.float16", "gated": 0})
    launches = _count_tma_launches(monkeypatch)
    for xx in (x, ragged):
        assert_close(gemm.launch_gemm_epilogue(xx, w, None, None, "none", cfg),
                     gemm.reference(xx, w, None, None, "none"))
    assert not launches


def test_tma_only_unsplit_on_tensor_core_tiles():
    problem = {"M": 64, "N": 256, "K": 512, "dtype": "torch.bfloat16", "gated": 0}
    tma = [c for c in gemm.SPACE.configs(problem) if c["TMA"]]
    assert tma and all(c["SPLIT_K"] == 1 for c in tma)
    for m in (1, 4, 8, 16):  # the GEMV path and the 16-row split-K tiles
        small = {**problem, "M": m}
        assert not any(c["TMA"] for c in gemm.SPACE.configs(small))
    # a config stored before the axis reads as pointer loads
    old = {k: v for k, v in gemm.SPACE.default(problem).items() if k != "TMA"}
    assert gemm.SPACE.well_formed(old)["TMA"] == 0


@pytest.mark.parametrize("k", [16, 32, 4096])
@pytest.mark.parametrize("gated", [0, 1])
def test_large_m_default_is_on_the_grid_for_any_k(k, gated):
    """The 16-bit TMA default past 128 rows keeps BLOCK_K within the menu (K <= 32)."""
    problem = {"M": 512, "N": 256, "K": k, "dtype": "torch.bfloat16", "gated": gated}
    assert gemm.SPACE.default(problem) in gemm.SPACE.configs(problem)
