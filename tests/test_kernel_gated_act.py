"""gated_act / gated_act_merged: the Triton kernel (interpreter on CPU) against `reference`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from advisor.errors import KernelInputError
from advisor.kernels import gated_act as ga
from advisor.kernels.registry import get
from advisor.kernels.space import encode
from advisor.kernels.testing import assert_close, nan_filled, randn_nonzero

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ACTS = tuple(ga.ACTIVATIONS)
# The interpreter evaluates sigmoid's exp(-x) in numpy, which warns where it overflows to inf
# (the result, 1/(1+inf) = 0, is right); compiled kernels do not warn.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")


def _pair(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    # scale 3 reaches the tails of every activation (silu/gelu saturation, relu's zero side)
    return randn_nonzero(shape, dtype, "cpu", gen, 3.0), randn_nonzero(shape, dtype, "cpu", gen)


@pytest.mark.parametrize("shape", [(3, 1000), (1, 4095)])
@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_every_element_written(shape, activation, dtype):
    gate, up = _pair(shape, dtype)
    out = nan_filled(shape, dtype, gate.device)
    got = ga.launch_gated_act(gate, up, activation, out=out)
    assert got is out
    assert_close(out, ga.reference(gate, up, activation))


def test_reference_is_eager_math():
    gate, up = _pair((2, 7), torch.float32)
    torch.testing.assert_close(ga.reference(gate, up, "silu"), F.silu(gate) * up)
    tanh_form = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(ga.reference(gate, up, "gelu_tanh"), tanh_form)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_halves_3d_and_merged(dtype):
    gen = torch.Generator().manual_seed(1)
    gu = randn_nonzero((2, 3, 2 * 333), dtype, "cpu", gen)  # (B, T, 2N)
    gate, up = gu.chunk(2, dim=-1)  # (B, T, N) views, row stride 2N
    want = ga.reference(gate, up, "gelu")
    assert_close(ga.launch_gated_act(gate, up, "gelu"), want)
    assert_close(ga.launch_gated_act_merged(gu, "gelu"), want)
    # leading dims that do not merge into one row stride: a contiguous copy is taken
    g_t, u_t = gate.transpose(0, 1), up.transpose(0, 1)  # (T, B, N)
    assert_close(ga.launch_gated_act(g_t, u_t, "gelu"), ga.reference(g_t, u_t, "gelu"))


def test_merged_poisoned_output():
    gu = randn_nonzero((5, 2 * 77), torch.float16, "cpu", torch.Generator().manual_seed(2))
    out = nan_filled((5, 77), torch.float16, gu.device)
    ga.launch_gated_act_merged(gu, "silu", out=out)
    assert_close(out, ga.reference_merged(gu, "silu"))


@pytest.mark.parametrize("op", ["plain", "merged"])
def test_several_configs(op):
    gate, up = _pair((5, 1000), torch.bfloat16)
    configs = ga.SPACE.configs({"n_rows": 5, "n_cols": 1000, "dtype": "torch.bfloat16"})
    assert len(configs) >= 2
    want = ga.reference(gate, up, "silu")
    for cfg in (configs[0], configs[len(configs) // 2], configs[-1]):
        if op == "plain":
            assert_close(ga.launch_gated_act(gate, up, "silu", cfg), want)
        else:
            assert_close(ga.launch_gated_act_merged(torch.cat([gate, up], -1), "silu", cfg), want)


TILE = {"BLOCK_M": 2, "BLOCK_N": 256, "num_warps": 1}


@pytest.mark.parametrize(
    "rows, n, even", [(4, 1024, (True, True)), (5, 1024, (False, True)),
                      (4, 1000, (True, False)), (5, 1000, (False, False))]
)
@pytest.mark.parametrize("op", ["plain", "merged"])
def test_even_and_ragged_tiles(rows, n, even, op):
    """EVEN_M / EVEN_N pick the unmasked loads and stores per axis; every element is written
    and nothing past the output (a poisoned tail of the same buffer) is touched."""
    gate, up = _pair((rows, n), torch.bfloat16, seed=4)
    buf = nan_filled((rows + 3, n), torch.bfloat16, gate.device)
    out = buf[:rows]
    if op == "plain":
        _, _, meta, grid = ga._prepare(gate, up, out, "silu", TILE)
        ga.launch_gated_act(gate, up, "silu", TILE, out=out)
    else:
        gu = torch.cat([gate, up], -1)
        _, _, meta, grid = ga._prepare(*ga._split_merged(gu), out, "silu", TILE)
        ga.launch_gated_act_merged(gu, "silu", TILE, out=out)
    assert {k: meta[k] for k in TILE} == TILE  # the config was kept, not replaced
    assert (meta["EVEN_M"], meta["EVEN_N"]) == even
    assert grid == (triton.cdiv(rows, 2) * triton.cdiv(n, 256),)
    assert_close(out, ga.reference(gate, up, "silu"))
    assert torch.isnan(buf[rows:]).all()


@triton.jit
def _pid_map_kernel(out_ptr, n_rows, n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows, cols = ga.tile_index(n_cols, BLOCK_M, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    pid = tl.zeros((BLOCK_M, BLOCK_N), tl.int32) + tl.program_id(0)
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], pid, mask=mask)


def test_grid_is_flat_and_column_tiles_come_first():
    """One grid axis (axis 0 allows 2^31-1 programs; axes 1 and 2 stop at 65535), and
    consecutive program ids walk a row's column tiles before the next row tile."""
    cfg = {"BLOCK_M": 2, "BLOCK_N": 64}
    rows, n = 5, 200  # 3 row tiles x 4 column tiles, both ragged
    grid = ga.grid_of(cfg, rows, n)
    assert grid == (12,)
    pids = torch.full((rows, n), -1, dtype=torch.int32)
    _pid_map_kernel[grid](pids, rows, n, **cfg)
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(n), indexing="ij")
    assert torch.equal(pids, ((r // 2) * 4 + c // 64).int())
    # a long prefill: far more than 65535 row tiles still fits the single axis
    big = ga.grid_of({"BLOCK_M": 1, "BLOCK_N": 1024}, 1 << 20, 14336)
    assert big == ((1 << 20) * 14,)
    with pytest.raises(KernelInputError):
        ga.grid_of({"BLOCK_M": 1, "BLOCK_N": 64}, 1 << 30, 4096)
    # the launchers hand the kernel that grid and the EVEN flags
    gate, up = _pair((4, 1024), torch.float32)
    _, _, meta, grid = ga._prepare(gate, up, torch.empty_like(gate), "silu", None)
    assert len(grid) == 1 and {"EVEN_M", "EVEN_N"} <= set(meta)


@pytest.mark.parametrize(
    "rows, n", [(1, 1), (1, 64), (3, 1000), (1, 14336), (8192, 14336), (16384, 4096)]
)
def test_space_default_is_kept_and_grid_modest(rows, n):
    for flat in (False, True):
        problem = ga._problem(rows, n, torch.bfloat16, flat)
        configs = ga.SPACE.configs(problem)
        assert ga.SPACE.default(problem) in configs
        tiles = [c for c in configs if c["LAYOUT"] == ga.TILES]
        flats = [c for c in configs if c["LAYOUT"] == ga.FLAT]
        # tiles: the 2-D space (as bias_act has it) under either hint, contiguous or not
        both = {encode({**c, "LAYOUT": ga.TILES, "EVICT": e})
                for c in ga.TILE_SPACE.configs(problem) for e in ga.EVICTIONS}
        assert {encode(c) for c in tiles} == both
        assert 1 <= len(tiles) // len(ga.EVICTIONS) <= 40
        assert all(c["BLOCK_M"] * c["BLOCK_N"] <= ga.MAX_TILE for c in tiles)
        # flat: only where contiguous; at a big problem every BLOCK x warps x hint
        assert all(c["BLOCK_M"] == 1 and c["num_warps"] in ga.FLAT_WARPS for c in flats)
        if not flat:
            assert flats == []
        elif rows * n >= 4096:
            assert len(flats) == len(ga.FLAT_BLOCKS) * len(ga.FLAT_WARPS) * len(ga.EVICTIONS)


def test_custom_op_and_torch_compile():
    gate, up = _pair((3, 1000), torch.bfloat16)
    cfg = encode(ga.SPACE.configs({"n_rows": 3, "n_cols": 1000})[-1])
    want = ga.reference(gate, up, "gelu_tanh")
    assert_close(torch.ops.advisor.gated_act(gate, up, "gelu_tanh", cfg), want)
    gu = torch.cat([gate, up], -1)  # (rows, 2N)
    assert_close(torch.ops.advisor.gated_act_merged(gu, "gelu_tanh", ""), want)

    def mlp_act(gu: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        split = torch.ops.advisor.gated_act(g, u, "silu", "")
        return split + torch.ops.advisor.gated_act_merged(gu, "silu", "")

    got = torch.compile(mlp_act, backend="eager", fullgraph=True)(gu)
    assert_close(got, (ga.reference(gate, up, "silu").float() * 2).to(gu.dtype))


def test_custom_op_falls_back_to_reference_without_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors, no interpreter: eager path
    gate, up = _pair((2, 9), torch.float32)
    want = ga.reference(gate, up, "relu")
    assert torch.equal(torch.ops.advisor.gated_act(gate, up, "relu", ""), want)
    gu = torch.cat([gate, up], -1)
    assert torch.equal(torch.ops.advisor.gated_act_merged(gu, "relu", ""), want)


def test_empty_inputs_launch_nothing():
    gate = torch.empty(0, 4095)
    assert ga.launch_gated_act(gate, gate, "silu").shape == (0, 4095)
    assert ga.launch_gated_act_merged(torch.empty(2, 0, 10), "silu").shape == (2, 0, 5)


def test_rejects_bad_input():
    gate, up = _pair((2, 8), torch.float32)
    bad = [
        lambda: ga.launch_gated_act(gate.int(), up.int(), "silu"),  # dtype
        lambda: ga.launch_gated_act(gate, up.half(), "silu"),  # mixed dtypes
        lambda: ga.launch_gated_act(gate, up[:, :7], "silu"),  # shapes
        lambda: ga.launch_gated_act(gate, up, "swish"),  # unknown activation
        lambda: ga.launch_gated_act(gate, up, "silu", {"BLOCK_N": 64}),  # missing axes
        lambda: ga.launch_gated_act(gate, up, "silu", {"BLOCK_N": 100, "BLOCK_M": 1,
                                                       "num_warps": 1}),  # off the axis
        lambda: ga.launch_gated_act(gate, up, "silu", out=torch.empty(2, 7)),  # out shape
        lambda: ga.launch_gated_act_merged(gate[:, :7], "silu"),  # odd merged width
        lambda: ga.launch_gated_act(gate, up, "silu", {**FLAT_A, "LAYOUT": 3}),  # off the axis
        lambda: ga.launch_gated_act(gate, up, "silu", {**FLAT_A, "EVICT": 0}),  # off the axis
    ]
    for call in bad:
        with pytest.raises(KernelInputError):
            call()


@pytest.mark.parametrize("name", ["gated_act", "gated_act_merged"])
def test_registry_entry(name):
    spec = get(name)
    gen = torch.Generator().manual_seed(3)
    for dims in spec.test_dims:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), gen)
            problem = spec.problem(*inputs)
            assert (problem["n_rows"], problem["n_cols"]) == (dims["rows"], dims["n"])
            elt = inputs[0].element_size()
            assert spec.bytes_moved(*inputs) == 3 * dims["rows"] * dims["n"] * elt
            cfg = spec.space.configs(problem)[0]
            assert_close(spec.launch(*inputs, config=cfg), spec.reference(*inputs))
            assert spec.spills(*inputs, config=cfg) is None  # interpreter: nothing compiled
    assert spec.bench_dims(2048) == {"rows": 2048, "n": 14336}
    assert spec.unfused_launches == 2


# --- flat layout (LAYOUT=FLAT): BLOCK_N consecutive elements of the flattened numel --------

FLAT_A = {"BLOCK_M": 1, "BLOCK_N": 512, "num_warps": 4, "LAYOUT": ga.FLAT, "EVICT": 1}
FLAT_B = {"BLOCK_M": 1, "BLOCK_N": 4096, "num_warps": 8, "LAYOUT": ga.FLAT, "EVICT": 2}


@pytest.mark.parametrize("shape", [(3, 1000), (1, 4095), (2, 2, 1024)])  # ragged, ragged, even
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [FLAT_A, FLAT_B], ids=["512x4w-nohint", "4096x8w-evict_first"])
def test_flat_matches_reference_every_element_written(shape, dtype, cfg):
    """The flat kernel runs (not a fallback), masks exactly when BLOCK_N does not divide
    numel, writes every element and nothing past the output (a poisoned tail)."""
    gate, up = _pair(shape, dtype, seed=5)
    numel = gate.numel()
    buf = nan_filled((numel + 100,), dtype, gate.device)
    out = buf[:numel].view(shape)
    n = shape[-1]
    kernel, _, meta, grid = ga._prepare(gate.view(-1, n), up.view(-1, n), out.view(-1, n),
                                        "silu", cfg, flat=True)
    assert kernel is ga._gated_act_flat_kernel
    assert (meta["BLOCK"], meta["num_warps"]) == (cfg["BLOCK_N"], cfg["num_warps"])
    assert meta["EVICT"] == ga.EVICTIONS[cfg["EVICT"]] and not meta["INT64"]
    assert meta["EVEN"] == (numel % cfg["BLOCK_N"] == 0)
    assert grid == (triton.cdiv(numel, cfg["BLOCK_N"]),)
    assert ga.launch_gated_act(gate, up, "silu", cfg, out=out) is out
    assert_close(out, ga.reference(gate, up, "silu"))
    assert torch.isnan(buf[numel:]).all()


def test_flat_int64_offsets():
    """int64 offsets from 2^31 elements on, of the output or of the merged input's rows
    (shapes only: meta tensors); the int64 code path itself, forced on a small problem,
    computes the same."""
    for numel, wide in ((2**31 - 4096, False), (2**31 - 4095, True), (2**31 + 1, True)):
        g = torch.empty(1, numel, device="meta")
        _, _, meta, _ = ga._prepare(g, g, g, "silu", FLAT_B, flat=True)
        assert meta["INT64"] == wide and not meta["SPLIT"], numel
    for rows, wide in ((2**31 // 8192 - 1, False), (2**31 // 8192, True)):  # gu rows of 2·4096
        gu = torch.empty(rows, 2 * 4096, device="meta")
        _, _, meta, _ = ga._prepare(*ga._split_merged(gu), torch.empty(rows, 4096, device="meta"),
                                    "silu", FLAT_B, flat=True)
        assert meta["SPLIT"] and meta["INT64"] == wide, rows
    gate, up = _pair((3, 1000), torch.float32, seed=6)
    out = nan_filled((3, 1000), torch.float32, gate.device)
    ga._gated_act_flat_kernel[(6,)](gate, up, out, 3000, 1000, 1000, ACT=0, BLOCK=512, EVEN=False,
                                    INT64=True, SPLIT=False, GDC=False)
    assert_close(out, ga.reference(gate, up, "silu"))


def test_default_is_flat_only_for_large_problems_of_one_row_stride():
    """The measured crossover (ga.default's docstring): 2048 x 14336 of one row stride runs
    flat, other strides and small problems keep the tile default."""
    big_flat = ga.SPACE.default(ga._problem(2048, 14336, torch.bfloat16, True))
    assert big_flat["LAYOUT"] == ga.FLAT and big_flat["EVICT"] == 1
    assert ga.SPACE.default(ga._problem(2048, 14336, torch.bfloat16, False))["LAYOUT"] == ga.TILES
    assert ga.SPACE.default(ga._problem(128, 14336, torch.bfloat16, True))["LAYOUT"] == ga.TILES
    gu = torch.empty(2048, 2 * 14336, dtype=torch.bfloat16, device="meta")
    assert get("gated_act_merged").default_config(gu, "silu")["LAYOUT"] == ga.FLAT


@pytest.mark.parametrize("shape", [(3, 2 * 1000), (1, 2 * 4095), (2, 3, 2 * 512)])  # ragged, one row, even 3-D
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [FLAT_A, FLAT_B], ids=["512x4w-nohint", "4096x8w-evict_first"])
def test_flat_split_merged_halves(shape, dtype, cfg):
    """The halves of a merged [gate | up] (and the same halves passed as two chunks) run the
    flat kernel with SPLIT (row·stride + col offsets), write every output element and
    nothing past it."""
    gen = torch.Generator().manual_seed(8)
    gu = randn_nonzero(shape, dtype, "cpu", gen, 3.0)
    gate, up = gu.chunk(2, dim=-1)
    n, numel = gate.shape[-1], gate.numel()
    kernel, args, meta, _ = ga._prepare(*ga._split_merged(gu), torch.empty(numel // n, n, dtype=dtype),
                                        "silu", cfg, flat=True)
    assert kernel is ga._gated_act_flat_kernel and args[-1] == 2 * n
    assert meta["SPLIT"] == (numel > n) and not meta["INT64"]
    want = ga.reference(gate, up, "silu")
    for launch in (lambda out: ga.launch_gated_act_merged(gu, "silu", cfg, out=out),
                   lambda out: ga.launch_gated_act(gate, up, "silu", cfg, out=out)):
        buf = nan_filled((numel + 100,), dtype, gu.device)
        out = buf[:numel].view(gate.shape)
        assert launch(out) is out
        assert_close(out, want)
        assert torch.isnan(buf[numel:]).all()


def test_flat_only_where_gate_and_up_share_a_row_stride():
    """gate and up laid out differently (one contiguous, one a strided half) keep only
    tiles: a flat config there runs the default tile config (ConfigSpace.resolve),
    correctly; halves of one merged tensor may run flat."""
    gen = torch.Generator().manual_seed(7)
    gu = randn_nonzero((4, 2 * 512), torch.bfloat16, "cpu", gen)
    gate, up = gu.chunk(2, dim=-1)  # (4, 512) views, row stride 1024
    up_c = up.contiguous()
    for cfg in (FLAT_A, FLAT_B):
        kernel, _, meta, _ = ga._prepare(ga.as_rows(gate, 512), up_c, torch.empty(4, 512), "silu", cfg)
        assert kernel is ga._gated_act_kernel and meta["EVICT"] == "evict_first"
        assert_close(ga.launch_gated_act(gate, up_c, "silu", cfg), ga.reference(gate, up_c, "silu"))
    assert get("gated_act").problem(gate, up_c, "silu")["flat"] is False
    assert get("gated_act").problem(gate, up, "silu")["flat"] is True
    assert get("gated_act").problem(gate.contiguous(), up_c, "silu")["flat"] is True
    assert get("gated_act_merged").problem(gu, "silu")["flat"] is True


def test_config_without_new_axes_is_the_old_behaviour():
    """A config stored before LAYOUT / EVICT existed runs 2-D tiles with evict_first."""
    old = {"BLOCK_M": 1, "BLOCK_N": 1024, "num_warps": 4}
    problem = ga._problem(4, 1024, torch.bfloat16, True)
    assert ga.SPACE.resolve(old, problem) == {**old, "LAYOUT": ga.TILES, "EVICT": 2}
    assert ga.SPACE.default(problem)["LAYOUT"] == ga.TILES  # a small problem: tiles
    gate, up = _pair((4, 1024), torch.bfloat16)
    assert_close(torch.ops.advisor.gated_act(gate, up, "silu", encode(old)),
                 ga.reference(gate, up, "silu"))
    assert_close(torch.ops.advisor.gated_act(gate, up, "gelu", encode(FLAT_B)),
                 ga.reference(gate, up, "gelu"))
