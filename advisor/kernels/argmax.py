"""Row argmax of logits in two small launches: greedy token selection for decode loops.

`torch.argmax` over one long row reduces in a single block (H200: 28 µs over Llama-3's
128256 logits); torch's chunked form (max per chunk, argmax over the chunk maxima, a
gather) takes three aten launches, ≈ 11 µs per token in the H200 decode profile (session 9).
Here every program takes one BLOCK-wide chunk of a row (grid (chunks, B)) and writes its
maximum and the first index holding it; one program per row then picks the first chunk
holding the row's maximum. Same answer as torch.argmax, ties and NaN included: the first
maximum wins, and a NaN counts as larger than everything (the first NaN wins).

    logits (B, V), unit stride along V -> (B, 1) int64

Example (CPU needs TRITON_INTERPRET=1; on CUDA it runs the compiled kernels)::

    ids = launch_argmax(torch.randn(2, 1000))   # == x.argmax(-1, keepdim=True)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from advisor.kernels._triton import check, check_float

BLOCK = 1024  # logits per chunk program: 2 KB of bf16, one load per thread of 4 warps
MAX_CHUNKS = 4096  # chunks the picking program holds in one tile (V up to 4M)


def reference(logits: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B, 1) int64, torch.argmax."""
    return logits.argmax(-1, keepdim=True)


@triton.jit
def _first_max(key, is_nan, where, valid, NONE: tl.constexpr):
    """The first `where` of the maximum of `key` over the valid lanes, a NaN lane first when
    there is one; and that maximum (NaN if a NaN won). key: fp32 (N,), NaN mapped to +inf."""
    has_nan = tl.max((is_nan & valid).to(tl.int32), 0)
    best = tl.max(tl.where(valid, key, float("-inf")), 0)
    cand = valid & tl.where(has_nan > 0, is_nan, key == best)
    first = tl.min(tl.where(cand, where, NONE), 0)
    return first, tl.where(has_nan > 0, float("nan"), best)


@triton.jit
def _chunk_max_kernel(X, VAL, IDX, V, stride_b, N_CHUNKS, BLOCK: tl.constexpr):
    """Program (c, b): max and first index of row b's logits [c·BLOCK, +BLOCK) -> VAL, IDX
    at b·N_CHUNKS + c (fp32, int32)."""
    c = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    valid = offs < V
    x = tl.load(X + b * stride_b + offs, mask=valid, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first, best = _first_max(tl.where(is_nan, float("inf"), x), is_nan, offs, valid, 2**31 - 1)
    tl.store(VAL + b * N_CHUNKS + c, best)
    tl.store(IDX + b * N_CHUNKS + c, first)


@triton.jit
def _pick_kernel(VAL, IDX, OUT, N_CHUNKS, BLOCK_C: tl.constexpr):
    """Program b: the first chunk holding row b's maximum; OUT[b] = that chunk's index."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    valid = c < N_CHUNKS
    val = tl.load(VAL + b * N_CHUNKS + c, mask=valid, other=float("-inf"))
    is_nan = val != val
    chunk, _ = _first_max(tl.where(is_nan, float("inf"), val), is_nan, c, valid, BLOCK_C)
    idx = tl.load(IDX + b * N_CHUNKS + c, mask=valid, other=0)
    tl.store(OUT + b, tl.sum(tl.where(c == chunk, idx, 0), 0).to(tl.int64))


def launch_argmax(logits: torch.Tensor) -> torch.Tensor:
    """argmax along the last dim of logits (B, V) -> (B, 1) int64, with the Triton kernels."""
    check_float("logits", logits)
    check(logits.dim() == 2 and logits.shape[1] > 0,
          f"logits shape {tuple(logits.shape)}: need (B, V), V > 0")
    b, v = logits.shape
    chunks = triton.cdiv(v, BLOCK)
    check(chunks <= MAX_CHUNKS, f"vocabulary {v} > {MAX_CHUNKS * BLOCK}")
    out = torch.empty((b, 1), dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    x = logits if logits.stride(1) == 1 else logits.contiguous()
    val = torch.empty((b, chunks), dtype=torch.float32, device=x.device)
    idx = torch.empty((b, chunks), dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(chunks, b)](x, val, idx, v, x.stride(0), chunks, BLOCK=BLOCK, num_warps=4)
    _pick_kernel[(b,)](val, idx, out, chunks, BLOCK_C=max(16, triton.next_power_of_2(chunks)),
                       num_warps=4)
    return out
