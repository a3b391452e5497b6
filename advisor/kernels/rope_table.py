"""RoPE's cos/sin tables from positions and inverse frequencies, in one launch.

Every `transformers` rotary embedding computes, per forward (per decode step),

    f = positions.float() ⊗ inv_freq           (B, T, R/2)  fp32 (a broadcast product, or a
                                                 bmm with K = 1 and a transpose)
    e = cat(f, f)                              (B, T, R)
    cos, sin = (cos(e)·scale).to(dtype), (sin(e)·scale).to(dtype)

as 6–9 small aten kernels (casts, the product, cat, cos, sin, two casts back): H200 decode
profile, session 9: ≈ 11 µs of a 1.28 ms step, each kernel on the critical path and launched
outside the PDL chain. Here one program per block of ROWS (b, t) rows computes f in fp32 and
writes both tables: 1 launch, the tables written once. Bytes are tiny (B·T·R per table);
what is saved is launches and their serial latency.

    a, b: any shapes broadcasting to f's (at most 3-D), any dtypes (converted to fp32 as
          `.float()` would); dup: e = cat(f, f) (else e = f); out: two contiguous tables of
          e's shape in `dtype`.

cos/sin run libdevice's precise cosf/sinf on the GPU (torch's CUDA cos/sin use the same
implementation; approximate forms lose digits at the large angles of long contexts) and
tl.cos/tl.sin under the interpreter.

Example (CPU needs TRITON_INTERPRET=1)::

    pos = torch.arange(7)[None, :, None]; inv = 1.0 / 10000 ** (torch.arange(0, 16, 2) / 16)
    cos, sin = launch_rope_table(pos, inv, 1.0, 1.0, True, torch.bfloat16)   # (1, 7, 16) each
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from advisor.kernels._triton import (
    cast_rn,
    check,
    gdc_enter,
    interpreting,
    pdl_launch,
    resources,
    triton_can_run,
)
from advisor.kernels.registry import KernelSpec, register
from advisor.kernels.space import Config, ConfigSpace, Problem, decode

try:  # precise cosf/sinf (the interpreter has no libdevice: it takes tl.cos/tl.sin)
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - every supported triton has it
    libdevice = None


def reference(a: torch.Tensor, b: torch.Tensor, cos_scale: float, sin_scale: float, dup: bool,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of e = cat(f, f) (or f), f = a.float() * b.float(), scaled, in dtype."""
    f = a.float() * b.float()
    e = torch.cat((f, f), dim=-1) if dup else f
    return (e.cos() * cos_scale).to(dtype), (e.sin() * sin_scale).to(dtype)


@triton.jit
def _trig(f, PRECISE: tl.constexpr):
    if PRECISE:
        c = libdevice.cos(f)
        s = libdevice.sin(f)
    else:
        c = tl.cos(f)
        s = tl.sin(f)
    return c, s


@triton.jit
def _rope_table_kernel(
    A, B,  # factors, read through 3-D broadcast strides (0 on broadcast dims)
    COS, SIN,  # (N_ROWS, W) contiguous outputs, W = 2·H if DUP else H
    N_ROWS, D1, H,  # rows = D0·D1 (the leading dims of f), H = f's last dim
    sa0, sa1, sa2, sb0, sb1, sb2,
    cos_scale, sin_scale,
    DUP: tl.constexpr, PRECISE: tl.constexpr, INTERP_BF16: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_H: tl.constexpr, GDC: tl.constexpr,
):
    gdc_enter(GDC)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # (ROWS,)
    h = tl.arange(0, BLOCK_H)  # (BH,)
    mask = (rows < N_ROWS)[:, None] & (h < H)[None, :]
    i0 = (rows // D1).to(tl.int64)[:, None]
    i1 = (rows % D1).to(tl.int64)[:, None]
    a = tl.load(A + i0 * sa0 + i1 * sa1 + h[None, :] * sa2, mask=mask, other=0).to(tl.float32)
    b = tl.load(B + i0 * sb0 + i1 * sb1 + h[None, :] * sb2, mask=mask, other=0).to(tl.float32)
    c, s = _trig(a * b, PRECISE)  # (ROWS, BH) fp32
    c = cast_rn(c * cos_scale, COS.dtype.element_ty, INTERP_BF16)
    s = cast_rn(s * sin_scale, SIN.dtype.element_ty, INTERP_BF16)
    width = 2 * H if DUP else H
    out = rows.to(tl.int64)[:, None] * width + h[None, :]
    tl.store(COS + out, c, mask=mask)
    tl.store(SIN + out, s, mask=mask)
    if DUP:
        tl.store(COS + out + H, c, mask=mask)
        tl.store(SIN + out + H, s, mask=mask)


# --------------------------------------------------------------------------- config space


def _keep(cfg: Config, p: Problem) -> bool:
    return cfg["ROWS"] <= max(1, triton.next_power_of_2(p["rows"]))


def _default(p: Problem) -> Config:
    """A decode step has one row: one program. Prefill: 16 rows per program."""
    rows = min(16, triton.next_power_of_2(max(p["rows"], 1)))
    return {"ROWS": rows, "num_warps": 4 if rows * p["half"] >= 1024 else 1}


SPACE = ConfigSpace(axes={"ROWS": (1, 4, 16, 64), "num_warps": (1, 4)}, default=_default, keep=_keep)


# --------------------------------------------------------------------------- launcher


def _shape(a: torch.Tensor, b: torch.Tensor) -> tuple[int, ...]:
    try:
        shape = tuple(torch.broadcast_shapes(a.shape, b.shape))
    except RuntimeError:
        check(False, f"a {tuple(a.shape)} and b {tuple(b.shape)} do not broadcast")
    check(1 <= len(shape) <= 3, f"f = a·b must have 1-3 dims, got {shape}")
    return shape


def _problem(a: torch.Tensor, b: torch.Tensor) -> Problem:
    shape = _shape(a, b)
    return {"rows": math.prod(shape[:-1]), "half": shape[-1]}


def _prepare(a, b, cos_scale, sin_scale, dup, dtype, config):
    check(isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), "a and b must be tensors")
    check(a.device == b.device, f"a on {a.device}, b on {b.device}")
    check(dtype in (torch.float32, torch.float16, torch.bfloat16), f"dtype {dtype} not fp32/fp16/bf16")
    shape = _shape(a, b)
    full = (1,) * (3 - len(shape)) + shape  # (D0, D1, H)
    a3, b3 = a.expand(shape).view(full), b.expand(shape).view(full)
    width = 2 * shape[-1] if dup else shape[-1]
    out_shape = (*shape[:-1], width)
    cos = torch.empty(out_shape, dtype=dtype, device=a.device)
    sin = torch.empty(out_shape, dtype=dtype, device=a.device)
    p = _problem(a, b)
    cfg = SPACE.resolve(config, p)
    args = (a3, b3, cos, sin, p["rows"], full[1], full[2], *a3.stride(), *b3.stride(),
            float(cos_scale), float(sin_scale))
    meta = {"DUP": bool(dup), "PRECISE": not interpreting() and libdevice is not None,
            "INTERP_BF16": interpreting() and dtype == torch.bfloat16,
            "ROWS": cfg["ROWS"], "BLOCK_H": triton.next_power_of_2(shape[-1]),
            "num_warps": cfg["num_warps"]}
    return args, meta, (triton.cdiv(p["rows"], cfg["ROWS"]),), cos, sin


def launch_rope_table(a: torch.Tensor, b: torch.Tensor, cos_scale: float, sin_scale: float,
                      dup: bool, dtype: torch.dtype,
                      config: Mapping[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    args, meta, grid, cos, sin = _prepare(a, b, cos_scale, sin_scale, dup, dtype, config)
    if cos.numel():
        _rope_table_kernel[grid](*args, **meta, **pdl_launch(cos))
    return cos, sin


def spills_rope_table(a, b, cos_scale, sin_scale, dup, dtype, config=None) -> int | None:
    if interpreting() or a.device.type != "cuda":
        return None
    args, meta, grid, _, _ = _prepare(a, b, cos_scale, sin_scale, dup, dtype, config)
    report = resources(_rope_table_kernel.warmup(*args, grid=grid, GDC=False, **meta))
    return None if report is None else report.n_spills


@torch.library.custom_op(
    "advisor::rope_table", mutates_args=(),
    schema="(Tensor a, Tensor b, float cos_scale, float sin_scale, bool dup, ScalarType dtype, "
           "str config) -> (Tensor, Tensor)")
def rope_table(a, b, cos_scale, sin_scale, dup, dtype, config):
    if triton_can_run(a):
        return launch_rope_table(a, b, cos_scale, sin_scale, dup, dtype, decode(config))
    c, s = reference(a, b, cos_scale, sin_scale, dup, dtype)
    return c.contiguous(), s.contiguous()


@rope_table.register_fake
def _(a, b, cos_scale, sin_scale, dup, dtype, config):
    shape = torch.broadcast_shapes(a.shape, b.shape)
    out = (*shape[:-1], 2 * shape[-1] if dup else shape[-1])
    return a.new_empty(out, dtype=dtype), a.new_empty(out, dtype=dtype)


# --------------------------------------------------------------------------- registry


def _make_inputs(dims: Mapping[str, int], dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator) -> tuple[Any, ...]:
    """HF's form: integer positions (B, T, 1) from an offset, inv_freq (H,) fp32."""
    half, start = dims["half"], dims.get("start", 0)
    pos = (start + torch.arange(dims["tokens"])).expand(dims["batch"], -1)[..., None].to(device)
    inv = 1.0 / (10000.0 ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half)))
    scale = float(dims.get("scale", 1.0))
    return pos, inv.to(device), scale, scale, bool(dims.get("dup", 1)), dtype


def _bytes(a, b, cs, ss, dup, dtype) -> int:
    shape = torch.broadcast_shapes(a.shape, b.shape)
    n = 1
    for d in shape:
        n *= d
    elt = torch.empty((), dtype=dtype).element_size()
    return a.numel() * a.element_size() + b.numel() * b.element_size() + 2 * n * (2 if dup else 1) * elt


register(KernelSpec(
    name="rope_table", reference=reference, launch=launch_rope_table, space=SPACE,
    make_inputs=_make_inputs, problem=lambda a, b, *_: _problem(a, b), bytes_moved=_bytes,
    test_dims=({"batch": 1, "tokens": 1, "half": 64, "start": 4000},
               {"batch": 2, "tokens": 7, "half": 5, "dup": 0, "scale": 0.5},
               {"batch": 3, "tokens": 33, "half": 12, "start": 17}),
    bench_dims=lambda tokens: {"batch": 1, "tokens": tokens, "half": 64, "start": 2048},
    unfused_launches=7,  # positions to fp32, product, cat, cos, sin, two casts
    spills=spills_rope_table,
))
