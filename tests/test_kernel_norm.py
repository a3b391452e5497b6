"""advisor.kernels.norm: rms_norm, add_rms_norm, layer_norm, add_layer_norm vs their references.

Runs the Triton kernel through the interpreter on CPU (conftest sets TRITON_INTERPRET=1).
Interpreter quirk: Triton 3.9's interpreter rounds fp32 -> bf16 by truncation (the GPU
rounds to nearest even), so in bf16 the new residual is compared within tolerance and
`y` is checked against the reference applied to the kernel's own residual; fp32/fp16
residuals must be bit-exact.
"""

from __future__ import annotations

import pytest
import torch

from advisor.errors import KernelInputError
from advisor.kernels import norm, registry
from advisor.kernels.space import encode
from advisor.kernels.testing import assert_close, nan_filled, randn_nonzero

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SHAPES = ((3, 1000), (2, 4095), (1, 128), (2, 3, 257))  # odd widths, one row, 3-D batch
EPS = 1e-6
OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")


def _t(shape, dtype, seed):
    return randn_nonzero(tuple(shape), dtype, "cpu", torch.Generator().manual_seed(seed))


def _xrwb(shape, dtype):
    n = shape[-1]
    return _t(shape, dtype, 0), _t(shape, dtype, 1), _t((n,), dtype, 2), _t((n,), dtype, 3)


def _check_add(y, h, x, r, norm_of):
    """h is x + r rounded to x.dtype, y is the reference norm of h."""
    h_ref = (x.float() + r.float()).to(x.dtype)
    if x.dtype == torch.bfloat16:
        assert_close(h, h_ref)  # interpreter truncates to bf16, see module docstring
    else:
        assert torch.equal(h, h_ref)
    assert_close(y, norm_of(h))


# ----------------------------------------------------------------------------- each op


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("offset", (0.0, 1.0))  # Llama w·x, Gemma (1+w)·x
def test_rms_norm(shape, dtype, offset):
    x, _, w, _ = _xrwb(shape, dtype)
    out = nan_filled(x.shape, dtype, x.device)
    y = norm.launch_rms_norm(x, w, EPS, offset, out=out)
    assert y is out and y.shape == x.shape and y.dtype == dtype
    assert_close(y, norm.rms_norm_reference(x, w, EPS, offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm(shape, dtype):
    x, r, w, _ = _xrwb(shape, dtype)
    out, res_out = nan_filled(x.shape, dtype, x.device), nan_filled(x.shape, dtype, x.device)
    y, h = norm.launch_add_rms_norm(x, r, w, EPS, 1.0, out=out, residual_out=res_out)
    assert y is out and h is res_out
    _check_add(y, h, x, r, lambda h: norm.rms_norm_reference(h, w, EPS, 1.0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norms_without_a_weight(shape, dtype):  # F.rms_norm(x, (N,)): no scale at all
    x, r, _, _ = _xrwb(shape, dtype)
    want = torch.nn.functional.rms_norm(x.double(), (x.shape[-1],), eps=EPS).to(dtype)
    out = nan_filled(x.shape, dtype, x.device)
    assert norm.launch_rms_norm(x, None, EPS, out=out) is out
    assert_close(out, want)
    y, h = norm.launch_add_rms_norm(x, r, None, EPS)
    _check_add(y, h, x, r, lambda h: norm.rms_norm_reference(h, None, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layer_norm(shape, dtype):
    x, _, w, b = _xrwb(shape, dtype)
    out = nan_filled(x.shape, dtype, x.device)
    y = norm.launch_layer_norm(x, w, b, EPS, out=out)
    assert y is out
    assert_close(y, norm.layer_norm_reference(x, w, b, EPS))


@pytest.mark.parametrize("affine", ("weight", "bias", "none"))
def test_layer_norm_optional_affine(affine):
    x, _, w, b = _xrwb((3, 1000), torch.float32)
    w = w if affine == "weight" else None
    b = b if affine == "bias" else None
    y = norm.launch_layer_norm(x, w, b, EPS, out=nan_filled(x.shape, x.dtype, x.device))
    assert_close(y, torch.nn.functional.layer_norm(x, (1000,), w, b, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_layer_norm(shape, dtype):
    x, r, w, b = _xrwb(shape, dtype)
    out, res_out = nan_filled(x.shape, dtype, x.device), nan_filled(x.shape, dtype, x.device)
    y, h = norm.launch_add_layer_norm(x, r, w, b, EPS, out=out, residual_out=res_out)
    assert y is out and h is res_out
    _check_add(y, h, x, r, lambda h: norm.layer_norm_reference(h, w, b, EPS))


# ----------------------------------------------------------------------------- configs, layout


def _launch(op, x, r, w, b, config=None):
    """Every op on the same inputs; returns a tuple of outputs and of references."""
    if op == "rms_norm":
        return (norm.launch_rms_norm(x, w, EPS, 0.0, config),), (
            norm.rms_norm_reference(x, w, EPS, 0.0),)
    if op == "add_rms_norm":
        return (norm.launch_add_rms_norm(x, r, w, EPS, 0.0, config),
                norm.add_rms_norm_reference(x, r, w, EPS, 0.0))
    if op == "layer_norm":
        return (norm.launch_layer_norm(x, w, b, EPS, config),), (
            norm.layer_norm_reference(x, w, b, EPS),)
    return (norm.launch_add_layer_norm(x, r, w, b, EPS, config),
            norm.add_layer_norm_reference(x, r, w, b, EPS))


@pytest.mark.parametrize("op", OPS)
def test_configs(op):
    x, r, w, b = _xrwb((5, 1000), torch.float32)  # 5 rows: ROWS_PER_PROG=4 leaves a tail
    configs = norm.SPACE.configs(norm.SPECS[op].problem(x))
    rpp4 = next(c for c in configs if c["ROWS_PER_PROG"] == 4)
    for cfg in {encode(c): c for c in (configs[0], configs[-1], rpp4)}.values():
        outs, refs = _launch(op, x, r, w, b, cfg)
        for out, ref in zip(outs, refs, strict=True):
            assert_close(out, ref)


@pytest.mark.parametrize("op", OPS)
def test_strided_rows(op):
    base = _t((3, 1100), torch.float16, 0)
    x = base[:, 50:1050]                      # (3, 1000), row stride 1100: no copy
    r = _t((1000, 3), torch.float16, 1).t()   # (3, 1000), column stride 3: copied
    _, _, w, b = _xrwb((3, 1000), torch.float16)
    outs, refs = _launch(op, x, r, w, b)
    for out, ref in zip(outs, refs, strict=True):
        assert out.is_contiguous()
        assert_close(out, ref)


@pytest.mark.parametrize("op", OPS)
def test_empty(op):
    x, r, w, b = _xrwb((0, 1000), torch.float32)
    outs, _ = _launch(op, x, r, w, b)
    assert all(o.shape == (0, 1000) for o in outs)


def test_space():
    for n in (1, 100, 1000, 4095, 4096, 14336, 32768):
        for rms in (False, True):
            problem = {"n_rows": 4096, "n_cols": n, "dtype": "torch.bfloat16", "rms": rms}
            configs = norm.SPACE.configs(problem)
            assert norm.SPACE.default(problem) in configs
            base = [c for c in configs if c["STATS"] == c["ROW_TILE"] == 1]
            assert 1 <= len(base) <= 40 and len(configs) <= 60
            assert all(c["BLOCK_N"] >= n for c in configs)
            assert not (rms and any(c["STATS"] == 2 for c in configs))  # RMSNorm has no mean
            assert all(c["ROWS_PER_PROG"] > 1 for c in configs if c["ROW_TILE"] == 2)


# ----------------------------------------------------------------------------- variants

VARIANTS = {  # (3, 1000) fp32..bf16: BLOCK_N 1024 is the tightest tile
    "stats2": {"BLOCK_N": 1024, "num_warps": 2, "ROWS_PER_PROG": 2, "STATS": 2, "ROW_TILE": 1},
    "tile2": {"BLOCK_N": 1024, "num_warps": 4, "ROWS_PER_PROG": 2, "STATS": 1, "ROW_TILE": 2},
    "tile4": {"BLOCK_N": 1024, "num_warps": 8, "ROWS_PER_PROG": 4, "STATS": 1, "ROW_TILE": 2},
}


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variants_match_reference(op, dtype, variant):
    """STATS=2 / ROW_TILE=2 (kept, not replaced by the default) on 5 rows of 1000: a ragged
    last row tile, every output written (NaN-filled), residual exact."""
    cfg = VARIANTS[variant]
    rms = "rms" in op
    x, r, w, b = _xrwb((5, 1000), dtype)
    problem = norm.SPECS[op].problem(x)
    if rms and cfg["STATS"] == 2:
        assert not norm.SPACE.keep(cfg, problem)  # runs the default: nothing new to test
        return
    assert norm.SPACE.resolve(cfg, problem) == cfg
    y = nan_filled(x.shape, dtype, x.device)
    h = nan_filled(x.shape, dtype, x.device)
    w_or_none = w if op != "add_layer_norm" else None  # one LayerNorm without weight
    args = (x, r) if op.startswith("add") else (x,)
    if rms:
        norm._norm(x, r if op.startswith("add") else None, w, None, EPS, 1.0, True, cfg, y, h)
        want = lambda t: norm.rms_norm_reference(t, w, EPS, 1.0)  # noqa: E731
    else:
        norm._norm(x, r if op.startswith("add") else None, w_or_none, b, EPS, 0.0, False, cfg, y, h)
        want = lambda t: norm.layer_norm_reference(t, w_or_none, b, EPS)  # noqa: E731
    if len(args) == 2:
        _check_add(y, h, x, r, want)
    else:
        assert_close(y, want(x))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_one_pass_stats_offset_rows_and_outlier_shift(dtype):
    """STATS=2 where the two-moment formula would cancel: rows offset far from zero (the
    shift k = h[0] takes the offset out) and rows whose first element is an outlier (the
    guard takes the exact second pass)."""
    x, _, w, b = _xrwb((4, 1000), torch.float32)
    x = x + 300.0  # |mean| >> std
    x[2:, 0] = 5000.0  # k an outlier: E[d]² ≈ E[d²]
    x = x.to(dtype)
    w, b = w.to(dtype), b.to(dtype)
    # fp64 reference: at |mean| = 300 the fp32 two-pass (and F.layer_norm in fp32) is off by
    # ~8e-5, the shifted one-pass by < 1e-6
    want = torch.nn.functional.layer_norm(x.double(), (1000,), w.double(), b.double(), EPS)
    assert_close(norm.launch_layer_norm(x, w, b, EPS, VARIANTS["stats2"]), want.to(dtype))


# ----------------------------------------------------------------------------- rejection


def test_rejects_bad_input():
    x, r, w, b = _xrwb((2, 64), torch.float32)
    bad = [
        lambda: norm.launch_rms_norm(x.int(), w, EPS),                 # dtype
        lambda: norm.launch_rms_norm(x.double(), w, EPS),              # dtype
        lambda: norm.launch_rms_norm(x, w[:63], EPS),                  # weight width
        lambda: norm.launch_rms_norm(x, w.half().int(), EPS),          # weight dtype
        lambda: norm.launch_add_rms_norm(x, r[:1], w, EPS),            # residual shape
        lambda: norm.launch_add_rms_norm(x, r.half(), w, EPS),         # residual dtype
        lambda: norm.launch_layer_norm(x, w, b[:10], EPS),             # bias width
        lambda: norm.launch_layer_norm(x, w, b, EPS, out=x.half()),    # out dtype
        lambda: norm.launch_rms_norm(x, w, EPS, config={"BLOCK_N": 32}),  # unknown config
        lambda: norm.launch_rms_norm(  # wider than one tile
            torch.ones(1, 40000), torch.ones(40000), EPS),
    ]
    for call in bad:
        with pytest.raises(KernelInputError):
            call()


def test_config_outside_keep_runs_the_default():
    """A recipe's config is tuned at its bucket's representative length; other lengths in
    the bucket (fewer rows than ROWS_PER_PROG) or a row wider than its tile must still run
    correctly: the launcher falls back to the problem's default config."""
    tuned = {"BLOCK_N": 256, "num_warps": 1, "ROWS_PER_PROG": 4}
    for rows, width in ((2, 200), (3, 200), (1, 300)):
        problem = {"n_rows": rows, "n_cols": width, "dtype": "torch.float32"}
        assert not norm.SPACE.keep(tuned, problem)
        assert norm.SPACE.resolve(tuned, problem) == norm.SPACE.default(problem)
        x, w = _t((rows, width), torch.float32, 0), _t((width,), torch.float32, 1)
        assert_close(norm.launch_rms_norm(x, w, EPS, config=tuned), norm.rms_norm_reference(x, w, EPS))
    with pytest.raises(KernelInputError):  # malformed: a value off the axis
        norm.SPACE.resolve({**tuned, "ROWS_PER_PROG": 3}, {"n_rows": 8, "n_cols": 200, "dtype": "x"})


# ----------------------------------------------------------------------------- custom ops


def _ops(x, r, w, b, config=""):
    y1 = torch.ops.advisor.rms_norm(x, w, EPS, 1.0, config)
    y2, h2 = torch.ops.advisor.add_rms_norm(x, r, w, EPS, 0.0, config)
    y3 = torch.ops.advisor.layer_norm(x, w, b, EPS, config)
    y4, h4 = torch.ops.advisor.add_layer_norm(x, r, None, b, EPS, config)
    return y1, y2, h2, y3, y4, h4


def _refs(x, r, w, b):
    y2, h2 = norm.add_rms_norm_reference(x, r, w, EPS, 0.0)
    y4, h4 = norm.add_layer_norm_reference(x, r, None, b, EPS)
    return (norm.rms_norm_reference(x, w, EPS, 1.0), y2, h2,
            norm.layer_norm_reference(x, w, b, EPS), y4, h4)


def test_custom_ops_eager_and_config_string():
    x, r, w, b = _xrwb((2, 3, 257), torch.float16)
    cfg = encode({"BLOCK_N": 512, "num_warps": 2, "ROWS_PER_PROG": 2})
    for config in ("", cfg):
        for out, ref in zip(_ops(x, r, w, b, config), _refs(x, r, w, b), strict=True):
            assert_close(out, ref)


def test_custom_ops_compile_fullgraph():
    x, r, w, b = _xrwb((3, 1000), torch.float32)
    compiled = torch.compile(_ops, backend="eager", fullgraph=True)
    for out, ref in zip(compiled(x, r, w, b), _refs(x, r, w, b), strict=True):
        assert_close(out, ref)


def test_custom_ops_fall_back_to_reference(monkeypatch):
    x, r, w, b = _xrwb((2, 40000), torch.float32)  # wider than one tile: reference
    for out, ref in zip(_ops(x, r, w, b), _refs(x, r, w, b), strict=True):
        assert_close(out, ref)
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # plain CPU: no Triton, reference
    x, r, w, b = _xrwb((2, 100), torch.bfloat16)
    for out, ref in zip(_ops(x, r, w, b), _refs(x, r, w, b), strict=True):
        assert torch.equal(out, ref)


# ----------------------------------------------------------------------------- registry


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))  # bf16: module docstring
def test_registry_entry(op, dtype):
    spec = norm.SPECS[op]
    assert registry._REGISTRY[op] is spec and spec.space is norm.SPACE
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, dtype, torch.device("cpu"), torch.Generator())
        problem = spec.problem(*inputs)
        assert problem["n_cols"] == dims["n"] and problem["dtype"] == str(dtype)
        assert spec.default_config(*inputs) in spec.space.configs(problem)
        outs, refs = spec.launch(*inputs, config=None), spec.reference(*inputs)
        if torch.is_tensor(outs):
            outs, refs = (outs,), (refs,)
        for out, ref in zip(outs, refs, strict=True):
            assert_close(out, ref)
        assert spec.spills(*inputs, config=None) is None  # interpreter: nothing compiled
    assert spec.bench_dims(2048) == {"rows": 2048, "n": 4096}
    x = torch.empty(2048, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, dtype=torch.bfloat16)
    rows_bytes = {"rms_norm": 2, "add_rms_norm": 4, "layer_norm": 2, "add_layer_norm": 4}[op]
    params = (w,) if "rms" in op else (w, w)
    args = (x, *((x,) if op.startswith("add") else ()), *params, EPS)
    assert spec.bytes_moved(*args) == rows_bytes * x.numel() * 2 + len(params) * 4096 * 2
    assert spec.unfused_launches == {"rms_norm": 8, "add_rms_norm": 9,
                                     "layer_norm": 1, "add_layer_norm": 2}[op]
