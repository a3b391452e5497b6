"""GEMM with fused prologue/epilogue: `y = x·Wᵀ` plus what eager runs as separate kernels.

One tiled Triton matmul (tutorial 03: BLOCK_M/N/K tiles, GROUP_M swizzle, fp32 accumulate)
serves three ops through constexpr flags. x is (M, K) (or (..., K), flattened), W is (N, K)
as in nn.Linear; bytes for element size e, bf16 figures at Llama-3-8B sizes:

  gemm_epilogue  act(x·Wᵀ + b) (+ residual). Eager: addmm, act (2·M·N·e), add (3·M·N·e);
                 fusing saves 2·M·N·e per act and per residual, up to 3 -> 1 launches
                 (o_proj + residual: 16 KB/token, 2 -> 1).
  gemm_swiglu    act(x·W_gᵀ)·(x·W_uᵀ) from the merged [gate; up] (2N, K) weight: two
                 accumulators over one x tile; the (M, 2N) intermediate is never written.
                 Eager HF MLP (gate GEMM, up GEMM, act, mul) moves 2MK + 2NK + 7MN elements,
                 fused MK + 2NK + MN: saves (M·K + 6·M·N)·e = 176 KB/token, 4 -> 1 launches.
  gemm_rmsnorm   rmsnorm(x)·Wᵀ = (x·diag(g)·Wᵀ)·r with g = norm_w + offset and
                 r = rsqrt(mean(x²)+eps). Up to NORM_IN_GEMM_MAX_M rows: a pre-pass
                 writes r (M fp32), the GEMM scales x tiles by g along K and output rows
                 by r; x̂ is never written. vs advisor rms_norm + GEMM: saves
                 2·M·K·e (x̂ write + read) - M·K·e (pre-pass read) = M·K·e; vs eager
                 RMSNorm (36 B/elt, norm.py) + GEMM: 38 -> 4 B per x element; 9 -> 2
                 launches. More rows: the pre-pass writes x·g too (rounded as the prologue
                 rounds it) and the GEMM reads it as a plain A operand (scaling A tiles in
                 the pipelined loop cost more than those bytes).

Rounding: fp32 until ONE cast to x.dtype at the end (eager rounds x·Wᵀ+b, the act and the
residual sum separately; the gap is within bf16 tolerance). gemm_rmsnorm rounds x·g to
x.dtype before tl.dot (16-bit tensor-core operands), as HF rounds x̂ before its GEMM.

GEMV (M <= 4, BLOCK_M < 16): one batch-1..4 decode step reads every weight once, so the
op is bound by W's bytes. `_gemv_kernel` skips tensor cores (tl.dot needs >= 16 rows):
each program streams a (BLOCK_N, BLOCK_K) tile of W with K contiguous (16-byte loads,
evict-first: W is read once per forward and must not push x out of L2), multiplies it by
all M rows of x in fp32 and reduces along K. gemm_rmsnorm needs no pre-pass there: each
program computes its rows' rsqrt(mean(x²)+eps) from x (M·K elements, L2-resident) — one
launch fewer per norm site.

Decode on tensor cores (4 < M <= 16): 16-row tiles and SPLIT_K. Program (tile, s) reduces
K-slice s into an fp32 partial (SPLIT_K, NACC, M, N); a second small kernel sums the
partials in a fixed order and runs the epilogue (the GEMV path splits K the same way).
Chosen over fp32 atomics: deterministic, no memset launch, and the non-linear epilogue
needs a second pass anyway; `keep` bounds the partial traffic (2·SPLIT_K·NACC·M·N·4 B) to
1/16 of the W bytes.

Example (CPU needs TRITON_INTERPRET=1; on CUDA it runs the compiled kernel)::

    import torch, advisor.kernels.gemm
    x, w, r = torch.randn(4, 64), torch.randn(32, 64), torch.randn(4, 32)
    y = torch.ops.advisor.gemm_epilogue(x, w, None, r, "none", "")   # == x @ w.T + r
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from advisor.kernels._triton import (
    SUPPORTED_DTYPES,
    cast_rn,
    check,
    check_float,
    descriptor,
    gdc_enter,
    interpreting,
    pdl_launch,
    resources,
    sm_count,
    tma_ok,
    triton_can_run,
)
from advisor.kernels.bias_act import _round_like
from advisor.kernels.gated_act import (
    ACTIVATIONS,
    activation_ref,
    apply_activation,
    as_rows,
    launch_gated_act,
)
from advisor.kernels.gated_act import reference as gated_act_reference
from advisor.kernels.norm import launch_layer_norm, rms_norm_reference
from advisor.kernels.registry import KernelSpec, register
from advisor.kernels.space import Config, ConfigSpace, Problem, decode
from advisor.kernels.testing import randn_nonzero

# gemm_epilogue's activations: "none" (code -1) plus gated_act's codes.
GEMM_ACTIVATIONS: dict[str, int] = {"none": -1, **ACTIVATIONS}

# ----------------------------------------------------------------------------- references


def reference(x, w, bias, residual, activation: str) -> torch.Tensor:
    """act(x·Wᵀ + b) (+ residual) in fp32, cast once to x.dtype. x (..., K), w (N, K)."""
    y = F.linear(x.float(), w.float(), None if bias is None else bias.float())  # (..., N)
    if activation != "none":
        y = activation_ref(activation, y)
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def reference_swiglu(x, w_gu, activation: str) -> torch.Tensor:
    """act(x·W_gᵀ)·(x·W_uᵀ) for w_gu = [W_g; W_u] (2N, K): (..., K) -> (..., N)."""
    gate, up = F.linear(x.float(), w_gu.float()).chunk(2, dim=-1)  # (..., N) each
    return (activation_ref(activation, gate) * up).to(x.dtype)


def reference_gated(gate, up, w, bias, residual, activation: str) -> torch.Tensor:
    """`reference` of act(gate)·up rounded to gate's dtype (as the gated_act op writes it)."""
    return reference(gated_act_reference(gate, up, activation), w, bias, residual, "none")


def unfused_gated(gate, up, w, bias, residual, activation: str) -> torch.Tensor:
    """The activation, the product, the GEMM (+ bias) and the add, in gate's dtype."""
    return unfused(activation_ref(activation, gate) * up, w, bias, residual, "none")


def unfused(x, w, bias, residual, activation: str) -> torch.Tensor:
    """What a model runs eagerly, in x's dtype: cuBLAS GEMM (+ bias), activation, add."""
    y = F.linear(x, w, bias)
    y = activation_ref(activation, y) if activation != "none" else y
    return y + residual if residual is not None else y


def unfused_swiglu(x, w_gu, activation: str) -> torch.Tensor:
    """Two GEMMs (gate, up), the activation and the product, in x's dtype."""
    n = w_gu.shape[0] // 2
    return activation_ref(activation, F.linear(x, w_gu[:n])) * F.linear(x, w_gu[n:])


def _hf_rms_norm(x, norm_w, eps: float, weight_offset: float) -> torch.Tensor:
    """HF-style RMSNorm: fp32 inside, rounded to x's dtype, then the weight in x's dtype."""
    h = x.float()
    h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return h * (norm_w + weight_offset).to(x.dtype)


def unfused_rmsnorm_swiglu(x, norm_w, w_gu, eps: float, weight_offset: float,
                           activation: str) -> torch.Tensor:
    """HF-style RMSNorm, then two GEMMs, the activation and the product, in x's dtype."""
    return unfused_swiglu(_hf_rms_norm(x, norm_w, eps, weight_offset), w_gu, activation)


def reference_rmsnorm_swiglu(x, norm_w, w_gu, eps: float, weight_offset: float,
                             activation: str) -> torch.Tensor:
    """act(n·W_gᵀ)·(n·W_uᵀ) for n = rms_norm(x) kept in fp32, cast once to x.dtype."""
    normed = rms_norm_reference(x.float(), norm_w, eps, weight_offset)  # (..., K) fp32
    return reference_swiglu(normed, w_gu.float(), activation).to(x.dtype)


def unfused_rmsnorm(x, norm_w, w, eps: float, weight_offset: float, bias=None) -> torch.Tensor:
    """HF-style RMSNorm (fp32 inside, rounded to x's dtype), then the GEMM (+ bias) in x's dtype."""
    return F.linear(_hf_rms_norm(x, norm_w, eps, weight_offset), w, bias)


def unfused_layernorm(x, norm_w, norm_b, w, bias, eps: float, activation: str = "none") -> torch.Tensor:
    """Eager LayerNorm (x's dtype out), then the GEMM (+ bias) and activation in x's dtype."""
    return unfused(F.layer_norm(x, (x.shape[-1],), norm_w, norm_b, eps), w, bias, None, activation)


def reference_layernorm(x, norm_w, norm_b, w, bias, eps: float, activation: str = "none") -> torch.Tensor:
    """act(layer_norm(x)·Wᵀ + b) with the normalised x kept in fp32 (not rounded), cast once."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), None if norm_w is None else norm_w.float(),
                          None if norm_b is None else norm_b.float(), eps)  # (..., K) fp32
    return reference(normed, w, bias, None, activation).to(x.dtype)


def reference_rmsnorm(x, norm_w, w, eps: float, weight_offset: float, bias=None) -> torch.Tensor:
    """rms_norm(x)·Wᵀ (+ b) with the normalised x kept in fp32 (not rounded), cast to x.dtype."""
    normed = rms_norm_reference(x.float(), norm_w, eps, weight_offset)  # (..., K) fp32
    return F.linear(normed, w.float(), None if bias is None else bias.float()).to(x.dtype)


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tile_ids(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering (tutorial 03): GROUP_M row-tiles share W column tiles in L2."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    in_group = pid % (GROUP_M * num_n)
    return first_m + in_group % size_m, in_group // size_m


@triton.jit
def _epilogue(acc, up, rows, cols, M, N, B, R, RS, stride_rm,
              ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              ROW_SCALE: tl.constexpr, GATED: tl.constexpr):
    """fp32 tile acc = x·Wᵀ (up = x·W_uᵀ if GATED), rows (BM,), cols (BN,) -> fp32 result."""
    if ROW_SCALE:  # gemm_rmsnorm: r = rsqrt(mean(x²)+eps) per row
        r = tl.load(RS + rows, mask=rows < M, other=0.0)[:, None]
        acc = acc * r
        if GATED:  # rmsnorm_swiglu: both halves read the normalised x
            up = up * r
    if HAS_BIAS:
        acc = acc + tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    if ACT >= 0:
        acc = apply_activation(acc, ACT)
    if GATED:
        acc = acc * up
    if HAS_RESIDUAL:
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        res = tl.load(R + rows.to(tl.int64)[:, None] * stride_rm + cols[None, :], mask=mask,
                      other=0.0)
        acc = acc + res.to(tl.float32)
    return acc


@triton.jit
def _finish(acc, up, rows, cols, M, N, B, R, RS, Y, P, stride_rm, stride_ym, stride_ps, stride_pu,
            ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
            ROW_SCALE: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr):
    """A program's fp32 tile (BM, BN) at rows × cols: epilogue and store to Y, or (split K)
    the raw partial(s) to P at this program's slice, for `_splitk_epilogue_kernel`."""
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if SPLIT_K == 1:
        y = _epilogue(acc, up, rows, cols, M, N, B, R, RS, stride_rm,
                      ACT, HAS_BIAS, HAS_RESIDUAL, ROW_SCALE, GATED)
        tl.store(Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
                 y.to(Y.dtype.element_ty), mask=mask)
    else:
        p_ptrs = (P + tl.program_id(1).to(tl.int64) * stride_ps
                  + rows.to(tl.int64)[:, None] * N + cols[None, :])  # (BM, BN)
        tl.store(p_ptrs, acc, mask=mask)
        if GATED:
            tl.store(p_ptrs + stride_pu, up, mask=mask)


@triton.jit
def _scaled(x, g, EMULATE: tl.constexpr):
    """x·g (g fp32, broadcast to x) rounded once to x's dtype: the normalised-x prologue's
    rounding, the same in the GEMM and in the pre-pass that writes it."""
    if EMULATE:
        return _round_like(x.to(tl.float32) * g, x)
    return (x.to(tl.float32) * g).to(x.dtype)


@triton.jit
def _gemm_kernel(
    X, W, G,  # x (M, K) any strides; W (N_w, K) any strides; g = norm weight (K,) if PRE_SCALE
    B, R, RS,  # bias (N,); residual (M, N) rows stride_rm apart; row scales r (M,) fp32
    Y, P,  # out (M, N) rows stride_ym apart; fp32 split-K partials (SPLIT_K, NACC, M, N)
    M, N, K,  # y is (M, N); N counts output columns (W has 2N rows when GATED)
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_ym,
    stride_ps, stride_pu,  # partials: NACC·M·N per split, M·N to the up half
    weight_offset,  # g + weight_offset multiplies x along K (gemm_rmsnorm)
    ACT: tl.constexpr,  # activation code (-1 none, else gated_act.ACTIVATIONS)
    HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    PRE_SCALE: tl.constexpr,  # gemm_rmsnorm, up to NORM_IN_GEMM_MAX_M rows: x·diag(g) per A tile
    ROW_SCALE: tl.constexpr,  # gemm_rmsnorm: output rows ·r in the epilogue
    GATED: tl.constexpr,  # gemm_swiglu: second accumulator over W rows [N, 2N)
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    EMULATE: tl.constexpr,  # interpreter + bf16: fp32 dot, RN rounding in integer ops
    PRECISION: tl.constexpr,  # tl.dot input_precision ("ieee" for fp32: no tf32)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
):
    pid_m, pid_n = _tile_ids(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    # K-slice of this program: whole BLOCK_K steps; only the last slice may end mid-block.
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    offs_k = k_lo + tl.arange(0, BLOCK_K)  # (BK,)
    # Loads wrap rows/cols (% M, % N) so they need no mask; the stores are masked.
    x_ptrs = X + (rows % M).to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = W + (cols % N).to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = acc
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)  # (BK,)
        if EVEN_K:
            a = tl.load(x_ptrs)  # (BM, BK)
            b = tl.load(w_ptrs)  # (BK, BN): a tile of Wᵀ
        else:
            a = tl.load(x_ptrs, mask=(kk < K)[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=(kk < K)[:, None], other=0.0)
        if PRE_SCALE:
            g = tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32) + weight_offset
            a = _scaled(a, g[None, :], EMULATE)
        if EMULATE:  # the 3.9 interpreter's dot multiplies bf16 bit patterns (triton#11584)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if GATED:
            if EVEN_K:
                bu = tl.load(w_ptrs + N * stride_wn)
            else:
                bu = tl.load(w_ptrs + N * stride_wn, mask=(kk < K)[:, None], other=0.0)
            if EMULATE:
                bu = bu.to(tl.float32)
            up = tl.dot(a, bu, up, input_precision=PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    _finish(acc, up, rows, cols, M, N, B, R, RS, Y, P, stride_rm, stride_ym, stride_ps, stride_pu,
            ACT, HAS_BIAS, HAS_RESIDUAL, ROW_SCALE, GATED, SPLIT_K)


@triton.jit
def _tma_tile(XD, WD, pid_m, pid_n, N, K, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
              GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """fp32 (acc, up) of the (BLOCK_M, BLOCK_N) output tile (pid_m, pid_n) from descriptor
    loads over the whole of K. A tile past M, N or K reads zeros (the descriptor's bounds);
    the gate tile of a GATED W whose last column tile passes N reads rows of the up half
    there, which the masked store drops.

    Not warp-specialised: on the H100 (triton 3.6, session 17 run B) `tl.range(...,
    warp_specialize=True)` here gained 0-1.5% with 8 warps and hung the GPU with 4."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = acc
    for k in range(0, K, BLOCK_K):
        a = XD.load([pid_m * BLOCK_M, k])  # (BM, BK)
        b = WD.load([pid_n * BLOCK_N, k])  # (BN, BK): rows of W
        if EMULATE:  # the 3.9 interpreter's dot multiplies bf16 bit patterns (triton#11584)
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b.T, acc, input_precision=PRECISION)
        if GATED:
            bu = WD.load([N + pid_n * BLOCK_N, k])
            if EMULATE:
                bu = bu.to(tl.float32)
            up = tl.dot(a, bu.T, up, input_precision=PRECISION)
    return acc, up


@triton.jit
def _gemm_tma_kernel(
    XD, WD,  # tensor descriptors: x (M, K) in (BM, BK) blocks; W (N_w, K) in (BN, BK) blocks
    B, R, RS, Y,  # as in _gemm_kernel
    M, N, K, stride_rm, stride_ym, PROGRAMS,  # PROGRAMS: the grid (PERSISTENT) or unused
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROW_SCALE: tl.constexpr, GATED: tl.constexpr, EMULATE: tl.constexpr, PRECISION: tl.constexpr,
    PERSISTENT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """`_gemm_kernel` (SPLIT_K = 1, no PRE_SCALE: more rows than NORM_IN_GEMM_MAX_M) with
    x and W tiles fetched by the tensor memory accelerator (Hopper's TMA): one bulk copy
    per tile into shared memory, which the pipelined loop overlaps with the tensor-core
    work, instead of per-thread address arithmetic and cp.async. PERSISTENT: PROGRAMS
    programs (about one per SM) walk the tiles in grouped order, so one tile's epilogue
    overlaps the next tile's first loads and the last wave is not a launch of its own."""
    if PERSISTENT:
        tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), tiles, PROGRAMS):
            _tma_output_tile(tile, XD, WD, B, R, RS, Y, M, N, K, stride_rm, stride_ym, ACT,
                             HAS_BIAS, HAS_RESIDUAL, ROW_SCALE, GATED, EMULATE, PRECISION,
                             BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
    else:
        _tma_output_tile(tl.program_id(0), XD, WD, B, R, RS, Y, M, N, K, stride_rm, stride_ym,
                         ACT, HAS_BIAS, HAS_RESIDUAL, ROW_SCALE, GATED, EMULATE, PRECISION,
                         BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


@triton.jit
def _tma_output_tile(tile, XD, WD, B, R, RS, Y, M, N, K, stride_rm, stride_ym,
                     ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                     ROW_SCALE: tl.constexpr, GATED: tl.constexpr, EMULATE: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Output tile number `tile` (grouped order) of `_gemm_tma_kernel`: product, epilogue,
    masked store."""
    pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
    acc, up = _tma_tile(XD, WD, pid_m, pid_n, N, K, EMULATE, PRECISION, GATED,
                        BLOCK_M, BLOCK_N, BLOCK_K)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    _finish(acc, up, rows, cols, M, N, B, R, RS, Y, Y, stride_rm, stride_ym, 0, 0,
            ACT, HAS_BIAS, HAS_RESIDUAL, ROW_SCALE, GATED, 1)


@triton.jit
def _gemv_step(acc, a, b, ONE_ROW: tl.constexpr):
    """acc += a·bᵀ for x rows a (BM, BK) fp32 and W rows b (BN, BK). ONE_ROW (M = 1): acc is
    (BN, BK), multiplied elementwise and reduced once after the loop (no cross-thread
    reduction per step); else acc is (BM, BN), reduced along K each step."""
    if ONE_ROW:
        return acc + b.to(tl.float32) * a
    else:
        return acc + tl.sum(a[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_x(x_rows, u_rows, kk, K, row_ok, stride_xk, MASKED: tl.constexpr, X_ACT: tl.constexpr,
            INTERP_BF16: tl.constexpr):
    """x rows (BM, BK) at K offsets kk (BK,), fp32. X_ACT >= 0: x is act(gate)·up of the
    gate rows x_rows and the up rows u_rows, rounded to their dtype as the separate
    gated_act kernel would write it (the SwiGLU product in the down projection's prologue;
    INTERP_BF16: round to nearest as the GPU does, see cast_rn)."""
    mask = row_ok & (kk < K)[None, :] if MASKED else row_ok
    a = tl.load(x_rows + kk[None, :] * stride_xk, mask=mask, other=0.0)
    if X_ACT >= 0:
        u = tl.load(u_rows + kk[None, :] * stride_xk, mask=mask, other=0.0)
        a = cast_rn(apply_activation(a.to(tl.float32), X_ACT) * u.to(tl.float32), a.dtype, INTERP_BF16)
    return a.to(tl.float32)


@triton.jit
def _gemv_w(w_rows, kk, K, N, stride_wn, stride_wk, GATED: tl.constexpr, MASKED: tl.constexpr):
    """W tiles (BN, BK) at K offsets kk, and the up half's (rows N further) if GATED; read
    once, so evicted first."""
    ptrs = w_rows + kk[None, :] * stride_wk
    if MASKED:
        b = tl.load(ptrs, mask=(kk < K)[None, :], other=0.0, eviction_policy="evict_first")
    else:
        b = tl.load(ptrs, eviction_policy="evict_first")
    bu = b
    if GATED:
        if MASKED:
            bu = tl.load(ptrs + N * stride_wn, mask=(kk < K)[None, :], other=0.0,
                         eviction_policy="evict_first")
        else:
            bu = tl.load(ptrs + N * stride_wn, eviction_policy="evict_first")
    return b, bu


@triton.jit
def _gemv_row_stats(x_rows, row_ok, K, stride_xk, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """LayerNorm's mean and rsqrt(var + eps) of each row of x over all of K, each (BM, 1)
    fp32: two passes over x (M <= 4 rows, L2-resident), the variance of the centred values
    (no E[x²] - mean² cancellation), biased as torch's."""
    s = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        s += tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok & (kk < K)[None, :],
                     other=0.0).to(tl.float32)
    mean = (tl.sum(s, axis=1) / K)[:, None]  # (BM, 1)
    d2 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        ok = row_ok & (kk < K)[None, :]
        v = tl.load(x_rows + kk[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
        d = tl.where(ok, v - mean, 0.0)
        d2 += d * d
    return mean, tl.rsqrt(tl.sum(d2, axis=1) / K + eps)[:, None]


@triton.jit
def _gemv_update(acc, up, sq, a, b, bu, G, BETA, mean, rstd, kk, K, weight_offset,
                 NORM: tl.constexpr, CENTER: tl.constexpr, HAS_G: tl.constexpr,
                 HAS_BETA: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr,
                 ONE_ROW: tl.constexpr):
    """One K-step: Σx² (NORM, unsplit K), x·diag(g + offset) (NORM), acc (and up) += x·Wᵀ.
    CENTER (LayerNorm): x becomes (x - mean)·rstd [·g] [+ β] here, whole (the rows' stats
    come from `_gemv_row_stats`); past K, W is loaded as 0, so what x becomes there is moot."""
    if NORM:
        if CENTER:
            a = (a - mean) * rstd
            if HAS_G:
                a = a * tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
            if HAS_BETA:
                a = a + tl.load(BETA + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
        else:
            if SPLIT_K == 1:
                sq += a * a
            a = a * (tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32) + weight_offset)[None, :]
    acc = _gemv_step(acc, a, b, ONE_ROW)
    if GATED:
        up = _gemv_step(up, a, bu, ONE_ROW)
    return acc, up, sq


@triton.jit
def _gemv_kernel(
    X, W, G, B, R, Y, P,  # as in _gemm_kernel (G: norm weight (K,) if NORM)
    XU,  # X_ACT >= 0: the up rows (strides of X); x = act(X)·XU
    BETA,  # CENTER and HAS_BETA: the LayerNorm's bias (K,)
    M, N, K,  # M <= BLOCK_M: every program holds all rows of x
    stride_xm, stride_xk, stride_wn, stride_wk, stride_rm, stride_ym, stride_ps, stride_pu,
    eps, weight_offset,  # NORM: y = (x·diag(g + weight_offset)·Wᵀ)·rsqrt(mean(x²) + eps)
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    NORM: tl.constexpr, GATED: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr, GDC: tl.constexpr, X_ACT: tl.constexpr = -1,
    INTERP_BF16: tl.constexpr = False,
    CENTER: tl.constexpr = False, HAS_G: tl.constexpr = True, HAS_BETA: tl.constexpr = False,
):
    """Program (n-tile, s): output columns [n·BN, +BN) of all M rows, K-slice s.
    PREFETCH: the first K-step's W tile is loaded before `gdc_enter` (under PDL, while the
    previous kernel still runs: W is a parameter), the loop takes the rest.
    NORM and CENTER: y = layer_norm(x; G, BETA, eps)·Wᵀ — each program first computes its
    rows' mean and rstd over all of K, then normalises x on the way in (fp32, not rounded)."""
    ONE_ROW: tl.constexpr = BLOCK_M == 1
    rows = tl.arange(0, BLOCK_M)  # (BM,)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    row_ok = (rows < M)[:, None]  # (BM, 1)
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = tl.program_id(1) * k_span
    k_hi = tl.minimum(k_lo + k_span, K)
    x_rows = X + rows.to(tl.int64)[:, None] * stride_xm  # (BM, 1)
    u_rows = XU + rows.to(tl.int64)[:, None] * stride_xm  # (BM, 1), read iff X_ACT >= 0
    w_rows = W + (cols % N).to(tl.int64)[:, None] * stride_wn  # (BN, 1); wrapped: no mask
    if ONE_ROW:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = acc
    sq = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)  # NORM, one K slice: Σx² on the way
    mean = tl.zeros((BLOCK_M, 1), dtype=tl.float32)  # CENTER: the rows' LayerNorm stats
    rstd = mean
    if PREFETCH:  # masked: a K slice may be empty (k_lo >= K)
        kk = k_lo + tl.arange(0, BLOCK_K)
        b, bu = _gemv_w(w_rows, kk, K, N, stride_wn, stride_wk, GATED, True)
        gdc_enter(GDC)
        if NORM and CENTER:  # x is the previous kernel's output: after gdc_enter
            mean, rstd = _gemv_row_stats(x_rows, row_ok, K, stride_xk, eps, BLOCK_M, BLOCK_K)
        a = _gemv_x(x_rows, u_rows, kk, K, row_ok, stride_xk, True, X_ACT, INTERP_BF16)
        acc, up, sq = _gemv_update(acc, up, sq, a, b, bu, G, BETA, mean, rstd, kk, K, weight_offset,
                                   NORM, CENTER, HAS_G, HAS_BETA, GATED, SPLIT_K, ONE_ROW)
        k_first = k_lo + BLOCK_K
    else:
        gdc_enter(GDC)
        if NORM and CENTER:
            mean, rstd = _gemv_row_stats(x_rows, row_ok, K, stride_xk, eps, BLOCK_M, BLOCK_K)
        k_first = k_lo
    for k in range(k_first, k_hi, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)  # (BK,)
        a = _gemv_x(x_rows, u_rows, kk, K, row_ok, stride_xk, not EVEN_K, X_ACT, INTERP_BF16)
        b, bu = _gemv_w(w_rows, kk, K, N, stride_wn, stride_wk, GATED, not EVEN_K)  # (BN, BK)
        acc, up, sq = _gemv_update(acc, up, sq, a, b, bu, G, BETA, mean, rstd, kk, K, weight_offset,
                                   NORM, CENTER, HAS_G, HAS_BETA, GATED, SPLIT_K, ONE_ROW)
    if ONE_ROW:  # (BN, BK) -> (1, BN)
        acc = tl.sum(acc, axis=1)[None, :]
        up = tl.sum(up, axis=1)[None, :]
    if NORM and not CENTER:  # this program's rows' rsqrt(mean(x²) + eps) over all of K (x is tiny)
        if SPLIT_K > 1:  # this program saw one K slice: a second pass over x (L2-resident)
            for k in range(0, K, BLOCK_K):
                kk = k + tl.arange(0, BLOCK_K)
                v = tl.load(x_rows + kk[None, :] * stride_xk, mask=row_ok & (kk < K)[None, :],
                            other=0.0).to(tl.float32)
                sq += v * v
        r = tl.rsqrt(tl.sum(sq, axis=1) / K + eps)[:, None]  # (BM, 1)
        acc = acc * r  # linear in acc: a split-K partial may be scaled before the sum
        up = up * r
    _finish(acc, up, rows, cols, M, N, B, R, R, Y, P, stride_rm, stride_ym, stride_ps, stride_pu,
            ACT, HAS_BIAS, HAS_RESIDUAL, False, GATED, SPLIT_K)


@triton.jit
def _splitk_epilogue_kernel(
    P,  # fp32 partials (SPLIT_K, NACC, M, N) contiguous
    B, R, RS, Y,  # as in _gemm_kernel
    M, N, stride_rm, stride_ym, stride_ps, stride_pu,
    ACT: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    ROW_SCALE: tl.constexpr, GATED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, GDC: tl.constexpr,
):
    gdc_enter(GDC)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    p_ptrs = P + rows.to(tl.int64)[:, None] * N + cols[None, :]  # (BM, BN), split 0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: deterministic sums
        acc += tl.load(p_ptrs + s * stride_ps, mask=mask, other=0.0)
        if GATED:
            up += tl.load(p_ptrs + s * stride_ps + stride_pu, mask=mask, other=0.0)
    y = _epilogue(acc, up, rows, cols, M, N, B, R, RS, stride_rm,
                  ACT, HAS_BIAS, HAS_RESIDUAL, ROW_SCALE, GATED)
    tl.store(Y + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :],
             y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _row_rstd_kernel(X, RS, G, XG, K, stride_xm, stride_xk, eps, weight_offset,
                     SCALED: tl.constexpr, EMULATE: tl.constexpr, BLOCK_K: tl.constexpr):
    """RS[row] = rsqrt(mean(x[row]²) + eps) in fp32; one program per row of x (M, K).
    SCALED: also XG[row] = x[row]·(g + weight_offset) rounded to x's dtype (XG (M, K)
    contiguous): what the GEMM's prologue computes per A tile, written once instead."""
    row = tl.program_id(0).to(tl.int64)
    sq = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        kk = k + tl.arange(0, BLOCK_K)
        v = tl.load(X + row * stride_xm + kk * stride_xk, mask=kk < K, other=0.0)
        sq += v.to(tl.float32) * v.to(tl.float32)
    tl.store(RS + row, tl.rsqrt(tl.sum(sq, axis=0) / K + eps))
    if SCALED:  # the row is in L1/L2 from the pass above
        for k in range(0, K, BLOCK_K):
            kk = k + tl.arange(0, BLOCK_K)
            v = tl.load(X + row * stride_xm + kk * stride_xk, mask=kk < K, other=0.0)
            g = tl.load(G + kk, mask=kk < K, other=0.0).to(tl.float32) + weight_offset
            tl.store(XG + row * K + kk, _scaled(v, g, EMULATE).to(XG.dtype.element_ty), mask=kk < K)


# ----------------------------------------------------------------------------- config space

SMEM_BUDGET = 200 * 1024  # bytes of pipelined operand tiles (H100/H200 allow 227 KB/block)
# Above this many rows gemm_rmsnorm's tensor-core path writes x·g in its row-scale
# pre-pass (M·K·e written and read back, 16 MB at 2048 tokens, ~11 µs on an H100) instead
# of scaling each A tile by the norm weight inside the GEMM: that takes the tile through
# registers in every K step and stalls the pipelined loop. H100, session 16
# (norm -> gate/up + SwiGLU, 4096 -> 2 x 14336): in-GEMM 395 / 1571 µs at 512 / 2048 rows
# against 219 / 903 for the same GEMM without the norm (best TMA tiles).
NORM_IN_GEMM_MAX_M = 16
FILL_PROGRAMS = 256  # split K until tiles·SPLIT_K reach this (~2 programs per SM on 100+ SMs)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _elt(problem: Problem) -> int:
    return 4 if str(problem.get("dtype", "")).endswith("float32") else 2


def _tiles(cfg: Config, problem: Problem) -> int:
    return triton.cdiv(problem["M"], cfg["BLOCK_M"]) * triton.cdiv(problem["N"], cfg["BLOCK_N"])


def _split_ok(cfg: Config, problem: Problem) -> bool:
    """Split K only where tiles are too few, every slice has >= 2 K-steps, and the fp32
    partials (written and read back) stay under 1/16 of the W bytes they help stream."""
    s = cfg["SPLIT_K"]
    if s == 1:
        return True
    m, k = problem["M"], problem["K"]
    return (k >= 2 * s * cfg["BLOCK_K"] and 2 * s * m * 4 * 16 <= k * _elt(problem)
            and _tiles(cfg, problem) * s // 2 < FILL_PROGRAMS)


def _menu(problem: Problem) -> dict[str, tuple[int, ...]]:
    """The sensible values per axis for this problem's regime, clipped to its size.

    decode (M <= 16): 16-row tiles, deep K and >= 3 stages to stream W, SPLIT_K for
    occupancy; small M (<= 128): tiles no taller than M; large M: 64/128-row tiles."""
    m, elt = problem["M"], _elt(problem)
    deep = (64, 128) if elt == 2 else (32, 64)
    if m <= 16:
        menu = {"BLOCK_M": (16,), "BLOCK_K": deep, "num_warps": (4,), "SPLIT_K": (1, 2, 4, 8)}
    elif m <= 128:
        rows = tuple(b for b in (16, 32, 64) if _pow2(m) // 2 <= b <= _pow2(m))
        menu = {"BLOCK_M": rows, "BLOCK_K": deep[:1], "num_warps": (4, 8), "SPLIT_K": (1, 2)}
    else:
        menu = {"BLOCK_M": (64, 128), "BLOCK_K": (32, 64), "num_warps": (4, 8), "SPLIT_K": (1,)}
    menu.update(BLOCK_N=(64, 128, 256), GROUP_M=(8,), num_stages=(3, 4),
                TMA=(0,) if m <= 16 else (0, 1))  # TMA has no split-K: not on the decode tiles
    if m > 128 and elt == 2:
        # H100, session 16: pointer loads and BLOCK_K 32 lost to TMA 64-deep tiles by 10-50%
        # at every large-M shape timed; the persistent form is searched too.
        menu.update(BLOCK_K=(64,), TMA=(1, 2))
    for axis, size in (("BLOCK_N", problem["N"]), ("BLOCK_K", problem["K"])):
        cap = max(32, _pow2(size))  # no tile wider than the problem (but >= 32 for tl.dot)
        menu[axis] = tuple(v for v in menu[axis] if v <= cap) or (cap,)
    return menu


# Tests set this to run the GEMV's PDL code path (first W tile peeled off the K loop)
# where PDL itself cannot run (the interpreter).
PREFETCH_WITHOUT_PDL = False
GEMV_MAX_M = 4  # rows of x the GEMV path holds in one program (all of them)
GEMV_PER_THREAD = (16, 64)  # fp32 products per thread per K-step (BM·BN·BK / threads): enough
#                             bytes in flight per load, few enough registers for occupancy


def _gemv_menu(problem: Problem) -> dict[str, tuple[int, ...]]:
    """GEMV tiles: all M rows, 8-64 W rows by 128-1024 K-elements (K itself when shorter),
    4 warps; num_stages 1 (no software pipelining: bytes in flight come from many
    resident programs) or 3."""
    cap_k = max(32, _pow2(problem["K"]))
    return {"BLOCK_M": (_pow2(problem["M"]),), "BLOCK_N": (8, 16, 32, 64),
            "BLOCK_K": tuple(v for v in (128, 256, 512, 1024) if v <= cap_k) or (cap_k,),
            "GROUP_M": (8,), "num_warps": (4,), "num_stages": (1, 3), "SPLIT_K": (1, 2, 4)}


def _gemv_split_ok(cfg: Config, problem: Problem) -> bool:
    """Split K while there are too few programs (< 2·FILL_PROGRAMS before the last
    doubling), each slice keeps >= 2 K-steps, and fp32 partials stay under 1/16 of W."""
    s = cfg["SPLIT_K"]
    if s == 1:
        return True
    m, k = problem["M"], problem["K"]
    tiles = triton.cdiv(problem["N"], cfg["BLOCK_N"])
    return (k >= 2 * s * cfg["BLOCK_K"] and 2 * s * m * 4 * 16 <= k * _elt(problem)
            and tiles * s // 2 < 2 * FILL_PROGRAMS)


def _keep_gemv(cfg: Config, problem: Problem) -> bool:
    nacc = 1 + int(problem.get("gated", 0))
    per_thread = nacc * cfg["BLOCK_M"] * cfg["BLOCK_N"] * cfg["BLOCK_K"] // (32 * cfg["num_warps"])
    lo, hi = (0, 4 * GEMV_PER_THREAD[1]) if _toy(problem) else GEMV_PER_THREAD
    return (problem["M"] <= GEMV_MAX_M and not cfg.get("TMA", 0)
            and all(cfg[axis] in values for axis, values in _gemv_menu(problem).items())
            and lo <= per_thread <= hi and _gemv_split_ok(cfg, problem))


def _toy(problem: Problem) -> bool:
    """Sizes no real projection has (the CPU tests' models): a few programs with big tiles,
    since the interpreter's cost is per program and the GPU's bandwidth does not matter."""
    return problem["K"] < 512 or problem["N"] < 512


GEMV_FILL = 512  # programs to aim for: ~4 per SM on the H200's 132


def _gemv_default(problem: Problem) -> Config:
    """From the H200 probe (benchmarks/results/h200-gemv-probe-2026-12-03.json, M = 1):
    8192-element W tiles (32 rows x 256 K; 16 rows below N = 4096) split along K until
    ~GEMV_FILL programs: o_proj 11.1 µs and down_proj 29.7 µs at 128 tiles x SPLIT_K 4,
    where 16 x 256 unsplit took 15.0 / 46.0 µs. Gated (two accumulators): 8 x 256 tiles,
    54.4 µs for gate/up + SwiGLU against 73.7 µs at 16 x 256. More rows of x shrink the
    tile so the products per thread stay <= 64."""
    m, n, gated = problem["M"], problem["N"], bool(problem.get("gated", 0))
    bm = _pow2(m)
    menu = _gemv_menu(problem)
    rows = 8 if gated else max(8, (32 if n >= 4096 else 16) // bm)
    cfg = {"BLOCK_M": bm, "BLOCK_N": rows,
           "BLOCK_K": max(menu["BLOCK_K"][0], min(256, _pow2(problem["K"]))),
           "GROUP_M": 8, "num_warps": 4, "num_stages": 1, "SPLIT_K": 1, "TMA": 0}
    if _toy(problem):
        cfg.update(BLOCK_N=min(64, max(8, _pow2(n))), BLOCK_K=menu["BLOCK_K"][-1])
        while cfg["BLOCK_N"] > 8 and not _keep_gemv(cfg, problem):
            cfg["BLOCK_N"] //= 2
    while cfg["BLOCK_K"] > 32 and not _keep_gemv(cfg, problem):
        cfg["BLOCK_K"] //= 2
    tiles = triton.cdiv(n, cfg["BLOCK_N"])
    for split in (2, 4):
        if tiles * cfg["SPLIT_K"] < GEMV_FILL and _gemv_split_ok({**cfg, "SPLIT_K": split}, problem):
            cfg["SPLIT_K"] = split
    return cfg


def keep(cfg: Config, problem: Problem) -> bool:
    if cfg["BLOCK_M"] < 16:  # the GEMV path (tl.dot needs 16 rows)
        return _keep_gemv(cfg, problem)
    if problem["M"] <= GEMV_MAX_M:  # 16-row tensor-core tiles would be >= 75% padding
        return False
    cfg = {**SPACE.fill, **cfg}  # a config from before the axes
    nacc = 1 + int(problem.get("gated", 0))
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    smem = (bm * bk + nacc * bn * bk) * _elt(problem) * cfg["num_stages"]
    acc_per_thread = nacc * bm * bn // (32 * cfg["num_warps"])  # fp32 accumulator registers
    # Enough accumulators per thread to keep the warps busy (small M: 8 warps need 16).
    busy = acc_per_thread >= (32 if problem["M"] > 128 else {4: 4, 8: 16}[cfg["num_warps"]])
    menu = _menu(problem)
    return (all(cfg[axis] in values for axis, values in menu.items())
            and smem <= SMEM_BUDGET and busy and acc_per_thread <= 128
            and _split_ok(cfg, problem) and not (cfg["TMA"] and cfg["SPLIT_K"] > 1))


def default(problem: Problem) -> Config:
    """M <= GEMV_MAX_M: the GEMV path; M <= 16: 16x64 tiles, the deepest K, split until
    ~FILL_PROGRAMS programs; small M: tiles as tall as M (<= 64); large M: 128x128 (x64
    when gated), 8 warps, 3 stages, or for 16-bit inputs the TMA tiles below."""
    m, nacc = problem["M"], 1 + int(problem.get("gated", 0))
    if m <= GEMV_MAX_M:
        return _gemv_default(problem)
    menu = _menu(problem)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128 // nacc, "BLOCK_K": menu["BLOCK_K"][-1],
           "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "SPLIT_K": 1, "TMA": 0}
    if m > 128 and _elt(problem) == 2:
        # H100 sweep (session 16, results/h100-s16C-kernels-gemm-tma.json, µs at 512 / 2048
        # rows, Llama-3-8B widths): TMA 128x{128,256}x64 tiles beat pointer loads by 10-25%
        # and cuBLAS + ops at both: o_proj + residual 29.7 / 105.8 (cuBLAS + add 30.7 /
        # 111.5), gate/up + SwiGLU 207.0 / 706.5 (218.6 / 795.6). 256-wide tiles only with
        # >= 96 of them (o_proj at 512 rows has 64: 43.3 against 29.7 at 128-wide; QKV has
        # 96: 49.7 against 54.6).
        # The 8-warp tiles run persistent (TMA=2; H100 session 17 run B, 512 / 2048 rows):
        # norm -> gate/up + SwiGLU 211.1 / 761.2 -> 209.3 / 739.2, norm -> lm_head (N
        # 128256) 869.5 / 3187.6 -> 854.7 / 3066.3, norm -> QKV 50.8 / 165.9 -> 51.2 / 164.4.
        wide = nacc == 1 and triton.cdiv(m, 128) * triton.cdiv(problem["N"], 256) >= 96
        eight = wide or nacc == 2
        cfg.update(TMA=2 if eight else 1, BLOCK_K=min(64, menu["BLOCK_K"][-1]),
                   BLOCK_N=256 if wide else 128, num_warps=8 if eight else 4,
                   num_stages=3 if wide or (nacc == 2 and m >= 1024) else 4)
    if m <= 128:
        cfg.update(BLOCK_M=min(64, max(16, _pow2(m))), BLOCK_N=64 if m <= 16 else cfg["BLOCK_N"],
                   num_warps=4, num_stages=4)
    cfg["BLOCK_N"] = min(cfg["BLOCK_N"], menu["BLOCK_N"][-1])
    for split in (2, 4, 8):
        if m <= 16 and _tiles(cfg, problem) * cfg["SPLIT_K"] < FILL_PROGRAMS and _split_ok(
                {**cfg, "SPLIT_K": split}, problem):
            cfg["SPLIT_K"] = split
    return cfg


def fused_launches(problem: Problem, prologue: str = "") -> int:
    """Launches `_run` makes at the default config: the GEMM (or GEMV), its split-K sum, and
    what runs ahead of a tensor-core GEMM — prologue "gated" (gated_linear: the act·mul
    kernel), "rms" (gemm_rmsnorm: the row-scale pre-pass), "layer" (layernorm_linear: the
    LayerNorm kernel from 2 rows on)."""
    cfg, m = default(problem), problem["M"]
    gemv = cfg["BLOCK_M"] < 16
    ahead = {"gated": not gemv, "rms": not gemv, "layer": m > 1}.get(prologue, False)
    return 1 + int(cfg["SPLIT_K"] > 1) + int(ahead)


SPACE = ConfigSpace(
    axes={
        "BLOCK_M": (1, 2, 4, 8, 16, 32, 64, 128),  # < 16: the GEMV path
        "BLOCK_N": (8, 16, 32, 64, 128, 256),
        "BLOCK_K": (32, 64, 128, 256, 512, 1024),
        "GROUP_M": (8,),
        "num_warps": (4, 8),
        "num_stages": (1, 2, 3, 4),
        "SPLIT_K": (1, 2, 4, 8),
        # 1: _gemm_tma_kernel where x and W allow it (tma_ok), SPLIT_K = 1; 2: its
        # persistent form (a program per SM walks the tiles)
        "TMA": (0, 1, 2),
    },
    default=default,
    keep=keep,
    fill={"TMA": 0},  # configs stored before the axis: pointer loads
)


# ----------------------------------------------------------------------------- launchers


def _check_x_w(x: torch.Tensor, w: torch.Tensor) -> None:
    check_float("x", x)
    check(x.dim() >= 1 and x.shape[-1] > 0, f"x shape {tuple(x.shape)}: need (..., K), K > 0")
    check(w.dim() == 2 and w.shape[1] == x.shape[-1],
          f"w shape {tuple(w.shape)} is not (N, K={x.shape[-1]})")
    check(w.dtype == x.dtype and w.device == x.device,
          f"w is {w.dtype} on {w.device}, x is {x.dtype} on {x.device}")


def _check_like(name: str, t: torch.Tensor, shape: tuple[int, ...], x: torch.Tensor,
                same_dtype: bool = True) -> None:
    check(tuple(t.shape) == shape and t.device == x.device
          and (t.dtype == x.dtype if same_dtype else t.dtype in SUPPORTED_DTYPES),
          f"{name}: expected {shape} {x.dtype if same_dtype else 'float'} on {x.device}, "
          f"got {tuple(t.shape)} {t.dtype} on {t.device}")


def _run(x, w, n: int, *, act: int = -1, bias=None, residual=None, norm=None, gated=False,
         x_up=None, x_act: str = "", layer_norm=None,
         config: Mapping[str, int] | None = None) -> tuple[torch.Tensor, Any]:
    """Checked x (..., K), w (N or 2N, K) -> (y (..., N), compiled GEMM or None).
    norm = (g (K,), eps, weight_offset) selects gemm_rmsnorm; x_up (x's shape) makes the
    GEMM's input act(x)·x_up (`x_act`): computed in the GEMV's prologue, by the gated_act
    kernel ahead of a tensor-core GEMM. layer_norm = (g (K,) or None, β (K,) or None, eps)
    makes it layer_norm(x): in the GEMV's prologue for one row, else by norm.py's LayerNorm
    kernel ahead of the GEMM (x̂ rounded to x's dtype, as eager writes it)."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)  # (M, K): a view when possible; both strides go to the kernel
    u2 = None if x_up is None else x_up.reshape(-1, k)
    if u2 is not None and u2.stride() != x2.stride():  # one set of strides in the kernel
        x2, u2 = x2.contiguous(), u2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)  # (M, N)
    if m == 0 or n == 0:
        return y.view(*x.shape[:-1], n), None
    problem = {"M": m, "N": n, "K": k, "dtype": str(x.dtype), "gated": int(gated)}
    cfg = SPACE.resolve(config, problem)
    r2 = as_rows(residual, n) if residual is not None else y  # (M, N), unit column stride
    b = bias.contiguous() if bias is not None else y  # y: placeholder a flag leaves unused
    split = cfg["SPLIT_K"]
    partials = (torch.empty((split, 1 + int(gated), m, n), dtype=torch.float32, device=x.device)
                if split > 1 else y)
    p_strides = (partials.stride(0), m * n) if split > 1 else (0, 0)
    flags = {"ACT": act, "HAS_BIAS": bias is not None, "HAS_RESIDUAL": residual is not None,
             "GATED": gated}
    if layer_norm is not None and (m > 1 or cfg["BLOCK_M"] >= 16):
        # One row: the GEMV's programs compute its stats themselves. More: each program would
        # redo all M rows' stats ahead of its W tile (H100, session 33, LN -> QKV 4096 ->
        # 12288: 4 rows 151 µs against 39 at 1 row and eager's 78), so norm.py's LayerNorm
        # kernel writes x̂ once (M, K) and the GEMM reads it.
        x2, layer_norm = launch_layer_norm(x2, *layer_norm), None
    if cfg["BLOCK_M"] < 16:
        return y.view(*x.shape[:-1], n), _run_gemv(x2, w, b, r2, y, partials, p_strides, cfg, norm,
                                                    flags, u2, x_act, layer_norm)
    if u2 is not None:  # tensor cores want x in shared memory: the product first
        x2 = launch_gated_act(x2, u2, x_act)
    g, rs, offset = y, y, 0.0  # placeholders for pointers a flag leaves unused
    emulate = interpreting() and x.dtype == torch.bfloat16
    pre_scale = norm is not None and m <= NORM_IN_GEMM_MAX_M  # x·g per A tile in the GEMM
    if norm is not None:
        g, eps, offset = norm[0].contiguous(), float(norm[1]), float(norm[2])
        rs = torch.empty(m, dtype=torch.float32, device=x.device)  # (M,) row scales
        xg = x2 if pre_scale else torch.empty((m, k), dtype=x2.dtype, device=x.device)
        _row_rstd_kernel[(m,)](x2, rs, g, xg, k, x2.stride(0), x2.stride(1), eps, offset,
                               SCALED=not pre_scale, EMULATE=emulate,
                               BLOCK_K=min(4096, _pow2(k)), num_warps=4)
        x2 = xg  # (M, K): x·g, rounded as the prologue rounds it
    precision = "ieee" if emulate or x.dtype == torch.float32 else "tf32"
    tiles = {key: v for key, v in cfg.items() if key != "TMA"}
    if cfg["TMA"] and split == 1 and not pre_scale and tma_ok(x2, w):
        del tiles["SPLIT_K"]
        persistent = cfg["TMA"] == 2
        programs = min(_tiles(cfg, problem), sm_count(x2)) if persistent else _tiles(cfg, problem)
        compiled = _gemm_tma_kernel[(programs,)](
            descriptor(x2, [cfg["BLOCK_M"], cfg["BLOCK_K"]]), descriptor(w, [cfg["BLOCK_N"], cfg["BLOCK_K"]]),
            b, r2, rs, y, m, n, k, r2.stride(0), y.stride(0),
            programs if persistent else 0,  # unused then: one value, one specialisation
            ROW_SCALE=norm is not None, EMULATE=emulate, PRECISION=precision,
            PERSISTENT=persistent, **flags, **tiles)
        return y.view(*x.shape[:-1], n), compiled
    compiled = _gemm_kernel[(_tiles(cfg, problem), split)](
        x2, w, g, b, r2, rs, y, partials, m, n, k, x2.stride(0), x2.stride(1), w.stride(0),
        w.stride(1), r2.stride(0), y.stride(0), p_strides[0], p_strides[1], offset,
        PRE_SCALE=pre_scale, ROW_SCALE=norm is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0, EMULATE=emulate, PRECISION=precision, **flags, **tiles)
    if split > 1:
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        _splitk_epilogue_kernel[grid](
            partials, b, r2, rs, y, m, n, r2.stride(0), y.stride(0), *p_strides,
            ROW_SCALE=norm is not None,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], SPLIT_K=split, GDC=False, num_warps=4,
            **flags)
    return y.view(*x.shape[:-1], n), compiled


def _run_gemv(x2, w, b, r2, y, partials, p_strides, cfg: Config, norm, flags: dict[str, Any],
              u2=None, x_act: str = "", layer_norm=None) -> Any:
    """The GEMV path of `_run` (its buffers and flags): x2 (M, K) with M <= BLOCK_M, y (M, N)
    written in place; the norm's row scales (or the LayerNorm's mean and rstd) are computed
    inside the kernel, and so is act(x2)·u2 when u2 is given. Under PDL
    (`programmatic_launch`) both kernels launch early and the GEMV prefetches W."""
    (m, k), n, split = x2.shape, y.shape[1], cfg["SPLIT_K"]
    g, beta, eps, offset = y, y, 0.0, 0.0  # placeholders for pointers a flag leaves unused
    if norm is not None:
        g, eps, offset = norm[0].contiguous(), float(norm[1]), float(norm[2])
    if layer_norm is not None:
        g, beta = (t.contiguous() if t is not None else y for t in layer_norm[:2])
        eps = float(layer_norm[2])
    pdl = pdl_launch(x2)
    compiled = _gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), split)](
        x2, w, g, b, r2, y, partials, x2 if u2 is None else u2, beta, m, n, k, x2.stride(0), x2.stride(1),
        w.stride(0), w.stride(1), r2.stride(0), y.stride(0), *p_strides, eps, offset,
        NORM=norm is not None or layer_norm is not None,
        EVEN_K=k % cfg["BLOCK_K"] == 0, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], SPLIT_K=split, PREFETCH=pdl["GDC"] or PREFETCH_WITHOUT_PDL,
        X_ACT=-1 if u2 is None else ACTIVATIONS[x_act],
        INTERP_BF16=u2 is not None and interpreting() and x2.dtype == torch.bfloat16,
        CENTER=layer_norm is not None, HAS_G=layer_norm is None or layer_norm[0] is not None,
        HAS_BETA=layer_norm is not None and layer_norm[1] is not None,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], **pdl, **flags)
    if split > 1:
        _splitk_epilogue_kernel[(1, triton.cdiv(n, 128))](
            partials, b, r2, y, y, m, n, r2.stride(0), y.stride(0), *p_strides, ROW_SCALE=False,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=128, SPLIT_K=split, num_warps=4, **pdl, **flags)
    return compiled


def _check_bias_residual(x, w, bias, residual) -> int:
    """Checks x/w and the optional bias (N,) and residual (..., N); returns N."""
    _check_x_w(x, w)
    n = w.shape[0]
    if bias is not None:
        _check_like("bias", bias, (n,), x)
    if residual is not None:
        _check_like("residual", residual, (*x.shape[:-1], n), x)
    return n


def _epilogue_call(x, w, bias, residual, activation, config):
    check(activation in GEMM_ACTIVATIONS, f"activation {activation!r} not in {list(GEMM_ACTIVATIONS)}")
    n = _check_bias_residual(x, w, bias, residual)
    return _run(x, w, n, act=GEMM_ACTIVATIONS[activation], bias=bias, residual=residual,
                config=config)


def _gated_call(gate, up, w, bias, residual, activation, config):
    check(activation in ACTIVATIONS, f"activation {activation!r} not in {list(ACTIVATIONS)}")
    n = _check_bias_residual(gate, w, bias, residual)
    _check_like("up", up, tuple(gate.shape), gate)
    return _run(gate, w, n, bias=bias, residual=residual, x_up=up, x_act=activation, config=config)


def _swiglu_call(x, w_gu, activation, config):
    _check_x_w(x, w_gu)
    check(w_gu.shape[0] % 2 == 0, f"w_gu rows {w_gu.shape[0]}: not [gate; up] (even)")
    check(activation in ACTIVATIONS, f"activation {activation!r} not in {list(ACTIVATIONS)}")
    return _run(x, w_gu, w_gu.shape[0] // 2, act=ACTIVATIONS[activation], gated=True,
                config=config)


def _rmsnorm_call(x, norm_w, w, eps, weight_offset, config, bias=None):
    n = _check_bias_residual(x, w, bias, None)
    _check_like("norm_w", norm_w, (x.shape[-1],), x, same_dtype=False)
    return _run(x, w, n, bias=bias, norm=(norm_w, eps, weight_offset), config=config)


def _layernorm_call(x, norm_w, norm_b, w, bias, eps, activation, config):
    check(activation in GEMM_ACTIVATIONS, f"activation {activation!r} not in {list(GEMM_ACTIVATIONS)}")
    n = _check_bias_residual(x, w, bias, None)
    for name, t in (("norm_w", norm_w), ("norm_b", norm_b)):
        if t is not None:
            _check_like(name, t, (x.shape[-1],), x, same_dtype=False)
    return _run(x, w, n, act=GEMM_ACTIVATIONS[activation], bias=bias,
                layer_norm=(norm_w, norm_b, eps), config=config)


def _rmsnorm_swiglu_call(x, norm_w, w_gu, eps, weight_offset, activation, config):
    _check_x_w(x, w_gu)
    _check_like("norm_w", norm_w, (x.shape[-1],), x, same_dtype=False)
    check(w_gu.shape[0] % 2 == 0, f"w_gu rows {w_gu.shape[0]}: not [gate; up] (even)")
    check(activation in ACTIVATIONS, f"activation {activation!r} not in {list(ACTIVATIONS)}")
    return _run(x, w_gu, w_gu.shape[0] // 2, act=ACTIVATIONS[activation], gated=True,
                norm=(norm_w, eps, weight_offset), config=config)


def launch_gemm_epilogue(x, w, bias=None, residual=None, activation: str = "none",
                         config: Mapping[str, int] | None = None) -> torch.Tensor:
    """act(x·Wᵀ + b) (+ residual): x (..., K), w (N, K), bias (N,), residual (..., N)."""
    return _epilogue_call(x, w, bias, residual, activation, config)[0]


def launch_gated_linear(gate, up, w, bias=None, residual=None, activation: str = "silu",
                        config: Mapping[str, int] | None = None) -> torch.Tensor:
    """(act(gate)·up)·Wᵀ + b (+ residual): gate, up (..., K) (e.g. the halves of a merged
    gate/up output), w (N, K) — the MLP's down projection with SwiGLU/GeGLU before it."""
    return _gated_call(gate, up, w, bias, residual, activation, config)[0]


def launch_gemm_swiglu(x, w_gu, activation: str = "silu",
                       config: Mapping[str, int] | None = None) -> torch.Tensor:
    """act(x·W_gᵀ)·(x·W_uᵀ): x (..., K), w_gu = [W_g; W_u] (2N, K) -> (..., N)."""
    return _swiglu_call(x, w_gu, activation, config)[0]


def launch_gemm_rmsnorm(x, norm_w, w, eps: float, weight_offset: float = 0.0,
                        config: Mapping[str, int] | None = None, bias=None) -> torch.Tensor:
    """rms_norm(x; norm_w, eps, weight_offset)·Wᵀ (+ bias): x (..., K), norm_w (K,), w (N, K),
    bias (N,) or None (added after the row scale: Qwen2's biased Q/K/V)."""
    return _rmsnorm_call(x, norm_w, w, eps, weight_offset, config, bias)[0]


def launch_gemm_layernorm(x, norm_w, norm_b, w, bias=None, eps: float = 1e-5, activation: str = "none",
                          config: Mapping[str, int] | None = None) -> torch.Tensor:
    """act(layer_norm(x; norm_w, norm_b, eps)·Wᵀ + bias): x (..., K), norm_w and norm_b (K,)
    or None, w (N, K), bias (N,) or None. One row: one launch (the norm in the GEMV's
    prologue); more: norm.py's LayerNorm kernel, then the GEMM."""
    return _layernorm_call(x, norm_w, norm_b, w, bias, eps, activation, config)[0]


def launch_gemm_rmsnorm_swiglu(x, norm_w, w_gu, eps: float, weight_offset: float = 0.0,
                               activation: str = "silu",
                               config: Mapping[str, int] | None = None) -> torch.Tensor:
    """act(n·W_gᵀ)·(n·W_uᵀ), n = rms_norm(x): x (..., K), norm_w (K,), w_gu (2N, K) -> (..., N)."""
    return _rmsnorm_swiglu_call(x, norm_w, w_gu, eps, weight_offset, activation, config)[0]


def _n_spills(compiled: Any) -> int | None:
    report = None if interpreting() else resources(compiled)
    return None if report is None else report.n_spills


def spills_gemm_epilogue(x, w, bias=None, residual=None, activation="none", config=None):
    """Register spills of the compiled GEMM (runs it once); None under the interpreter."""
    return _n_spills(_epilogue_call(x, w, bias, residual, activation, config)[1])


def spills_gated_linear(gate, up, w, bias=None, residual=None, activation="silu", config=None):
    return _n_spills(_gated_call(gate, up, w, bias, residual, activation, config)[1])


def spills_gemm_swiglu(x, w_gu, activation="silu", config=None):
    return _n_spills(_swiglu_call(x, w_gu, activation, config)[1])


def spills_gemm_rmsnorm(x, norm_w, w, eps, weight_offset=0.0, config=None, bias=None):
    return _n_spills(_rmsnorm_call(x, norm_w, w, eps, weight_offset, config, bias)[1])


def spills_gemm_layernorm(x, norm_w, norm_b, w, bias=None, eps=1e-5, activation="none", config=None):
    return _n_spills(_layernorm_call(x, norm_w, norm_b, w, bias, eps, activation, config)[1])


def spills_gemm_rmsnorm_swiglu(x, norm_w, w_gu, eps, weight_offset=0.0, activation="silu", config=None):
    return _n_spills(_rmsnorm_swiglu_call(x, norm_w, w_gu, eps, weight_offset, activation, config)[1])


# ----------------------------------------------------------------------------- custom ops


def _use_triton(x: torch.Tensor) -> bool:
    return triton_can_run(x) and x.dtype in SUPPORTED_DTYPES


@torch.library.custom_op(
    "advisor::gemm_epilogue", mutates_args=(),
    schema="(Tensor x, Tensor w, Tensor? bias, Tensor? residual, str activation, str config) "
           "-> Tensor")
def gemm_epilogue(x, w, bias, residual, activation, config):
    if _use_triton(x):
        return launch_gemm_epilogue(x, w, bias, residual, activation, decode(config))
    return reference(x, w, bias, residual, activation).contiguous()


@torch.library.custom_op(
    "advisor::gemm_swiglu", mutates_args=(),
    schema="(Tensor x, Tensor w_gu, str activation, str config) -> Tensor")
def gemm_swiglu(x, w_gu, activation, config):
    if _use_triton(x):
        return launch_gemm_swiglu(x, w_gu, activation, decode(config))
    return reference_swiglu(x, w_gu, activation).contiguous()


@torch.library.custom_op(
    "advisor::gemm_rmsnorm", mutates_args=(),
    schema="(Tensor x, Tensor norm_w, Tensor w, float eps, float weight_offset, str config) "
           "-> Tensor")
def gemm_rmsnorm(x, norm_w, w, eps, weight_offset, config):
    if _use_triton(x):
        return launch_gemm_rmsnorm(x, norm_w, w, eps, weight_offset, decode(config))
    return reference_rmsnorm(x, norm_w, w, eps, weight_offset).contiguous()


@torch.library.custom_op(
    "advisor::gated_linear", mutates_args=(),
    schema="(Tensor gate, Tensor up, Tensor w, Tensor? bias, Tensor? residual, str activation, "
           "str config) -> Tensor")
def gated_linear(gate, up, w, bias, residual, activation, config):
    if _use_triton(gate):
        return launch_gated_linear(gate, up, w, bias, residual, activation, decode(config))
    return reference_gated(gate, up, w, bias, residual, activation).contiguous()


def _out_like(x: torch.Tensor, n) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


gemm_epilogue.register_fake(lambda x, w, bias, residual, activation, config: _out_like(x, w.shape[0]))
gemm_swiglu.register_fake(lambda x, w_gu, activation, config: _out_like(x, w_gu.shape[0] // 2))
gemm_rmsnorm.register_fake(
    lambda x, norm_w, w, eps, weight_offset, config: _out_like(x, w.shape[0]))
gated_linear.register_fake(
    lambda gate, up, w, bias, residual, activation, config: _out_like(gate, w.shape[0]))


# ----------------------------------------------------------------------------- registry

EPS = 1e-6
_ACT_NAMES = {code: name for name, code in GEMM_ACTIVATIONS.items()}


def _x_w(dims, rows: int, dtype, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) ~ N(0, 1) and w (rows, K) ~ N(0, 1/K), so outputs are ~ N(0, 1)."""
    x = randn_nonzero((dims["M"], dims["K"]), dtype, device, generator)
    return x, randn_nonzero((rows, dims["K"]), dtype, device, generator, dims["K"] ** -0.5)


def _make_epilogue(dims, dtype, device, generator) -> tuple[Any, ...]:
    x, w = _x_w(dims, dims["N"], dtype, device, generator)
    b = randn_nonzero((dims["N"],), dtype, device, generator, 0.5) if dims.get("bias") else None
    r = randn_nonzero((dims["M"], dims["N"]), dtype, device, generator) if dims.get("residual") else None
    return x, w, b, r, _ACT_NAMES[dims.get("act", -1)]


def _make_swiglu(dims, dtype, device, generator) -> tuple[Any, ...]:
    return (*_x_w(dims, 2 * dims["N"], dtype, device, generator), _ACT_NAMES[dims.get("act", 0)])


def _make_rmsnorm(dims, dtype, device, generator) -> tuple[Any, ...]:
    x, w = _x_w(dims, dims["N"], dtype, device, generator)
    norm_w = randn_nonzero((dims["K"],), dtype, device, generator, 0.5)
    return x, norm_w, w, EPS, float(dims.get("weight_offset", 0))


def _make_gated(dims, dtype, device, generator) -> tuple[Any, ...]:
    gate, w, b, r, _ = _make_epilogue(dims, dtype, device, generator)
    up = randn_nonzero(tuple(gate.shape), dtype, device, generator)
    return gate, up, w, b, r, _ACT_NAMES[dims.get("act", 0)]


def _problem(x: torch.Tensor, w: torch.Tensor, gated: bool = False) -> Problem:
    k = x.shape[-1]
    n = w.shape[0] // 2 if gated else w.shape[0]
    return {"M": x.numel() // k, "N": n, "K": k, "dtype": str(x.dtype), "gated": int(gated)}


def _bytes(n: int, x: torch.Tensor, *tensors: torch.Tensor | None) -> int:
    """x and each other input read once plus the (M, N) output written once."""
    out = x.numel() // x.shape[-1] * n * x.element_size()
    return out + sum(t.numel() * t.element_size() for t in (x, *tensors) if t is not None)


def _flops(x: torch.Tensor, w: torch.Tensor) -> int:
    """2·M·N·K of x (..., K) · wᵀ (N, K); for the merged gate/up weight N is both halves."""
    return 2 * (x.numel() // x.shape[-1]) * w.shape[0] * x.shape[-1]


def _spec(name: str, *, bench_n: int, bench_extra: Mapping[str, int], **fields: Any) -> KernelSpec:
    return register(KernelSpec(
        name=name, space=SPACE, usable=lambda x, *_: _use_triton(x), matrix_kernel=True,
        bench_dims=lambda tokens: {"M": tokens, "K": 4096, "N": bench_n, **bench_extra}, **fields))


_spec("gemm_epilogue", reference=reference, unfused=unfused, launch=launch_gemm_epilogue,
      make_inputs=_make_epilogue, problem=lambda x, w, *_: _problem(x, w),
      flops=lambda x, w, *_: _flops(x, w),
      bytes_moved=lambda x, w, b, r, act: _bytes(w.shape[0], x, w, b, r),
      test_dims=({"M": 3, "K": 24, "N": 8, "bias": 1, "residual": 1, "act": 1},
                 {"M": 17, "K": 40, "N": 40, "act": 2}, {"M": 1, "K": 40, "N": 40, "residual": 1}),
      bench_n=4096, bench_extra={"residual": 1},  # o_proj + residual add
      unfused_launches=2, spills=spills_gemm_epilogue, launches=fused_launches)  # o_proj GEMM, residual add
_spec("gemm_swiglu", reference=reference_swiglu, unfused=unfused_swiglu, launch=launch_gemm_swiglu,
      make_inputs=_make_swiglu, problem=lambda x, w_gu, act: _problem(x, w_gu, gated=True),
      flops=lambda x, w_gu, act: _flops(x, w_gu),
      bytes_moved=lambda x, w_gu, act: _bytes(w_gu.shape[0] // 2, x, w_gu),
      test_dims=({"M": 3, "K": 24, "N": 8}, {"M": 17, "K": 40, "N": 40, "act": 1},
                 {"M": 1, "K": 40, "N": 40, "act": 3}),
      bench_n=14336, bench_extra={},  # Llama-3-8B MLP gate/up
      unfused_launches=4, spills=spills_gemm_swiglu, launches=fused_launches)  # gate GEMM, up GEMM, act, mul
_spec("gemm_rmsnorm", reference=reference_rmsnorm, unfused=unfused_rmsnorm, launch=launch_gemm_rmsnorm,
      make_inputs=_make_rmsnorm, problem=lambda x, norm_w, w, *_: _problem(x, w),
      flops=lambda x, norm_w, w, *_: _flops(x, w),
      bytes_moved=lambda x, norm_w, w, *_: _bytes(w.shape[0], x, norm_w, w),
      test_dims=({"M": 3, "K": 24, "N": 8}, {"M": 17, "K": 40, "N": 40, "weight_offset": 1},
                 {"M": 1, "K": 40, "N": 40}),
      bench_n=6144, bench_extra={},  # input norm -> merged QKV (4096 + 2·1024)
      unfused_launches=9, spills=spills_gemm_rmsnorm,  # eager RMSNorm 8 (norm.py) + GEMM
      launches=lambda p: fused_launches(p, "rms"))
_spec("gated_linear", reference=reference_gated, unfused=unfused_gated, launch=launch_gated_linear,
      make_inputs=_make_gated, problem=lambda gate, up, w, *_: _problem(gate, w),
      flops=lambda gate, up, w, *_: _flops(gate, w),
      bytes_moved=lambda gate, up, w, b, r, act: _bytes(w.shape[0], gate, up, w, b, r),
      test_dims=({"M": 1, "K": 40, "N": 24, "residual": 1}, {"M": 3, "K": 24, "N": 8, "bias": 1, "act": 1},
                 {"M": 17, "K": 40, "N": 40, "residual": 1, "act": 2}),
      bench_n=4096, bench_extra={"K": 14336, "residual": 1},  # SwiGLU -> down_proj + residual
      unfused_launches=4, spills=spills_gated_linear,  # act, mul, down GEMM, residual add
      launches=lambda p: fused_launches(p, "gated"))
