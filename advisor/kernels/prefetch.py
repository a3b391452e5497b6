"""L2 prefetch of a weight: start reading it from HBM now, use it a few kernels later.

A one-token decode step alternates weight-bound GEMVs with latency-bound stretches where
HBM sits mostly idle: after the QKV projection come RoPE + cache write, the attention
split and its combine (~10 µs per layer at 512-2048 context, reading only a few MB of KV).
The o_proj weight that follows (Llama-3-8B: 4096×4096 bf16, 33.5 MB) fits in the H200's
L2 (50 MB). Issuing its prefetch at the start of the stretch moves its HBM read under the
attention, and the GEMV then streams it from L2.

The kernel only issues prefetches: each program sends `BLOCK` fire-and-forget requests of
`CHUNK` bytes (`cp.async.bulk.prefetch.L2` on sm_90+, whose copy engine fetches the chunk
asynchronously; `prefetch.global.L2::evict_last` per 128-byte line otherwise) and exits.
It writes nothing and its results are never waited on: a prefetch is a hint, outputs are
bit-identical with or without it. Under PDL it waits for its predecessor *first*, so the
traffic starts when the GEMV before it ends instead of competing with it.

    launch_l2_prefetch(w)     # w: any contiguous CUDA tensor; no-op elsewhere
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from advisor.kernels._triton import gdc_enter, interpreting, pdl_launch

LINE = 128  # bytes per cache line: the unit of `prefetch.global.L2`


@triton.jit
def _l2_prefetch_kernel(base, n_chunks, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BULK: tl.constexpr,
                        GDC: tl.constexpr):
    gdc_enter(GDC)  # the stretch this prefetch should overlap starts after the previous kernel
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # Past the end, repeat the last chunk (a hint: a duplicate costs nothing, a mask would
    # need a predicate in the asm). base: uint8 pointer, so offsets are bytes.
    ptrs = base + tl.minimum(idx, n_chunks - 1).to(tl.int64) * CHUNK
    if BULK:
        tl.inline_asm_elementwise(
            f"cp.async.bulk.prefetch.L2.global [$1], {CHUNK}; mov.u32 $0, 0;",
            "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(
            "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;",
            "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@functools.cache
def _bulk_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def l2_bytes(device: torch.device) -> int:
    """The device's L2 size in bytes (0 where there is no CUDA device)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return 0
    return int(torch.cuda.get_device_properties(device).L2_cache_size)


def launch_l2_prefetch(w: torch.Tensor, bulk: bool | None = None, chunk: int = 16384) -> None:
    """Ask L2 to fetch `w`'s bytes. Does nothing off CUDA, under the Triton interpreter
    (no inline PTX there), or for a non-contiguous tensor: a missed hint changes no result.
    `bulk` picks the sm_90 bulk prefetch (default: where supported); `chunk` is the bytes
    per request (a multiple of 16; rounded down to whole lines for per-line prefetch)."""
    if w.device.type != "cuda" or interpreting() or not w.is_contiguous() or w.numel() == 0:
        return
    index = w.device.index if w.device.index is not None else torch.cuda.current_device()
    bulk = _bulk_ok(index) if bulk is None else bulk
    nbytes = w.numel() * w.element_size()
    chunk = max(16, chunk // 16 * 16) if bulk else LINE
    # A bulk request may not run past the tensor: whole chunks only; the tail (< chunk
    # bytes) is left to the GEMV's own loads.
    n_chunks = nbytes // chunk if bulk else triton.cdiv(nbytes, LINE)
    if n_chunks == 0:
        return
    flat = w.view(-1).view(torch.uint8)
    # One request per thread: a warp per program for the few bulk requests (2048 for 33.5
    # MB), 4 warps × 8 lines each for the per-line ones.
    block, warps = (32, 1) if bulk else (1024, 4)
    grid = (triton.cdiv(n_chunks, block),)
    _l2_prefetch_kernel[grid](flat, n_chunks, CHUNK=chunk, BLOCK=block, BULK=bulk, num_warps=warps,
                              **pdl_launch(w))
