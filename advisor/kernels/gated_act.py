"""Gated activation: `act(gate) * up` in one pass (SwiGLU, GeGLU, ReGLU).

The MLP of Llama/Mistral/Qwen computes `down(act(gate(x)) * up(x))`. Eager torch runs
`act(gate)` and the product as two kernels, writing `act(gate)` to HBM and reading it back:

    unfused bytes = read gate + write a + read a + read up + write out = 5 · rows · N · elt
    fused bytes   = read gate + read up + write out                    = 3 · rows · N · elt
    saved         = 2 · rows · N · elt  (Llama-3-8B, N=14336, bf16: 57 KB per token), 1 launch.

`gated_act_merged` reads a merged projection output `gu = [gate | up]` of width 2N (Phi-3's
`gate_up_proj`, vLLM's `MergedColumnParallelLinear`) with the same kernels: the halves are
strided views, so `torch.chunk` costs no copy.

The activation math (`silu`, `gelu_erf`, `gelu_tanh`, `relu`, `relu2`, `apply_activation`) and its
torch twin `activation_ref` live here once; `bias_act` imports them, and so does the shared
2-D elementwise config space `TILE_SPACE` and tiling (`tile_index`, `tile_mask`, `grid_of`,
`even_of`).

Memory access follows Inductor's pointwise kernels: a flattened 1-D grid whose consecutive
programs take consecutive column tiles of a row (neighbouring memory in flight together),
loads and stores without masks when the tile divides the problem (EVEN_M, EVEN_N: every
Llama width at the usual token counts), and `evict_first` on the inputs, which are read once.

Two more axes of the config space (`SPACE`), for issue 3 (Inductor's 1-D kernel beat every
2-D tile by 3-7% at 2048-8192 tokens on the H200):
  LAYOUT  1 = 2-D tiles (`_gated_act_kernel`, any row stride: the merged form's halves);
          2 = flat (`_gated_act_flat_kernel`): each program takes BLOCK_N consecutive
          elements of the flattened output, as Inductor's XBLOCK kernel does: one contiguous
          span per program, no masks when BLOCK_N divides numel (EVEN), int32 offsets below
          2^31. Gate and up must share a row stride: contiguous, they are read at the
          output's offsets; as the halves of a merged `[gate | up]` (SPLIT), at
          `row·stride + col` with `row, col = divmod(i, N)`, as Inductor reads a chunk.
  EVICT   L2 hint on gate and up: 1 = none (Inductor's), 2 = evict_first (the default).
A config without these axes (stored before them) means LAYOUT=1, EVICT=2 (`ConfigSpace.fill`).

Example (CPU needs TRITON_INTERPRET=1; on CUDA it runs the compiled kernel)::

    import torch, advisor.kernels.gated_act as ga
    g, u = torch.randn(4, 1000), torch.randn(4, 1000)
    out = torch.ops.advisor.gated_act(g, u, "silu", "")      # == silu(g) * u
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from advisor.kernels._triton import (
    cast_rn,
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

# Activation name -> constexpr code of `apply_activation` (and index used by make_inputs).
ACTIVATIONS: dict[str, int] = {"silu": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3, "quick_gelu": 4,
                               "relu2": 5}  # relu(x)²: NanoChat's and modded-nanogpt's MLP
QUICK_GELU = 1.702  # x·sigmoid(1.702·x): CLIP's and some GPT-style MLPs' GELU approximation


def activation_ref(name: str, x: torch.Tensor) -> torch.Tensor:
    """Eager activation on an fp32 tensor; the torch twin of `apply_activation`."""
    if name == "silu":
        return F.silu(x)
    if name == "gelu":
        return F.gelu(x)  # erf form, as nn.GELU() / HF "gelu"
    if name == "gelu_tanh":
        return F.gelu(x, approximate="tanh")  # HF "gelu_pytorch_tanh" / "gelu_new"
    if name == "relu":
        return F.relu(x)
    if name == "quick_gelu":
        return x * torch.sigmoid(QUICK_GELU * x)
    if name == "relu2":
        return F.relu(x).square()
    raise ValueError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")


def reference(gate: torch.Tensor, up: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` in fp32, cast to gate.dtype. gate, up: (..., N)."""
    return (activation_ref(activation, gate.float()) * up.float()).to(gate.dtype)


def reference_merged(gu: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(gate) * up` for gu = [gate | up]: (..., 2N) -> (..., N)."""
    gate, up = gu.chunk(2, dim=-1)
    return reference(gate, up, activation)


# --- activation math (fp32 in, fp32 out); sigmoid forms avoid libdevice tanh --------------


@triton.jit
def silu(x):
    return x * tl.sigmoid(x)


@triton.jit
def gelu_erf(x):
    return 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))  # 1/sqrt(2)


@triton.jit
def gelu_tanh(x):
    # 0.5·x·(1 + tanh(z)) == x·sigmoid(2z), z = sqrt(2/pi)·(x + 0.044715·x³); no cancellation.
    return x * tl.sigmoid(1.5957691216057308 * (x + 0.044715 * x * x * x))


@triton.jit
def relu(x):
    return tl.where(x < 0.0, 0.0, x)  # NaN passes through, as torch.relu


@triton.jit
def quick_gelu(x):
    return x * tl.sigmoid(1.702 * x)  # QUICK_GELU


@triton.jit
def relu2(x):
    r = relu(x)
    return r * r


@triton.jit
def apply_activation(x, ACT: tl.constexpr):
    """ACT is a code from ACTIVATIONS; resolved at compile time (one branch survives)."""
    if ACT == 0:
        y = silu(x)
    elif ACT == 1:
        y = gelu_erf(x)
    elif ACT == 2:
        y = gelu_tanh(x)
    elif ACT == 3:
        y = relu(x)
    elif ACT == 4:
        y = quick_gelu(x)
    else:
        y = relu2(x)
    return y


# --- tile helpers (shared with bias_act) -------------------------------------------------


@triton.jit
def tile_index(n_cols, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Row and column indices of this program's tile on a flattened 1-D grid.

    Column tiles vary fastest (pid_n = pid % num_n), so programs launched together stream
    neighbouring memory along a row, as Inductor's flattened pointwise kernels do; one grid
    axis also has room for any row count (axes 1 and 2 stop at 65535 programs)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(n_cols, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid - pid_m * num_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # (BM,)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # (BN,)
    return rows, cols


@triton.jit
def tile_mask(rows, cols, n_rows, n_cols, EVEN_M: tl.constexpr, EVEN_N: tl.constexpr):
    """Bounds mask broadcastable to (BM, BN), checking only the axes whose block does not
    divide the problem. Callers skip masks altogether when EVEN_M and EVEN_N."""
    if EVEN_M:
        mask = (cols < n_cols)[None, :]  # (1, BN)
    elif EVEN_N:
        mask = (rows < n_rows)[:, None]  # (BM, 1)
    else:
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]  # (BM, BN)
    return mask


@triton.jit
def _gated_act_kernel(
    gate_ptr,  # (n_rows, n_cols) rows `stride_gate` apart, last dim contiguous
    up_ptr,  # (n_rows, n_cols) rows `stride_up` apart (may be the 2nd half of gate's rows)
    out_ptr,  # (n_rows, n_cols) rows `stride_out` apart; dtype = gate dtype
    n_rows,
    n_cols,
    stride_gate,
    stride_up,
    stride_out,
    ACT: tl.constexpr,  # activation code, see ACTIVATIONS
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # columns per program
    EVEN_M: tl.constexpr,  # n_rows % BLOCK_M == 0: no row bounds check
    EVEN_N: tl.constexpr,  # n_cols % BLOCK_N == 0: no column bounds check
    GDC: tl.constexpr,  # programmatic dependent launch (_triton.pdl_launch)
    EVICT: tl.constexpr = "evict_first",  # L2 hint on gate, up (EVICTIONS): read once
    INTERP_BF16: tl.constexpr = False,  # round to nearest under the interpreter (cast_rn)
):
    gdc_enter(GDC)
    # The program owns the tile rows [pid_m·BM, +BM) × cols [pid_n·BN, +BN), see tile_index.
    rows, cols = tile_index(n_cols, BLOCK_M, BLOCK_N)
    rows64 = rows.to(tl.int64)[:, None]  # rows·stride can pass 2^31 at long prefills
    g_ptrs = gate_ptr + rows64 * stride_gate + cols[None, :]
    u_ptrs = up_ptr + rows64 * stride_up + cols[None, :]
    o_ptrs = out_ptr + rows64 * stride_out + cols[None, :]
    if EVEN_M and EVEN_N:
        g = tl.load(g_ptrs, eviction_policy=EVICT)
        u = tl.load(u_ptrs, eviction_policy=EVICT)
    else:
        mask = tile_mask(rows, cols, n_rows, n_cols, EVEN_M, EVEN_N)
        g = tl.load(g_ptrs, mask=mask, other=0.0, eviction_policy=EVICT)
        u = tl.load(u_ptrs, mask=mask, other=0.0, eviction_policy=EVICT)
    out = _gated(g, u, out_ptr, ACT, INTERP_BF16)
    if EVEN_M and EVEN_N:
        tl.store(o_ptrs, out)
    else:
        tl.store(o_ptrs, out, mask=mask)


@triton.jit
def _gated(g, u, out_ptr, ACT: tl.constexpr, INTERP_BF16: tl.constexpr):
    """act(g)·u in fp32, rounded to out's dtype: the math both layouts share."""
    y = apply_activation(g.to(tl.float32), ACT) * u.to(tl.float32)
    return cast_rn(y, out_ptr.dtype.element_ty, INTERP_BF16)


@triton.jit
def _gated_act_flat_kernel(
    gate_ptr,  # (n_rows, n_cols) rows `stride_in` apart, last dim contiguous
    up_ptr,  # (n_rows, n_cols) rows `stride_in` apart (may be the 2nd half of gate's rows)
    out_ptr,  # (numel,) contiguous; dtype = gate dtype
    numel,  # n_rows · n_cols
    n_cols,
    stride_in,  # row stride of gate and up (n_cols when they are contiguous)
    ACT: tl.constexpr,  # activation code, see ACTIVATIONS
    BLOCK: tl.constexpr,  # consecutive output elements per program
    EVEN: tl.constexpr,  # numel % BLOCK == 0: no bounds check
    INT64: tl.constexpr,  # an offset (output or input) can reach 2^31: int64 offsets
    SPLIT: tl.constexpr,  # stride_in != n_cols: input offset = row·stride_in + col
    GDC: tl.constexpr,  # programmatic dependent launch (_triton.pdl_launch)
    EVICT: tl.constexpr = "",  # L2 hint on gate, up (EVICTIONS)
    INTERP_BF16: tl.constexpr = False,  # round to nearest under the interpreter (cast_rn)
):
    gdc_enter(GDC)
    pid = tl.program_id(0)
    if INT64:
        pid = pid.to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # (BLOCK,) the program's span of the output
    if SPLIT:
        # The halves of a merged [gate | up] row: Inductor's `x1 = i // N; x0 = i % N`.
        row = offs // n_cols
        in_offs = row * stride_in + (offs - row * n_cols)
    else:
        in_offs = offs
    if EVEN:
        g = tl.load(gate_ptr + in_offs, eviction_policy=EVICT)
        u = tl.load(up_ptr + in_offs, eviction_policy=EVICT)
        tl.store(out_ptr + offs, _gated(g, u, out_ptr, ACT, INTERP_BF16))
    else:
        mask = offs < numel
        g = tl.load(gate_ptr + in_offs, mask=mask, other=0.0, eviction_policy=EVICT)
        u = tl.load(up_ptr + in_offs, mask=mask, other=0.0, eviction_policy=EVICT)
        tl.store(out_ptr + offs, _gated(g, u, out_ptr, ACT, INTERP_BF16), mask=mask)


# --- config space: 2-D elementwise tiles (shared with bias_act) ---------------------------

MAX_TILE = 16384  # BLOCK_M·BLOCK_N elements; beyond it a tile only adds register pressure


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _min_tile(problem: Problem) -> int:
    """Tiles below this are not worth trying: big problems fill the GPU with 1024-element
    tiles; a small one (decode) may want smaller tiles for more programs in flight."""
    total = _pow2(problem["n_rows"]) * _pow2(problem["n_cols"])
    return min(1024, max(64, total // 256))


def _warp_range(tile: int) -> tuple[int, int]:
    """8..16 elements per thread (one or two 16-byte vectors in bf16), clipped to 1..16 warps."""
    return min(16, max(1, tile // 512)), min(16, max(1, tile // 256))


def keep_tile(cfg: Config, problem: Problem) -> bool:
    tile = cfg["BLOCK_M"] * cfg["BLOCK_N"]
    lo, hi = _warp_range(tile)
    return (
        tile <= MAX_TILE
        and cfg["BLOCK_N"] <= max(64, _pow2(problem["n_cols"]))  # not wider than the row
        and cfg["BLOCK_M"] <= _pow2(problem["n_rows"])  # not taller than the problem
        and tile >= _min_tile(problem)
        and lo <= cfg["num_warps"] <= hi
    )


def default_tile(problem: Problem) -> Config:
    """Tile ≈ 1/128 of the problem (≥ 64, ≤ 4096 elements), as wide as the row allows."""
    total = _pow2(problem["n_rows"]) * _pow2(problem["n_cols"])
    target = min(4096, max(64, total // 128))
    block_n = min(target, max(64, _pow2(problem["n_cols"])))
    block_m = max(1, min(target // block_n, 16, _pow2(problem["n_rows"])))
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "num_warps": _warp_range(block_m * block_n)[0]}


TILE_AXES: dict[str, tuple[int, ...]] = {
    "BLOCK_N": (64, 128, 256, 512, 1024, 2048, 4096),
    "BLOCK_M": (1, 2, 4, 8, 16),
    "num_warps": (1, 2, 4, 8, 16),
}
TILE_SPACE = ConfigSpace(axes=TILE_AXES, default=default_tile, keep=keep_tile)  # bias_act's

# gated_act's two extra axes (module docstring). Values start at 1: recipes take 1..65536.
TILES, FLAT = 1, 2  # LAYOUT
EVICTIONS: dict[int, str] = {1: "", 2: "evict_first"}  # EVICT -> tl.load eviction_policy
FLAT_BLOCKS = (512, 1024, 2048, 4096)  # BLOCK_N of a flat config: Inductor's XBLOCK ± 2x
FLAT_WARPS = (4, 8)  # 512..4096 elements over 128 or 256 threads: 2..32 per thread


def keep(cfg: Config, problem: Problem) -> bool:
    """Tiles as `keep_tile`, any hint; flat configs only where the launcher can run them:
    gate and up rows one stride apart alike (problem["flat"]: contiguous, or the halves of
    a merged tensor), one row of BLOCK_N elements (BLOCK_M = 1), no wider than the problem.
    A problem without "flat" is taken as strided."""
    if cfg.get("LAYOUT", TILES) == TILES:
        return keep_tile(cfg, problem)
    numel = _pow2(problem["n_rows"] * problem["n_cols"])
    return (bool(problem.get("flat", False)) and cfg["BLOCK_M"] == 1
            and cfg["BLOCK_N"] in FLAT_BLOCKS and cfg["num_warps"] in FLAT_WARPS
            and cfg["BLOCK_N"] <= max(FLAT_BLOCKS[0], numel))


FLAT_DEFAULT_FROM = 1 << 24  # elements: flat wins from here (H200, session 11, below)


def default(problem: Problem) -> Config:
    """Flat, 1024 elements over 4 warps, no L2 hint, for large problems whose gate and up
    share a row stride: at 2048 x 14336 bf16 on the H200 (results/h200-s11A-kernels-gated-
    flat.json) the contiguous form ran 42.2 µs against 45.0 for the tile default and 42.2
    for torch.compile's kernel; the merged form (SPLIT) is predicted the same (its best tile
    ran 42.9 there). Below 2^24 elements, or other strides, the tile default with
    evict_first (what ran before the flat layout; smaller flat problems were not measured)."""
    if problem.get("flat", False) and problem["n_rows"] * problem["n_cols"] >= FLAT_DEFAULT_FROM:
        return {"BLOCK_M": 1, "BLOCK_N": 1024, "num_warps": 4, "LAYOUT": FLAT, "EVICT": 1}
    return {**default_tile(problem), "LAYOUT": TILES, "EVICT": 2}


SPACE = ConfigSpace(
    axes={**TILE_AXES, "LAYOUT": (TILES, FLAT), "EVICT": tuple(EVICTIONS)},
    default=default,
    keep=keep,
    fill={"LAYOUT": TILES, "EVICT": 2},
)


# --- launcher helpers (shared with bias_act) ---------------------------------------------


def activation_code(name: str) -> int:
    check(isinstance(name, str) and name in ACTIVATIONS,
          f"activation {name!r} not one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """(..., n_cols) -> (rows, n_cols) with unit column stride; a view when the leading dims
    merge (e.g. half of a merged projection), else a contiguous copy."""
    rows = t.reshape(-1, n_cols)
    return rows if rows.stride(-1) == 1 or n_cols == 1 else rows.contiguous()


MAX_PROGRAMS = 2**31 - 1  # CUDA's limit on grid axis 0 (axes 1 and 2 stop at 65535)


def grid_of(cfg: Config, n_rows: int, n_cols: int) -> tuple[int]:
    """Flattened 1-D grid of (row tiles × column tiles) programs, decoded by `tile_index`."""
    programs = triton.cdiv(n_rows, cfg["BLOCK_M"]) * triton.cdiv(n_cols, cfg["BLOCK_N"])
    check(programs <= MAX_PROGRAMS, f"{programs} tiles of {cfg['BLOCK_M']}x{cfg['BLOCK_N']} "
          f"exceed the grid limit {MAX_PROGRAMS}; pick a larger tile")
    return (programs,)


def even_of(cfg: Config, n_rows: int, n_cols: int) -> dict[str, bool]:
    """EVEN_M / EVEN_N constexprs: which axes the tile divides (those load/store unmasked)."""
    return {"EVEN_M": n_rows % cfg["BLOCK_M"] == 0, "EVEN_N": n_cols % cfg["BLOCK_N"] == 0}


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_float("gate", gate)
    check(up.dtype == gate.dtype, f"up dtype {up.dtype} != gate dtype {gate.dtype}")
    check(gate.dim() >= 1, "gate must have at least one dimension")
    check(up.shape == gate.shape, f"up shape {tuple(up.shape)} != gate shape {tuple(gate.shape)}")
    check(up.device == gate.device, f"up on {up.device}, gate on {gate.device}")


def out_buffer(like: torch.Tensor, shape: tuple[int, ...],
               out: torch.Tensor | None) -> torch.Tensor:
    """A new output, or the caller's `out=` checked (shape, dtype, device, contiguous)."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check(tuple(out.shape) == shape, f"out shape {tuple(out.shape)} != {shape}")
    check(out.dtype == like.dtype and out.device == like.device, "out dtype/device mismatch")
    check(out.is_contiguous(), "out must be contiguous")
    return out


INT32_SPAN = 2**31  # flat offsets pid·BLOCK + i (< numel rounded up to BLOCK) stay int32 below


def _prepare(gate2: torch.Tensor, up2: torch.Tensor, out2: torch.Tensor, activation: str,
             config: Mapping[str, int] | None,
             flat: bool = False) -> tuple[Any, tuple, dict[str, Any], tuple[int]]:
    """Kernel, arguments, constexprs and grid for 2-D row views (rows, N) of gate, up, out
    (out contiguous). `flat`: gate2 and up2 share a row stride, so flat configs are kept."""
    n_rows, n_cols = gate2.shape
    cfg = SPACE.resolve(config, _problem(n_rows, n_cols, gate2.dtype, flat))
    meta: dict[str, Any] = {"ACT": activation_code(activation), "num_warps": cfg["num_warps"],
                            "EVICT": EVICTIONS[cfg["EVICT"]],
                            "INTERP_BF16": interpreting() and out2.dtype == torch.bfloat16}
    if cfg["LAYOUT"] == FLAT:
        numel, block, stride = n_rows * n_cols, cfg["BLOCK_N"], gate2.stride(0)
        span = triton.cdiv(numel, block) * block  # output offsets, the masked tail's included
        split = n_rows > 1 and stride != n_cols
        in_span = n_rows * stride if split else span  # loads past it are masked off
        meta.update(BLOCK=block, EVEN=numel % block == 0, SPLIT=split,
                    INT64=max(span, in_span) >= INT32_SPAN)
        args = (gate2, up2, out2, numel, n_cols, stride)
        return _gated_act_flat_kernel, args, meta, (triton.cdiv(numel, block),)
    args = (gate2, up2, out2, n_rows, n_cols, gate2.stride(0), up2.stride(0), out2.stride(0))
    meta.update(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], **even_of(cfg, n_rows, n_cols))
    return _gated_act_kernel, args, meta, grid_of(cfg, n_rows, n_cols)


def _launch_rows(gate2: torch.Tensor, up2: torch.Tensor, out: torch.Tensor, activation: str,
                 config: Mapping[str, int] | None, flat: bool = False) -> torch.Tensor:
    kernel, args, meta, grid = _prepare(gate2, up2, out.view(-1, gate2.shape[1]), activation,
                                        config, flat)
    kernel[grid](*args, **meta, **pdl_launch(out))
    return out


def _spills_rows(gate2: torch.Tensor, up2: torch.Tensor, activation: str,
                 config: Mapping[str, int] | None, flat: bool = False) -> int | None:
    if interpreting() or gate2.device.type != "cuda":
        return None
    kernel, args, meta, grid = _prepare(gate2, up2, torch.empty_like(gate2), activation, config,
                                        flat)
    report = resources(kernel.warmup(*args, grid=grid, GDC=False, **meta))
    return None if report is None else report.n_spills


def _flat_pair(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """gate and up laid out alike with a unit last stride (contiguous, or the two halves of
    one merged tensor): their row views (`as_rows`) share a row stride, so the flat layout
    can run."""
    return gate.stride() == up.stride() and (gate.shape[-1] == 1 or gate.stride(-1) == 1)


def _check_merged(gu: torch.Tensor) -> None:
    check_float("gu", gu)
    check(gu.dim() >= 1 and gu.shape[-1] % 2 == 0, f"gu shape {tuple(gu.shape)}: last dim not even")


def _split_merged(gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gu (..., 2N) -> gate, up as (rows, N) views (pointer offset N, row stride of gu)."""
    n_cols = gu.shape[-1] // 2
    gu2 = as_rows(gu, 2 * n_cols)  # (rows, 2N)
    return gu2[:, :n_cols], gu2[:, n_cols:]


def launch_gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str,
                     config: Mapping[str, int] | None = None, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """`act(gate) * up` with the Triton kernel. gate, up: (..., N), rows may be strided."""
    _check_pair(gate, up)
    activation_code(activation)
    out = out_buffer(gate, tuple(gate.shape), out)
    if out.numel() == 0:
        return out
    n_cols = gate.shape[-1]
    return _launch_rows(as_rows(gate, n_cols), as_rows(up, n_cols), out, activation, config,
                        _flat_pair(gate, up))


def launch_gated_act_merged(gu: torch.Tensor, activation: str,
                            config: Mapping[str, int] | None = None, *,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """`act(gate) * up` for gu = [gate | up] (..., 2N) -> (..., N); no copy of the halves."""
    _check_merged(gu)
    activation_code(activation)
    out = out_buffer(gu, (*gu.shape[:-1], gu.shape[-1] // 2), out)
    if out.numel() == 0:
        return out
    return _launch_rows(*_split_merged(gu), out, activation, config, flat=True)


def spills_gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str,
                     config: Mapping[str, int] | None = None) -> int | None:
    """Register spills of the compiled kernel; None under the interpreter or off CUDA."""
    _check_pair(gate, up)
    if gate.numel() == 0:
        return None
    n_cols = gate.shape[-1]
    return _spills_rows(as_rows(gate, n_cols), as_rows(up, n_cols), activation, config,
                        _flat_pair(gate, up))


def spills_gated_act_merged(gu: torch.Tensor, activation: str,
                            config: Mapping[str, int] | None = None) -> int | None:
    _check_merged(gu)
    if gu.numel() == 0:
        return None
    return _spills_rows(*_split_merged(gu), activation, config, flat=True)


# --- custom ops (compose with dynamo, torch.compile and CUDA graphs) ----------------------


@torch.library.custom_op("advisor::gated_act", mutates_args=())
def gated_act(gate: torch.Tensor, up: torch.Tensor, activation: str, config: str) -> torch.Tensor:
    if triton_can_run(gate):
        return launch_gated_act(gate, up, activation, decode(config) or None)
    return reference(gate, up, activation)


@gated_act.register_fake
def _(gate: torch.Tensor, up: torch.Tensor, activation: str, config: str) -> torch.Tensor:
    return gate.new_empty(gate.shape)


@torch.library.custom_op("advisor::gated_act_merged", mutates_args=())
def gated_act_merged(gu: torch.Tensor, activation: str, config: str) -> torch.Tensor:
    if triton_can_run(gu):
        return launch_gated_act_merged(gu, activation, decode(config) or None)
    return reference_merged(gu, activation)


@gated_act_merged.register_fake
def _(gu: torch.Tensor, activation: str, config: str) -> torch.Tensor:
    return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))


# --- registry -----------------------------------------------------------------------------


def activation_of(dims: Mapping[str, int], default_name: str) -> str:
    """dims may pick the activation by its ACTIVATIONS code under "act"."""
    names = {code: name for name, code in ACTIVATIONS.items()}
    return names[dims["act"]] if "act" in dims else default_name


def _make_inputs(dims: Mapping[str, int], dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator) -> tuple[Any, ...]:
    shape = (dims["rows"], dims["n"])
    gate = randn_nonzero(shape, dtype, device, generator)
    return gate, randn_nonzero(shape, dtype, device, generator), activation_of(dims, "silu")


def _make_inputs_merged(dims: Mapping[str, int], dtype: torch.dtype, device: torch.device,
                        generator: torch.Generator) -> tuple[Any, ...]:
    gu = randn_nonzero((dims["rows"], 2 * dims["n"]), dtype, device, generator)
    return gu, activation_of(dims, "silu")


def _problem(rows: int, n_cols: int, dtype: torch.dtype, flat: bool = False) -> Problem:
    """`flat`: gate and up share a row stride (`_flat_pair`), so LAYOUT=FLAT configs can run."""
    return {"n_rows": rows, "n_cols": n_cols, "dtype": str(dtype), "flat": flat}


TEST_DIMS = (
    {"rows": 3, "n": 1000, "act": 0},
    {"rows": 1, "n": 4095, "act": 1},
    {"rows": 5, "n": 77, "act": 2},
    {"rows": 2, "n": 333, "act": 3},
)

register(KernelSpec(
    name="gated_act",
    reference=reference,
    launch=launch_gated_act,
    space=SPACE,
    make_inputs=_make_inputs,
    problem=lambda g, u, act: _problem(g.numel() // max(g.shape[-1], 1), g.shape[-1], g.dtype,
                                       _flat_pair(g, u)),
    bytes_moved=lambda g, u, act: 3 * g.numel() * g.element_size(),
    test_dims=TEST_DIMS,
    bench_dims=lambda tokens: {"rows": tokens, "n": 14336},
    unfused_launches=2,  # act(gate), then * up
    spills=spills_gated_act,
))

register(KernelSpec(
    name="gated_act_merged",
    reference=reference_merged,
    launch=launch_gated_act_merged,
    space=SPACE,
    make_inputs=_make_inputs_merged,
    problem=lambda gu, act: _problem(gu.numel() // max(gu.shape[-1], 1), gu.shape[-1] // 2,
                                     gu.dtype, flat=True),
    bytes_moved=lambda gu, act: 3 * (gu.numel() // 2) * gu.element_size(),
    test_dims=TEST_DIMS,
    bench_dims=lambda tokens: {"rows": tokens, "n": 14336},
    unfused_launches=2,  # chunk is a view; act(gate), then * up
    spills=spills_gated_act_merged,
))
