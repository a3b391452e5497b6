"""Bias + activation: `act(x + bias)` in one pass (GPT-2 / BERT / Phi-2 MLPs, `nn.Linear` then act).

When a linear layer's bias is not folded into its GEMM (or the GEMM runs without epilogue),
eager torch adds the bias and applies the activation as two kernels, writing `x + bias` to
HBM and reading it back:

    unfused bytes = read x + read bias + write h + read h + write out = 4 · rows · N · elt + N · elt
    fused bytes   = read x + read bias + write out                    = 2 · rows · N · elt + N · elt
    saved         = 2 · rows · N · elt, 1 launch.

Like eager, the sum is rounded to x.dtype before the activation (`x + b` in bf16 is a bf16
tensor); the activation then runs in fp32. The activation math, its torch twin and the 2-D
elementwise config space come from `gated_act`, so the formulas live once.

Example (CPU needs TRITON_INTERPRET=1; on CUDA it runs the compiled kernel)::

    import torch, advisor.kernels.bias_act
    x, b = torch.randn(4, 1000), torch.randn(1000)
    out = torch.ops.advisor.bias_act(x, b, "gelu_tanh", "")   # == gelu(x + b, "tanh")
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from advisor.kernels._triton import check, check_float, interpreting, resources, triton_can_run
from advisor.kernels.gated_act import (
    TEST_DIMS,
    activation_code,
    activation_of,
    activation_ref,
    apply_activation,
    as_rows,
    even_of,
    grid_of,
    out_buffer,
    tile_index,
    tile_mask,
)
from advisor.kernels.gated_act import TILE_SPACE as SPACE  # 2-D tiles; flat: gated_act only
from advisor.kernels.registry import KernelSpec, register
from advisor.kernels.space import Problem, decode
from advisor.kernels.testing import randn_nonzero


def reference(x: torch.Tensor, bias: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(x + bias)`: the sum rounded to x.dtype (as eager), act in fp32, cast to x.dtype.
    x: (..., N), bias: (N,)."""
    h = (x.float() + bias.float()).to(x.dtype)
    return activation_ref(activation, h.float()).to(x.dtype)


@triton.jit
def _round_like(h, like):
    """fp32 `h` rounded to `like`'s dtype (ties to even), kept in fp32. bf16 is rounded with
    integer ops: the same bits as the GPU's cvt.rn, and Triton's CPU interpreter (which
    truncates fp32 -> bf16) then agrees with it."""
    if like.dtype == tl.bfloat16:
        bits = h.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        r = tl.where(h != h, h, bits.to(tl.float32, bitcast=True))  # NaN stays NaN
    else:
        r = h.to(like.dtype).to(tl.float32)
    return r


@triton.jit
def _bias_act_kernel(
    x_ptr,  # (n_rows, n_cols) rows `stride_x` apart, last dim contiguous
    bias_ptr,  # (n_cols,) contiguous, dtype = x dtype
    out_ptr,  # (n_rows, n_cols) rows `stride_out` apart; dtype = x dtype
    n_rows,
    n_cols,
    stride_x,
    stride_out,
    ACT: tl.constexpr,  # activation code, see gated_act.ACTIVATIONS
    BLOCK_M: tl.constexpr,  # rows per program (the bias slice is loaded once for all)
    BLOCK_N: tl.constexpr,  # columns per program
    EVEN_M: tl.constexpr,  # n_rows % BLOCK_M == 0: no row bounds check
    EVEN_N: tl.constexpr,  # n_cols % BLOCK_N == 0: no column bounds check
):
    rows, cols = tile_index(n_cols, BLOCK_M, BLOCK_N)  # 1-D grid, column tiles fastest
    rows64 = rows.to(tl.int64)[:, None]
    x_ptrs = x_ptr + rows64 * stride_x + cols[None, :]
    o_ptrs = out_ptr + rows64 * stride_out + cols[None, :]
    # x is read once (evict_first); the bias slice is shared by every row tile (default policy).
    if EVEN_M and EVEN_N:
        x = tl.load(x_ptrs, eviction_policy="evict_first")
    else:
        mask = tile_mask(rows, cols, n_rows, n_cols, EVEN_M, EVEN_N)
        x = tl.load(x_ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    if EVEN_N:
        b = tl.load(bias_ptr + cols)  # (BN,)
    else:
        b = tl.load(bias_ptr + cols, mask=cols < n_cols, other=0.0)
    # Round the sum to the input dtype first, as eager `x + b` does, then act in fp32.
    h = _round_like(x.to(tl.float32) + b.to(tl.float32)[None, :], x)  # (BM, BN) fp32
    y = apply_activation(h, ACT)
    out = y.to(out_ptr.dtype.element_ty)
    if EVEN_M and EVEN_N:
        tl.store(o_ptrs, out)
    else:
        tl.store(o_ptrs, out, mask=mask)


def _check_inputs(x: torch.Tensor, bias: torch.Tensor, activation: str) -> None:
    check_float("x", x)
    check(x.dim() >= 1, "x must have at least one dimension")
    check(bias.dim() == 1 and bias.shape[0] == x.shape[-1],
          f"bias shape {tuple(bias.shape)} != ({x.shape[-1]},)")
    check(bias.dtype == x.dtype, f"bias dtype {bias.dtype} != x dtype {x.dtype}")
    check(bias.device == x.device, f"bias on {bias.device}, x on {x.device}")
    activation_code(activation)


def _prepare(x: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, activation: str,
             config: Mapping[str, int] | None) -> tuple[tuple, dict[str, int], tuple[int]]:
    """Kernel arguments, constexprs and grid; x (..., N) viewed as (rows, N)."""
    n_cols = x.shape[-1]
    x2, out2 = as_rows(x, n_cols), out.view(-1, n_cols)  # (rows, N)
    n_rows = x2.shape[0]
    cfg = SPACE.resolve(config, {"n_rows": n_rows, "n_cols": n_cols, "dtype": str(x.dtype)})
    args = (x2, bias.contiguous(), out2, n_rows, n_cols, x2.stride(0), out2.stride(0))
    meta = {"ACT": activation_code(activation), **cfg, **even_of(cfg, n_rows, n_cols)}
    return args, meta, grid_of(cfg, n_rows, n_cols)


def launch_bias_act(x: torch.Tensor, bias: torch.Tensor, activation: str,
                    config: Mapping[str, int] | None = None, *,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """`act(x + bias)` with the Triton kernel. x: (..., N), rows may be strided; bias: (N,)."""
    _check_inputs(x, bias, activation)
    out = out_buffer(x, tuple(x.shape), out)
    if out.numel() == 0:
        return out
    args, meta, grid = _prepare(x, bias, out, activation, config)
    _bias_act_kernel[grid](*args, **meta)
    return out


def spills_bias_act(x: torch.Tensor, bias: torch.Tensor, activation: str,
                    config: Mapping[str, int] | None = None) -> int | None:
    """Register spills of the compiled kernel; None under the interpreter or off CUDA."""
    _check_inputs(x, bias, activation)
    if interpreting() or x.device.type != "cuda" or x.numel() == 0:
        return None
    args, meta, grid = _prepare(x, bias, torch.empty_like(x, memory_format=torch.contiguous_format),
                                activation, config)
    report = resources(_bias_act_kernel.warmup(*args, grid=grid, **meta))
    return None if report is None else report.n_spills


@torch.library.custom_op("advisor::bias_act", mutates_args=())
def bias_act(x: torch.Tensor, bias: torch.Tensor, activation: str, config: str) -> torch.Tensor:
    if triton_can_run(x):
        return launch_bias_act(x, bias, activation, decode(config) or None)
    return reference(x, bias, activation)


@bias_act.register_fake
def _(x: torch.Tensor, bias: torch.Tensor, activation: str, config: str) -> torch.Tensor:
    return x.new_empty(x.shape)


def _make_inputs(dims: Mapping[str, int], dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator) -> tuple[Any, ...]:
    x = randn_nonzero((dims["rows"], dims["n"]), dtype, device, generator)
    bias = randn_nonzero((dims["n"],), dtype, device, generator, scale=0.5)
    return x, bias, activation_of(dims, "gelu_tanh")


def _problem(x: torch.Tensor, bias: torch.Tensor, activation: str) -> Problem:
    n_cols = x.shape[-1]
    return {"n_rows": x.numel() // max(n_cols, 1), "n_cols": n_cols, "dtype": str(x.dtype)}


register(KernelSpec(
    name="bias_act",
    reference=reference,
    launch=launch_bias_act,
    space=SPACE,
    make_inputs=_make_inputs,
    problem=_problem,
    bytes_moved=lambda x, b, act: (2 * x.numel() + b.numel()) * x.element_size(),
    test_dims=TEST_DIMS,
    bench_dims=lambda tokens: {"rows": tokens, "n": 14336},
    unfused_launches=2,  # x + bias, then act
    spills=spills_bias_act,
))
