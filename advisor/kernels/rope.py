"""Rotary position embedding of q and k in one launch, optionally writing a static KV cache.

Fused: HF `apply_rotary_pos_emb` (per tensor: `x*cos`, slice+neg, `cat`, `rotate_half*sin`,
add ≈ 5 kernels, 10 for q and k) and, in the cache form, StaticCache's two `index_copy_`.
With E = element size, N = B·Hq·T·D + B·Hkv·T·D (q and k), C = Bc·T·R (one table):

    eager rope_qk ≈ 10·N·E  (per tensor: mul 2, slice+neg 1, cat 2, mul 2, add 3 passes;
                             the broadcast cos/sin reads are L2-resident)
    fused rope_qk = 2·N·E + 2·C·E  (read q, k, cos, sin once; write q, k)  -> saves ≈ 8·N·E
    cache form:   + read v, write the T new k and v slots (B·Hkv·T·D each) instead of writing
                  rotated k and running two index_copy_ kernels; 12 launches -> 1.

Conventions (cos/sin hold R = rotary dim <= D values per position, R even):
    rotate-half (HF/Llama):    out = x·cos + cat(-x[R/2:R], x[:R/2])·sin over the first R dims
    interleaved (GPT-J):       out[2i]   = x[2i]·cos[2i]     - x[2i+1]·sin[2i]
                               out[2i+1] = x[2i+1]·cos[2i+1] + x[2i]·sin[2i+1]
Dims R..D pass through unchanged (partial rotary). Both are `x·cos + sign·x[partner]·sin`;
the kernel computes exactly that, with `partner`/`sign` chosen by the convention.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
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

# --------------------------------------------------------------------------- reference


def _table(t: torch.Tensor) -> torch.Tensor:
    """cos/sin in any accepted form -> a (Bc, T, R) view (Bc is 1 or B); HF's (B, 1, T, R)
    unsqueezed form loses its head dim, (T, R) gains a batch dim. No copies."""
    if t.dim() == 4:
        t = t.select(1, 0)
    return t.unsqueeze(0) if t.dim() == 2 else t


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool):
    """x (B, H, T, D) fp32, cos/sin (Bc, 1, T, R) fp32 -> rotated x (B, H, T, D) fp32."""
    r = cos.shape[-1]
    xr, xpass = x[..., :r], x[..., r:]
    if interleaved:
        rot = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        rot = torch.cat((-xr[..., r // 2:], xr[..., : r // 2]), dim=-1)
    return torch.cat((xr * cos + rot * sin, xpass), dim=-1)


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, Hq, T, D) and k (B, Hkv, T, D) in fp32, one cast to q's dtype at the end.

    >>> q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    >>> qo, ko = reference(q, k, torch.ones(3, 8), torch.zeros(3, 8))
    >>> torch.equal(qo, q)
    True
    """
    c = _table(cos).float().unsqueeze(1)  # (Bc, 1, T, R)
    s = _table(sin).float().unsqueeze(1)
    # Outputs in q's / k's dim order, like eager's elementwise result and the kernel's.
    qo = _like(q).copy_(_rotate(q.float(), c, s, interleaved))
    ko = torch.empty_like(k, dtype=q.dtype).copy_(_rotate(k.float(), c, s, interleaved))
    return qo, ko


def reference_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position,
                    interleaved: bool = False) -> torch.Tensor:
    """`reference` + HF StaticCache.update: cache[:, :, cache_position[t]] = k/v[:, :, t]
    (in place). Returns the rotated q; the rotated k lives only in k_cache. A one-element
    cache_position is the first of T consecutive slots (see `slots`)."""
    qo, ko = reference(q, k, cos, sin, interleaved)
    pos = slots(cache_position, k.shape[2])
    k_cache.index_copy_(2, pos, ko.to(k_cache.dtype))
    v_cache.index_copy_(2, pos, v.to(v_cache.dtype))
    return qo


def slots(cache_position: torch.Tensor, t: int) -> torch.Tensor:
    """The (T,) int64 cache slots that cache_position names: itself when it has T entries;
    one entry p (shape () or (1,)) names p, p+1, …, p+T-1 — what a graph's
    `p + arange(T)` computes, so the fused op can read the counter p and skip that add."""
    pos = cache_position.long().reshape(-1)  # index_copy_ wants int64; the kernel also takes int32
    if pos.numel() == 1 and t != 1:
        pos = pos + torch.arange(t, device=pos.device)
    return pos


def unfused(q, k, cos, sin, interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE as `transformers` models run it: elementwise ops in the inputs' dtype, one launch
    each (mul, slice/neg/cat for rotate-half, mul, add; for q and for k). Only the layout of
    the benchmark baseline: partial rotary dims and interleaving go through `reference`."""
    if interleaved or cos.shape[-1] != q.shape[-1]:
        return reference(q, k, cos, sin, interleaved)
    c, s = _table(cos).unsqueeze(1), _table(sin).unsqueeze(1)  # (Bc, 1, T, D)

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rotate_half(q) * s, k * c + rotate_half(k) * s


def unfused_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position, interleaved=False):
    """`unfused` + StaticCache.update's two index_copy_ launches."""
    qo, ko = unfused(q, k, cos, sin, interleaved)
    k_cache.index_copy_(2, cache_position, ko)
    v_cache.index_copy_(2, cache_position, v)
    return qo


# --------------------------------------------------------------------------- kernel


@triton.jit
def rope_partner(d, R, INTERLEAVED: tl.constexpr):
    """For head dims d (BLOCK_D,): the dim each one is rotated with, and the sign of that
    term: out[d] = x[d]·cos[d] + sign[d]·x[partner[d]]·sin[d]. Rotate-half pairs d with
    d ± R/2 (sign − on the first half); interleaved pairs 2i with 2i+1 (− on the even)."""
    if INTERLEAVED:
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:
        half = R // 2
        partner = tl.where(d < half, d + half, d - half)
        sign = tl.where(d < half, -1.0, 1.0)
    return partner, sign


@triton.jit
def _rotate_heads(src, s_h, s_d, dst, d_h, d_d, heads, h_ok, cos_row, sc_r, sin_row, ss_r,
                  D, R, INTERLEAVED: tl.constexpr, INTERP_BF16: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotate HEADS_PER_PROG rows of one (b, t): src/dst point at head 0, dim 0 of the row;
    heads (HPP,) int64 head ids, h_ok (HPP,) which of them to touch."""
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)  # (BLOCK_D,)
        rot = d < R
        partner, sign = rope_partner(d, R, INTERLEAVED)
        partner = tl.where(rot, partner, d)
        c = tl.load(cos_row + d * sc_r, mask=rot, other=1.0).to(tl.float32)
        s = tl.load(sin_row + d * ss_r, mask=rot, other=0.0).to(tl.float32)
        mask = h_ok[:, None] & (d < D)[None, :]  # (HPP, BLOCK_D)
        rows = src + heads[:, None] * s_h
        x = tl.load(rows + d[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
        # The partner load re-reads the same row (L1/L2 hit), no extra HBM traffic.
        xp = tl.load(rows + partner[None, :] * s_d, mask=mask & rot[None, :], other=0.0)
        y = x * c[None, :] + sign[None, :] * xp.to(tl.float32) * s[None, :]
        y = tl.where(rot[None, :], y, x)  # pass-through dims stay bit-exact
        out = dst + heads[:, None] * d_h + d[None, :] * d_d
        tl.store(out, cast_rn(y, dst.dtype.element_ty, INTERP_BF16), mask=mask)


@triton.jit
def _copy_heads(src, s_h, s_d, dst, d_h, d_d, heads, h_ok, D, BLOCK_D: tl.constexpr):
    """Copy HEADS_PER_PROG rows of one (b, t) (v into the v cache)."""
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        mask = h_ok[:, None] & (d < D)[None, :]
        x = tl.load(src + heads[:, None] * s_h + d[None, :] * s_d, mask=mask)
        tl.store(dst + heads[:, None] * d_h + d[None, :] * d_d, x, mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr, k_ptr, v_ptr,  # (B, Hq, T, D), (B, Hkv, T, D), v like k (read iff WRITE_CACHE)
    cos_ptr, sin_ptr,  # (Bc, T, R) tables; batch stride 0 when broadcast over B
    qo_ptr,  # (B, Hq, T, D) rotated q, in q's dim order (strides sqo_*)
    ko_ptr, vo_ptr,  # k destination: k out (B, Hkv, T, D) or k_cache (B, Hkv, S, D); v_cache
    pos_ptr,  # (T,) int cache slots, or (1,) the first of T consecutive (POS_BASE); iff WRITE_CACHE
    T, HQ, HKV, D, R, S_DST,  # S_DST: seq length of the k destination (T or S_max)
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sc_b, sc_t, sc_r, ss_b, ss_t, ss_r,
    sko_b, sko_h, sko_t, sko_d, svo_b, svo_h, svo_t, svo_d,
    sqo_b, sqo_h, sqo_t, sqo_d,
    INTERLEAVED: tl.constexpr, WRITE_CACHE: tl.constexpr, INTERP_BF16: tl.constexpr,
    BLOCK_D: tl.constexpr, HEADS_PER_PROG: tl.constexpr, GDC: tl.constexpr,
    POS_BASE: tl.constexpr = False,
):
    # grid = (B*T, cdiv(Hq, HPP) + cdiv(Hkv, HPP)): head blocks never straddle q and k.
    gdc_enter(GDC)
    row = tl.program_id(0)
    hblk = tl.program_id(1)
    b = (row // T).to(tl.int64)
    t = (row % T).to(tl.int64)
    cos_row = cos_ptr + b * sc_b + t * sc_t
    sin_row = sin_ptr + b * ss_b + t * ss_t
    n_qblk = tl.cdiv(HQ, HEADS_PER_PROG)
    offs_h = tl.arange(0, HEADS_PER_PROG).to(tl.int64)
    if hblk < n_qblk:
        heads = hblk * HEADS_PER_PROG + offs_h
        qo_row = qo_ptr + b * sqo_b + t * sqo_t
        _rotate_heads(q_ptr + b * sq_b + t * sq_t, sq_h, sq_d, qo_row, sqo_h, sqo_d,
                      heads, heads < HQ, cos_row, sc_r, sin_row, ss_r, D, R,
                      INTERLEAVED, INTERP_BF16, BLOCK_D)
    else:
        heads = (hblk - n_qblk) * HEADS_PER_PROG + offs_h
        dst_t = t
        n_heads = HKV
        if WRITE_CACHE:
            # Out-of-range slots are the caller's contract; masked so nothing is written.
            # (A head bound, not `h_ok & scalar_ok`: the interpreter mis-types that mask.)
            if POS_BASE:
                dst_t = tl.load(pos_ptr).to(tl.int64) + t
            else:
                dst_t = tl.load(pos_ptr + t).to(tl.int64)
            n_heads = tl.where((dst_t >= 0) & (dst_t < S_DST), HKV, 0)
        h_ok = heads < n_heads
        _rotate_heads(k_ptr + b * sk_b + t * sk_t, sk_h, sk_d,
                      ko_ptr + b * sko_b + dst_t * sko_t, sko_h, sko_d,
                      heads, h_ok, cos_row, sc_r, sin_row, ss_r, D, R, INTERLEAVED, INTERP_BF16, BLOCK_D)
        if WRITE_CACHE:
            _copy_heads(v_ptr + b * sv_b + t * sv_t, sv_h, sv_d,
                        vo_ptr + b * svo_b + dst_t * svo_t, svo_h, svo_d,
                        heads, h_ok, D, BLOCK_D)


# --------------------------------------------------------------------------- config space

_BLOCK_D = (32, 64, 128, 256)


def _keep(cfg: Config, p: Problem) -> bool:
    d2 = triton.next_power_of_2(p["d"])
    tile = cfg["HEADS_PER_PROG"] * cfg["BLOCK_D"]
    return (
        cfg["BLOCK_D"] <= max(32, d2)  # wider than the head only wastes lanes
        and (cfg["BLOCK_D"] * 4 >= d2 or cfg["BLOCK_D"] == _BLOCK_D[-1])  # <= 4 D-chunks
        and cfg["HEADS_PER_PROG"] <= triton.next_power_of_2(max(p["hq"], p["hkv"]))
        and 32 * cfg["num_warps"] <= tile <= 32 * 32 * cfg["num_warps"]  # 1..32 elems/thread
    )


def _default(p: Problem) -> Config:
    block_d = min(max(32, triton.next_power_of_2(p["d"])), _BLOCK_D[-1])
    # Measured on an H200 (bf16, Hq=32, Hkv=8, D=128): 8 heads x 128 dims on one warp was
    # the fastest prefill config (T=16384: 3.5 TB/s, vs 2.6 for 4 heads on 2 warps); at
    # decode (T=1) 4 heads per program edged out 1 (launch-bound either way).
    hpp = 8 if p["rows"] >= 64 else 4
    hpp = min(hpp, triton.next_power_of_2(max(p["hq"], p["hkv"])))
    return {"BLOCK_D": block_d, "HEADS_PER_PROG": hpp,
            "num_warps": max(1, min(4, hpp * block_d // 1024))}


SPACE = ConfigSpace(
    axes={"BLOCK_D": _BLOCK_D, "HEADS_PER_PROG": (1, 2, 4, 8), "num_warps": (1, 2, 4, 8)},
    default=_default,
    keep=_keep,
)


# --------------------------------------------------------------------------- launcher


def _problem(q, k, cos, interleaved: bool) -> Problem:
    b, hq, t, d = q.shape
    return {"dtype": str(q.dtype), "rows": b * t, "hq": hq, "hkv": k.shape[1], "d": d,
            "r": cos.shape[-1], "interleaved": int(bool(interleaved))}


def _check_qk(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate q/k/cos/sin; return cos/sin as (Bc, T, R) views."""
    check(q.dim() == 4 and k.dim() == 4, f"q, k must be (B, H, T, D); got {q.shape}, {k.shape}")
    check_float("q", q)
    check(k.dtype == q.dtype, f"k dtype {k.dtype} != q dtype {q.dtype}")
    b, _, t, d = q.shape
    check(k.shape[0] == b and k.shape[2:] == q.shape[2:],
          f"k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T, D")
    check(cos.shape == sin.shape, f"cos {tuple(cos.shape)} != sin {tuple(sin.shape)}")
    check_float("cos", cos)
    check_float("sin", sin)
    check(2 <= cos.dim() <= 4 and (cos.dim() < 4 or cos.shape[1] == 1),
          f"cos/sin must be (T,R), (B|1,T,R) or (B|1,1,T,R); got {tuple(cos.shape)}")
    c, s = _table(cos), _table(sin)
    check(c.shape[0] in (1, b) and c.shape[1] == t,
          f"cos/sin {tuple(cos.shape)} do not broadcast to (B={b}, T={t}, R)")
    r = c.shape[2]
    check(r % 2 == 0 and r <= d, f"rotary dim R={r} must be even and <= D={d}")
    for name, x in (("k", k), ("cos", cos), ("sin", sin)):
        check(x.device == q.device, f"{name} on {x.device}, q on {q.device}")
    return c, s


def _check_cache(q, k, v, k_cache, v_cache, pos) -> None:
    b, hkv, t, d = k.shape
    check(v.shape == k.shape and v.dtype == k.dtype, f"v {tuple(v.shape)} {v.dtype} != k's")
    check(k_cache.dim() == 4 and k_cache.shape[:2] == (b, hkv) and k_cache.shape[3] == d,
          f"k_cache {tuple(k_cache.shape)} is not (B={b}, Hkv={hkv}, S, D={d})")
    check(v_cache.shape == k_cache.shape, f"v_cache {tuple(v_cache.shape)} != k_cache's")
    check(k_cache.dtype == v_cache.dtype == k.dtype, "k_cache/v_cache dtype must equal k's")
    check((pos.shape == (t,) or pos.numel() == 1) and pos.dtype in (torch.int32, torch.int64),
          f"cache_position must be ({t},) int32/int64 (or one int: the first of {t} consecutive "
          f"slots); got {tuple(pos.shape)} {pos.dtype}")
    for name, x in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("pos", pos)):
        check(x.device == q.device, f"{name} on {x.device}, q on {q.device}")
    if pos.device.type == "cpu" and t:  # cheap here; on the GPU it would sync, so not checked
        pos = slots(pos, t)
        check(bool((pos >= 0).all() and (pos < k_cache.shape[2]).all()),
              f"cache_position outside [0, {k_cache.shape[2]})")


def _table_strides(c: torch.Tensor) -> tuple[int, int, int]:
    """(Bc, T, R) strides with batch stride 0 when Bc == 1 (broadcast over B)."""
    return (0 if c.shape[0] == 1 else c.stride(0), c.stride(1), c.stride(2))


def _run(q, k, v, cos, sin, ko, vo, pos, interleaved, config, warmup: bool = False):
    """Check, pick the config, launch (or only compile); v/vo/pos are None without the cache.
    Returns (rotated q, the compiled kernel or None)."""
    c, s = _check_qk(q, k, cos, sin)
    cfg = SPACE.resolve(config, _problem(q, k, cos, interleaved))
    b, hq, t, d = q.shape
    hkv, hpp = k.shape[1], cfg["HEADS_PER_PROG"]
    qo = _like(q)
    cache = v is not None
    v, vo, pos = (v, vo, pos) if cache else (k, ko, q)  # dummies, never touched
    args = (q, k, v, c, s, qo, ko, vo, pos, t, hq, hkv, d, c.shape[2], ko.shape[2],
            *q.stride(), *k.stride(), *v.stride(), *_table_strides(c), *_table_strides(s),
            *ko.stride(), *vo.stride(), *qo.stride())
    grid = (b * t, triton.cdiv(hq, hpp) + triton.cdiv(hkv, hpp))
    meta = {"INTERLEAVED": bool(interleaved), "WRITE_CACHE": cache,
            "POS_BASE": cache and pos.numel() == 1 and t != 1,
            "INTERP_BF16": interpreting() and qo.dtype == ko.dtype == torch.bfloat16,  # see cast_rn
            "BLOCK_D": cfg["BLOCK_D"],
            "HEADS_PER_PROG": hpp, "num_warps": cfg["num_warps"]}
    if warmup:
        return qo, _rope_kernel.warmup(*args, grid=grid, GDC=False, **meta)
    if not q.numel() + k.numel():
        return qo, None
    return qo, _rope_kernel[grid](*args, **meta, **pdl_launch(qo))


def _like(x: torch.Tensor) -> torch.Tensor:
    """An output for x's rotation laid out in x's dim order (dense), as eager's x·cos + …
    would be: graphs traced against eager's strides (e.g. transformers' transposed q/k
    views) then need no copy to restride it."""
    return torch.empty_like(x, memory_format=torch.preserve_format)


def launch_rope_qk(q, k, cos, sin, interleaved: bool = False,
                   config: Mapping[str, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q and k (any strides) in one launch; outputs dense, in q's / k's dim order."""
    ko = torch.empty_like(k, dtype=q.dtype)
    return _run(q, k, None, cos, sin, ko, None, None, interleaved, config)[0], ko


def launch_rope_k(k, cos, sin, interleaved: bool = False,
                  config: Mapping[str, int] | None = None) -> torch.Tensor:
    """Rotate k (B, H, T, D) alone (any strides): `launch_rope_qk` with no q heads."""
    return launch_rope_qk(k[:, :0], k, cos, sin, interleaved, config)[1]


def launch_rope_qk_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position,
                         interleaved: bool = False,
                         config: Mapping[str, int] | None = None) -> torch.Tensor:
    """Rotate q (returned) and k; write rotated k and v into the caches at cache_position.
    Positions outside [0, S_max) are the caller's contract: checked only for CPU tensors,
    and on the GPU such rows are skipped (masked), never written out of bounds."""
    _check_cache(q, k, v, k_cache, v_cache, cache_position)
    return _run(q, k, v, cos, sin, k_cache, v_cache, cache_position, interleaved, config)[0]


def _n_spills(compiled) -> int | None:
    res = resources(compiled)
    return None if res is None else res.n_spills


def spills_rope_qk(q, k, cos, sin, interleaved=False, config=None) -> int | None:
    """Register spills of the compiled kernel for this config (None under the interpreter)."""
    ko = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    return _n_spills(_run(q, k, None, cos, sin, ko, None, None, interleaved, config, True)[1])


def spills_rope_qk_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position,
                         interleaved=False, config=None) -> int | None:
    _check_cache(q, k, v, k_cache, v_cache, cache_position)
    return _n_spills(_run(q, k, v, cos, sin, k_cache, v_cache, cache_position, interleaved,
                          config, True)[1])


# --------------------------------------------------------------------------- custom ops


@torch.library.custom_op("advisor::rope_qk", mutates_args=())
def rope_qk(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            interleaved: bool, config: str) -> tuple[torch.Tensor, torch.Tensor]:
    if triton_can_run(q):
        return launch_rope_qk(q, k, cos, sin, interleaved, decode(config) or None)
    return reference(q, k, cos, sin, interleaved)


@rope_qk.register_fake
def _(q, k, cos, sin, interleaved, config):
    return _like(q), torch.empty_like(k, dtype=q.dtype)


@torch.library.custom_op("advisor::rope_qk_cache", mutates_args=("k_cache", "v_cache"))
def rope_qk_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  cache_position: torch.Tensor, interleaved: bool, config: str) -> torch.Tensor:
    if triton_can_run(q):
        return launch_rope_qk_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position,
                                    interleaved, decode(config) or None)
    return reference_cache(q, k, v, cos, sin, k_cache, v_cache, cache_position, interleaved)


@rope_qk_cache.register_fake
def _(q, k, v, cos, sin, k_cache, v_cache, cache_position, interleaved, config):
    return _like(q)


# --------------------------------------------------------------------------- registry


def rope_tables(positions: torch.Tensor, r: int, interleaved: bool, dtype: torch.dtype,
                base: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """HF-style cos/sin (1, T, R) for integer positions (T,): cat(f, f) or f repeated per pair."""
    inv_freq = 1.0 / base ** (torch.arange(0, r, 2, dtype=torch.float32) / r)  # (R/2,)
    freqs = positions.float().cpu()[:, None] * inv_freq[None, :]  # (T, R/2)
    emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat((freqs, freqs), -1)
    dev = positions.device
    return emb.cos()[None].to(dev, dtype), emb.sin()[None].to(dev, dtype)


def _make_qk(dims, dtype, device, gen, positions):
    b, t, hq, hkv, d = (dims[n] for n in ("batch", "tokens", "hq", "hkv", "d"))
    # HF layout: (B, T, H, D) projections viewed as (B, H, T, D) -> non-contiguous q, k.
    q = randn_nonzero((b, t, hq, d), dtype, device, gen).transpose(1, 2)
    k = randn_nonzero((b, t, hkv, d), dtype, device, gen).transpose(1, 2)
    inter = bool(dims.get("interleaved", 0))
    cos, sin = rope_tables(positions.to(device), dims["r"], inter, dtype)
    return q, k, cos, sin, inter


def make_inputs(dims, dtype, device, generator):
    return _make_qk(dims, dtype, device, generator, torch.arange(dims["tokens"]))


def make_cache_inputs(dims, dtype, device, generator):
    b, t, hkv, d, smax = (dims[n] for n in ("batch", "tokens", "hkv", "d", "s_max"))
    pos = torch.randperm(smax, generator=generator)[:t].sort().values.to(device)  # distinct
    q, k, cos, sin, inter = _make_qk(dims, dtype, device, generator, pos)
    v = randn_nonzero((b, t, hkv, d), dtype, device, generator).transpose(1, 2)
    kc = torch.zeros((b, hkv, smax, d), dtype=dtype, device=device)
    return q, k, v, cos, sin, kc, torch.zeros_like(kc), pos, inter


def _table_bytes(cos) -> int:
    return 2 * _table(cos).shape[0] * cos.shape[-2] * cos.shape[-1] * cos.element_size()


def bytes_moved(q, k, cos, sin, interleaved=False) -> int:
    return 2 * (q.numel() + k.numel()) * q.element_size() + _table_bytes(cos)


def bytes_moved_cache(q, k, v, cos, sin, k_cache, v_cache, pos, interleaved=False) -> int:
    e = q.element_size()
    return (2 * q.numel() + 4 * k.numel()) * e + _table_bytes(cos) + pos.numel() * 8


_TEST_DIMS = (
    {"batch": 2, "tokens": 3, "hq": 4, "hkv": 2, "d": 40, "r": 24, "s_max": 7},
    {"batch": 1, "tokens": 5, "hq": 3, "hkv": 1, "d": 64, "r": 64, "s_max": 9,
     "interleaved": 1},
)


def _bench_dims(tokens: int) -> dict[str, int]:
    return {"batch": 1, "tokens": tokens, "hq": 32, "hkv": 8, "d": 128, "r": 128}


register(KernelSpec(
    name="rope_qk", reference=reference, launch=launch_rope_qk, space=SPACE,
    make_inputs=make_inputs, bytes_moved=bytes_moved, spills=spills_rope_qk,
    problem=lambda q, k, cos, sin, inter=False: _problem(q, k, cos, inter),
    test_dims=_TEST_DIMS, bench_dims=_bench_dims, unfused_launches=10, unfused=unfused,
))
register(KernelSpec(
    name="rope_qk_cache", reference=reference_cache, launch=launch_rope_qk_cache, space=SPACE,
    make_inputs=make_cache_inputs, bytes_moved=bytes_moved_cache, spills=spills_rope_qk_cache,
    problem=lambda q, k, v, cos, sin, kc, vc, pos, inter=False: _problem(q, k, cos, inter),
    test_dims=_TEST_DIMS, unfused_launches=12, unfused=unfused_cache,
    bench_dims=lambda n: {**_bench_dims(n), "s_max": max(4096, 2 * n)},
))
