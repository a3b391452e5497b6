"""Fused RMSNorm / LayerNorm, optionally with the residual add before them, in one pass.

One program normalises `ROWS_PER_PROG` rows of width N, each row in a single register tile
(`BLOCK_N >= N`): it reads the row (and the residual row), writes the normalised row (and
the summed residual). Statistics are fp32; the output is rounded to the input dtype.

HBM bytes for rows R, width N, element size e (2 for bf16), weight/bias bytes w, b:
  rms_norm       fused 2·R·N·e + N·w. Eager Llama RMSNorm launches 8 kernels (to fp32, pow,
                 mean, add eps, rsqrt, mul, to bf16, mul); per element they move
                 6 + 8 + 4 + 8 + 6 + 4 = 36 bytes at e=2 (add/rsqrt touch only R values):
                 36·R·N vs 4·R·N, 9x. 8 launches -> 1.
  add_rms_norm   fused 4·R·N·e + N·w (read x, residual; write y, new residual); eager adds
                 the residual add (3·R·N·e): 42·R·N vs 8·R·N at e=2. 9 launches -> 1.
  layer_norm     F.layer_norm is already one kernel, 2·R·N·e + N·(w+b) either way; the gain
                 comes with the residual add below.
  add_layer_norm fused 4·R·N·e + N·(w+b); eager 5·R·N·e + N·(w+b). 2 launches -> 1.

Two config axes are A/B variants for issue 3 (norms at 2048 x 4096 reach 75% / 69% of the
copy bandwidth, where per-row latency — load, reductions, store — is what a short kernel pays):
  STATS     LayerNorm only. 1 = mean, then the centred variance (two dependent reductions,
            the default); 2 = one pass of two independent sums of d = h - k, k = the row's
            first element (a cheap estimate of the mean that keeps E[d²] - E[d]² from
            cancelling); a row where it would cancel anyway (E[d]² > 63/64 E[d²], i.e. k
            an outlier) takes the exact second pass, so results match STATS=1 to rounding.
  ROW_TILE  1 = a program's ROWS_PER_PROG rows one after another (the default); 2 = as one
            (ROWS_PER_PROG, BLOCK_N) tile: every row's loads in flight before the reductions,
            one reduction tree for all rows.
A config without them (stored before they existed) means STATS=1, ROW_TILE=1.

Rounding rule (what HF models do): `h = x + residual` is rounded to x.dtype, stored as
the new residual, and that rounded value is what gets normalised.

Example::

    >>> x = torch.randn(4, 4096, dtype=torch.bfloat16, device="cuda")  # doctest: +SKIP
    >>> w = torch.ones(4096, dtype=torch.bfloat16, device="cuda")      # doctest: +SKIP
    >>> y = torch.ops.advisor.rms_norm(x, w, 1e-6, 0.0, "")            # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from advisor.errors import KernelInputError
from advisor.kernels._triton import (
    SUPPORTED_DTYPES,
    check,
    check_float,
    gdc_enter,
    interpreting,
    pdl_launch,
    resources,
    triton_can_run,
)
from advisor.kernels.registry import KernelSpec, register
from advisor.kernels.space import Config, ConfigSpace, Problem, decode
from advisor.kernels.testing import randn_nonzero

MAX_BLOCK_N = 32768  # widest row one program holds in registers; wider rows use the reference


# ----------------------------------------------------------------------------- reference


def rms_norm_reference(x, weight, eps: float, weight_offset: float = 0.0) -> torch.Tensor:
    """y = x·rsqrt(mean(x²)+eps)·(weight_offset + weight), in fp32, cast to x.dtype; no
    scale without a weight (`F.rms_norm(x, (N,))`)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * (weight_offset + weight.float())).to(x.dtype)


def add_rms_norm_reference(x, residual, weight, eps: float, weight_offset: float = 0.0):
    """(rms_norm(h), h) with h = x + residual rounded to x.dtype."""
    h = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_reference(h, weight, eps, weight_offset), h


def layer_norm_reference(x, weight, bias, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dim in fp32 (biased variance), cast to x.dtype."""
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def add_layer_norm_reference(x, residual, weight, bias, eps: float):
    """(layer_norm(h), h) with h = x + residual rounded to x.dtype."""
    h = (x.float() + residual.float()).to(x.dtype)
    return layer_norm_reference(h, weight, bias, eps), h


# ----------------------------------------------------------------------------- kernel


@triton.jit
def _norm_kernel(
    X, R, W, B,          # inputs: x (n_rows, n_cols), residual (same), weight (n_cols,), bias
    Y, H,                # outputs: y (n_rows, n_cols) contiguous, new residual h (same)
    n_rows, n_cols,      # problem size
    stride_x, stride_r,  # row strides of x and residual, in elements (last dim contiguous)
    eps, weight_offset,  # y = norm(h) * (weight_offset + w) + b
    IS_RMS: tl.constexpr,         # RMSNorm (no mean) if True, else LayerNorm
    HAS_RESIDUAL: tl.constexpr,   # h = x + r (rounded to x.dtype, stored to H), else h = x
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,        # power of two >= n_cols: one tile per row
    ROWS_PER_PROG: tl.constexpr,  # rows handled by one program (weight loaded once)
    GDC: tl.constexpr,            # programmatic dependent launch (_triton.pdl_launch)
    STATS: tl.constexpr = 1,      # LayerNorm statistics: 1 two-pass, 2 one shifted pass
    ROW_TILE: tl.constexpr = 1,   # 2: the rows as one (ROWS_PER_PROG, BLOCK_N) tile
):
    gdc_enter(GDC)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    first = tl.program_id(0).to(tl.int64) * ROWS_PER_PROG  # int64: row*stride may pass 2^31
    if ROW_TILE == 2:
        _norm_rows_tile(X, R, W, B, Y, H, first, cols, n_rows, n_cols, stride_x, stride_r, eps,
                        weight_offset, IS_RMS, HAS_RESIDUAL, HAS_WEIGHT, HAS_BIAS, ROWS_PER_PROG)
        return
    col_mask = cols < n_cols
    # Weight and bias are loaded once per program and reused for every row.
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    for i in tl.static_range(ROWS_PER_PROG):
        row = first + i
        # Columns of this row, none past the last row. (A scalar-bool `&` block-bool mask
        # comes out int32 in the Triton 3.9 interpreter, hence the scalar `where`.)
        mask = cols < tl.where(row < n_rows, n_cols, 0)
        h = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0)
            h = (h.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
            tl.store(H + row * n_cols + cols, h, mask=mask)
        hf = h.to(tl.float32)  # masked lanes are 0
        if IS_RMS or STATS == 1:
            if IS_RMS:
                xc = hf
            else:
                mean = tl.sum(hf, axis=0) / n_cols
                xc = tl.where(mask, hf - mean, 0.0)
            var = tl.sum(xc * xc, axis=0) / n_cols
        else:
            # Shift k: h of the row's first column (a scalar load, same cache line as h[0]).
            live = row < n_rows
            k = tl.load(X + row * stride_x, mask=live, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r0 = tl.load(R + row * stride_r, mask=live, other=0.0).to(tl.float32)
                k = (k + r0).to(H.dtype.element_ty).to(tl.float32)
            xc, var = _shifted_stats(hf, mask, k, n_cols)
        y = xc * tl.rsqrt(var + eps)
        if HAS_WEIGHT:
            y = y * w
        if HAS_BIAS:
            y = y + b
        tl.store(Y + row * n_cols + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _shifted_stats(hf, mask, k, n_cols):
    """(h - mean masked to 0, biased variance) of one row from two independent sums of
    d = h - k; the exact second pass where E[d]² is within 1/64 of E[d²] (k far from the
    mean, so E[d²] - E[d]² would cancel: error amplified > 64x)."""
    d = tl.where(mask, hf - k, 0.0)
    m = tl.sum(d, axis=0) / n_cols  # E[d] = mean - k
    q = tl.sum(d * d, axis=0) / n_cols  # E[d²]
    xc = tl.where(mask, d - m, 0.0)
    var = tl.maximum(q - m * m, 0.0)
    if var * 64.0 < q:
        var = tl.sum(xc * xc, axis=0) / n_cols
    return xc, var


@triton.jit
def _norm_rows_tile(X, R, W, B, Y, H, first, cols, n_rows, n_cols, stride_x, stride_r, eps,
                    weight_offset, IS_RMS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr):
    """ROW_TILE=2: rows [first, first + ROWS) as one (ROWS, BLOCK_N) tile, two-pass stats;
    arguments as `_norm_kernel`'s."""
    rows = first + tl.arange(0, ROWS)[:, None]  # (ROWS, 1) int64
    col_mask = cols < n_cols
    mask = (rows < n_rows) & col_mask[None, :]  # (ROWS, BLOCK_N)
    offs = cols[None, :]
    h = tl.load(X + rows * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows * stride_r + offs, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(H.dtype.element_ty)
        tl.store(H + rows * n_cols + offs, h, mask=mask)
    hf = h.to(tl.float32)  # masked lanes are 0
    if IS_RMS:
        xc = hf
    else:
        mean = tl.sum(hf, axis=1)[:, None] / n_cols  # (ROWS, 1)
        xc = tl.where(mask, hf - mean, 0.0)
    var = tl.sum(xc * xc, axis=1)[:, None] / n_cols  # (ROWS, 1)
    y = xc * tl.rsqrt(var + eps)
    if HAS_WEIGHT:
        y = y * (tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset)[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows * n_cols + offs, y.to(Y.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- config space


def _block_floor(n_cols: int) -> int:
    return max(128, 1 << (max(n_cols, 1) - 1).bit_length())  # next power of two


def _keep(cfg: Config, problem: Problem) -> bool:
    floor = _block_floor(int(problem["n_cols"]))
    per_thread = cfg["BLOCK_N"] // (32 * cfg["num_warps"])  # fp32 row values per thread
    stats, row_tile = cfg.get("STATS", 1), cfg.get("ROW_TILE", 1)
    return (
        floor <= cfg["BLOCK_N"] <= 4 * floor  # single pass; a wider tile only wastes lanes
        and 4 <= per_thread <= 64             # >= 8-byte vector loads; x, w, b fit registers
        and cfg["ROWS_PER_PROG"] <= max(1, int(problem["n_rows"]))
        # the variants (module docstring) at the tightest tile only: fewer configs to sweep
        and (stats == 1 or (not problem.get("rms", False) and row_tile == 1
                            and cfg["BLOCK_N"] == floor))
        and (row_tile == 1 or (cfg["ROWS_PER_PROG"] > 1 and cfg["BLOCK_N"] == floor
                               and per_thread * cfg["ROWS_PER_PROG"] <= 64))
    )


def _default(problem: Problem) -> Config:
    block = _block_floor(int(problem["n_cols"]))
    # ~8-64 values per thread: 1 warp at 128 wide, 8 warps at 4096, 16 warps at 32768.
    return {"BLOCK_N": block, "num_warps": min(16, max(1, block // 512)), "ROWS_PER_PROG": 1,
            "STATS": 1, "ROW_TILE": 1}


SPACE = ConfigSpace(
    axes={
        "BLOCK_N": tuple(2**k for k in range(7, 16)),  # 128 .. 32768
        "num_warps": (1, 2, 4, 8, 16),
        "ROWS_PER_PROG": (1, 2, 4),
        "STATS": (1, 2),
        "ROW_TILE": (1, 2),
    },
    default=_default,
    keep=_keep,
    fill={"STATS": 1, "ROW_TILE": 1},
)


def _problem(x: torch.Tensor, rms: bool = False) -> dict:
    """`rms`: RMSNorm, which has no mean (no STATS variant)."""
    n = x.shape[-1] if x.dim() else 1
    return {"n_rows": x.numel() // max(n, 1), "n_cols": n, "dtype": str(x.dtype), "rms": rms}


# ----------------------------------------------------------------------------- launcher


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., N) -> (rows, N) with unit column stride: a view when possible, else a copy."""
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-1])  # (rows, N)


def _expect(name: str, t: torch.Tensor, shape: tuple, x: torch.Tensor, same_dtype: bool) -> None:
    """t must have `shape`, x's device and (if same_dtype) x's dtype; the message is only
    formatted on failure (this runs on every launch)."""
    if (tuple(t.shape) != tuple(shape) or t.device != x.device
            or (same_dtype and t.dtype != x.dtype)):
        dtype = x.dtype if same_dtype else "fp32/fp16/bf16"
        raise KernelInputError(f"{name}: expected {tuple(shape)} {dtype} on {x.device}, "
                               f"got {tuple(t.shape)} {t.dtype} on {t.device}")


def _out(name: str, out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _expect(name, out, x.shape, x, same_dtype=True)
    check(out.is_contiguous(), f"{name}: must be contiguous")
    return out


def _check_inputs(x, residual, weight, bias) -> None:
    check_float("x", x)
    check(x.dim() >= 1, "x: needs at least one dim (..., N)")
    if not triton_can_run(x):
        raise KernelInputError(f"x: on {x.device}; Triton needs CUDA (or TRITON_INTERPRET=1)")
    if x.shape[-1] > MAX_BLOCK_N:
        raise KernelInputError(f"x: row width {x.shape[-1]} > {MAX_BLOCK_N} needs a "
                               "multi-pass kernel")
    if residual is not None:
        _expect("residual", residual, x.shape, x, same_dtype=True)
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_float(name, t)
            _expect(name, t, (x.shape[-1],), x, same_dtype=False)


def _norm(x, residual, weight, bias, eps, weight_offset, is_rms, config, out, residual_out):
    """Check, allocate, launch. Returns (y, h or None, compiled kernel or None)."""
    _check_inputs(x, residual, weight, bias)
    cfg = SPACE.resolve(config, _problem(x, is_rms))
    y = _out("out", out, x)
    h = _out("residual_out", residual_out, x) if residual is not None else None
    if x.numel() == 0:
        return y, h, None
    x2 = _rows(x)  # (rows, N)
    r2 = _rows(residual) if residual is not None else x2
    w = weight.contiguous() if weight is not None else x2
    b = bias.contiguous() if bias is not None else x2
    n_rows, n_cols = x2.shape
    grid = (-(-n_rows // cfg["ROWS_PER_PROG"]),)  # cdiv
    compiled = _norm_kernel[grid](
        x2, r2, w, b, y, h if h is not None else y,
        n_rows, n_cols, x2.stride(0), r2.stride(0), float(eps), float(weight_offset),
        IS_RMS=is_rms, HAS_RESIDUAL=residual is not None,
        HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
        BLOCK_N=cfg["BLOCK_N"], ROWS_PER_PROG=cfg["ROWS_PER_PROG"], num_warps=cfg["num_warps"],
        STATS=cfg["STATS"], ROW_TILE=cfg["ROW_TILE"], **pdl_launch(y),
    )
    return y, h, compiled


def launch_rms_norm(x, weight, eps, weight_offset=0.0, config: Mapping[str, int] | None = None,
                    *, out=None):
    """RMSNorm of x (..., N) with weight (N,) or none; returns y like x."""
    return _norm(x, None, weight, None, eps, weight_offset, True, config, out, None)[0]


def launch_add_rms_norm(x, residual, weight, eps, weight_offset=0.0,
                        config: Mapping[str, int] | None = None, *, out=None, residual_out=None):
    """h = x + residual (x.dtype); returns (rms_norm(h), h)."""
    check(residual is not None, "residual: required")
    y, h, _ = _norm(x, residual, weight, None, eps, weight_offset, True, config, out,
                    residual_out)
    return y, h


def launch_layer_norm(x, weight, bias, eps, config: Mapping[str, int] | None = None, *,
                      out=None):
    """LayerNorm of x (..., N) with optional weight, bias (N,); returns y like x."""
    return _norm(x, None, weight, bias, eps, 0.0, False, config, out, None)[0]


def launch_add_layer_norm(x, residual, weight, bias, eps,
                          config: Mapping[str, int] | None = None, *, out=None,
                          residual_out=None):
    """h = x + residual (x.dtype); returns (layer_norm(h), h)."""
    check(residual is not None, "residual: required")
    y, h, _ = _norm(x, residual, weight, bias, eps, 0.0, False, config, out, residual_out)
    return y, h


def _spills(x, residual, weight, bias, eps, weight_offset, is_rms, config) -> int | None:
    if interpreting():
        return None
    res = resources(_norm(x, residual, weight, bias, eps, weight_offset, is_rms, config,
                          None, None)[2])
    return None if res is None else res.n_spills


def spills_rms_norm(x, weight, eps, weight_offset=0.0, config=None) -> int | None:
    return _spills(x, None, weight, None, eps, weight_offset, True, config)


def spills_add_rms_norm(x, residual, weight, eps, weight_offset=0.0, config=None) -> int | None:
    return _spills(x, residual, weight, None, eps, weight_offset, True, config)


def spills_layer_norm(x, weight, bias, eps, config=None) -> int | None:
    return _spills(x, None, weight, bias, eps, 0.0, False, config)


def spills_add_layer_norm(x, residual, weight, bias, eps, config=None) -> int | None:
    return _spills(x, residual, weight, bias, eps, 0.0, False, config)


# ----------------------------------------------------------------------------- custom ops


def _use_triton(x: torch.Tensor) -> bool:
    """Triton where it can run; the reference for other devices, dtypes and wide rows."""
    return (triton_can_run(x) and x.dtype in SUPPORTED_DTYPES and x.dim() >= 1
            and x.shape[-1] <= MAX_BLOCK_N)


@torch.library.custom_op(
    "advisor::rms_norm", mutates_args=(),
    schema="(Tensor x, Tensor? weight, float eps, float weight_offset, str config) -> Tensor")
def rms_norm(x, weight, eps, weight_offset, config):
    if _use_triton(x):
        return launch_rms_norm(x, weight, eps, weight_offset, decode(config))
    return rms_norm_reference(x, weight, eps, weight_offset).contiguous()


@torch.library.custom_op(
    "advisor::add_rms_norm", mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor? weight, float eps, float weight_offset, "
           "str config) -> (Tensor, Tensor)")
def add_rms_norm(x, residual, weight, eps, weight_offset, config):
    if _use_triton(x):
        return launch_add_rms_norm(x, residual, weight, eps, weight_offset, decode(config))
    y, h = add_rms_norm_reference(x, residual, weight, eps, weight_offset)
    return y.contiguous(), h.contiguous()


@torch.library.custom_op(
    "advisor::layer_norm", mutates_args=(),
    schema="(Tensor x, Tensor? weight, Tensor? bias, float eps, str config) -> Tensor")
def layer_norm(x, weight, bias, eps, config):
    if _use_triton(x):
        return launch_layer_norm(x, weight, bias, eps, decode(config))
    return layer_norm_reference(x, weight, bias, eps).contiguous()


@torch.library.custom_op(
    "advisor::add_layer_norm", mutates_args=(),
    schema="(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, str config) "
           "-> (Tensor, Tensor)")
def add_layer_norm(x, residual, weight, bias, eps, config):
    if _use_triton(x):
        return launch_add_layer_norm(x, residual, weight, bias, eps, decode(config))
    y, h = add_layer_norm_reference(x, residual, weight, bias, eps)
    return y.contiguous(), h.contiguous()


def _like(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape)  # contiguous, like the launcher's outputs


rms_norm.register_fake(lambda x, weight, eps, weight_offset, config: _like(x))
add_rms_norm.register_fake(
    lambda x, residual, weight, eps, weight_offset, config: (_like(x), _like(x)))
layer_norm.register_fake(lambda x, weight, bias, eps, config: _like(x))
add_layer_norm.register_fake(
    lambda x, residual, weight, bias, eps, config: (_like(x), _like(x)))


# ----------------------------------------------------------------------------- registry

EPS = 1e-6


def _shape(dims: Mapping[str, int]) -> tuple[int, ...]:
    lead = (dims["batch"],) if "batch" in dims else ()
    return (*lead, dims["rows"], dims["n"])  # (B?, rows, N)


def _make_inputs(residual: bool, rms: bool):
    def make(dims, dtype, device, generator) -> tuple:
        def rand(shape):
            return randn_nonzero(shape, dtype, device, generator)
        x = rand(_shape(dims))
        r = (rand(_shape(dims)),) if residual else ()
        w = rand((dims["n"],))
        rest = (EPS, float(dims.get("weight_offset", 0))) if rms else (rand((dims["n"],)), EPS)
        return (x, *r, w, *rest)  # rms: (x, [r], w, eps, offset); layer: (x, [r], w, b, eps)
    return make


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


TEST_DIMS = (
    {"rows": 3, "n": 1000},
    {"rows": 2, "n": 4095, "weight_offset": 1},
    {"batch": 2, "rows": 3, "n": 129},
)


def _bench_dims(tokens: int) -> dict[str, int]:
    return {"rows": tokens, "n": 4096}  # Llama-3-8B hidden size


def _spec(name, reference, launch, spills, make_inputs, bytes_moved, unfused) -> KernelSpec:
    rms = "rms" in name
    return register(KernelSpec(
        name=name, reference=reference, launch=launch, space=SPACE, make_inputs=make_inputs,
        problem=lambda x, *rest: _problem(x, rms), bytes_moved=bytes_moved, test_dims=TEST_DIMS,
        bench_dims=_bench_dims, unfused_launches=unfused, spills=spills,
        usable=lambda x, *rest: _use_triton(x),
    ))


SPECS: dict[str, KernelSpec] = {
    spec.name: spec for spec in (
        _spec("rms_norm", rms_norm_reference, launch_rms_norm, spills_rms_norm,
              _make_inputs(residual=False, rms=True),
              lambda x, w, *_: 2 * _nbytes(x) + _nbytes(w), unfused=8),
        _spec("add_rms_norm", add_rms_norm_reference, launch_add_rms_norm, spills_add_rms_norm,
              _make_inputs(residual=True, rms=True),
              lambda x, r, w, *_: 4 * _nbytes(x) + _nbytes(w), unfused=9),
        _spec("layer_norm", layer_norm_reference, launch_layer_norm, spills_layer_norm,
              _make_inputs(residual=False, rms=False),
              lambda x, w, b, *_: 2 * _nbytes(x) + _nbytes(w) + _nbytes(b), unfused=1),
        _spec("add_layer_norm", add_layer_norm_reference, launch_add_layer_norm,
              spills_add_layer_norm,
              _make_inputs(residual=True, rms=False),
              lambda x, r, w, b, *_: 4 * _nbytes(x) + _nbytes(w) + _nbytes(b), unfused=2),
    )
}
