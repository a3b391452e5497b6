"""Flash-attention forward for inference: RoPE on load, GQA, additive mask, causal, split-K.

softmax(q·kᵀ·scale + mask [+ causal]) · v with an online softmax (running max m and sum l,
fp32 accumulator). RoPE (both conventions of `advisor.kernels.rope`) rotates q and k as they
are loaded: no rotated q/k is written. GQA/MQA maps q head h to kv head h // (Hq/Hkv).
q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) in any strides; out (B, Hq, Tq, Dv)
contiguous. Dv may differ from D (multi-head latent attention, DeepSeek-V2/V3's non-absorbed
form: D 192, Dv 128); RoPE, the scale and the scores use D, the accumulator and out Dv. Causal
is bottom-right (query i sees keys j <= i + Tk - Tq, as with a KV cache) and query i takes
RoPE row i + Tk - Tq. `q_pos` (B|1, Tq) integer positions: query i of batch b sees keys
j <= q_pos[b, i] (a static KV cache's causal mask, computed from the positions instead of
read: keys past the last position are never loaded, and at decode the splits share out
only those live keys). A row with every key masked (-inf) returns 0.

Prefill (Tq > 16): grid (cdiv(Tq, BLOCK_M), B·Hq); each program walks the key blocks every
row sees whole without masks, then the diagonal/tail blocks with masks, and skips the rest.
Decode (Tq <= 16): the Hq/Hkv q heads of a kv head share one M tile (k/v read once per kv
head) and SPLITS programs each take a chunk of keys, writing partial (m, l, acc) to fp32
scratch; a combine kernel returns Σ e^(m_s−M)·acc_s / Σ e^(m_s−M)·l_s.

HBM bytes, E = element size, S = B·Hq·Tq·D, K = B·Hkv·Tk·D, P = B·Hq·Tq·Tk, and So, V the
same with Dv for D (So = S, V = K when Dv == D):
    fused = (S + So + K + V)·E + cos/sin + mask  (read q, k, v once; write out)
    eager HF attention + apply_rotary_pos_emb ≈ 10 rope passes over q and k, repeat_kv's
          (Hq/Hkv)·2·K copies, and P scores written and re-read by scale, mask add, fp32
          softmax and casts (≈ 12·P·E): the P terms are what fusion removes.
    launches: eager 19 with RoPE (rope 10, repeat_kv 2, matmul, scale, mask add, to fp32,
          softmax, to dtype, matmul), 9 without; fused 1 (2 with SPLITS > 1).
FLOPs (`flops`): 2·(D + Dv)·B·Hq per visible (query, key) pair: Tq·Tk, about half when causal.

Example (CPU needs TRITON_INTERPRET=1; on CUDA it runs the compiled kernel)::

    q, k, v = torch.randn(1, 8, 5, 64), torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64)
    out = torch.ops.advisor.attention(q, k, v, None, None, None, True, 0.125, False, None, "")
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from advisor.errors import KernelInputError
from advisor.kernels import rope
from advisor.kernels._triton import (
    cast_rn,
    check,
    check_float,
    descriptor,
    gdc_enter,
    interpreting,
    pdl_launch,
    resources,
    tma_ok,
    triton_can_run,
)
from advisor.kernels.masks import reads_as_causal
from advisor.kernels.registry import KernelSpec, register
from advisor.kernels.rope import rope_partner
from advisor.kernels.space import Config, ConfigSpace, Problem, decode
from advisor.kernels.testing import randn_nonzero

DECODE_MAX_TQ = 16  # Tq at or below this takes the decode path (packed heads, split-K)
# From this many queries (Tq == Tk) k is rotated by one rope launch before the kernel and
# only q on load: on load, every query block re-rotates every K tile (and k's partner and
# cos/sin tiles crowd the pipeline out of TMA), while each program loads its q tile once.
# H200 2026-12-02 (benchmarks/attention_probe.py; Llama-3-8B heads, causal, bf16), both on
# load -> both by one rope_qk launch: 31.2 -> 23.3 µs at 512 tokens, 267 -> 177 at 2048,
# 2984 -> 1882 at 8192. Rotating k alone moves Hkv/(Hq + Hkv) of those bytes (1/5 here).
# Below 512 not measured: both on load.
ROTATE_ONCE_MIN_TQ = 512
TMA_MIN_TQ = 2048  # prefill from here: k, v by TMA in 128x128 tiles (the lengths measured)
MAX_D = 256
LOG2E = tl.constexpr(1.4426950408889634)  # scores scaled into the log2 domain: e^x = 2^(x·log2 e)
LN2 = tl.constexpr(0.6931471805599453)

# --------------------------------------------------------------------------- reference


def reference(q, k, v, cos=None, sin=None, causal: bool = False, scale: float | None = None,
              mask=None, rope: bool | None = None, interleaved: bool = False,
              q_pos=None, softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """softmax(cap(q·kᵀ·scale) + mask [+ causal] [+ keys past q_pos]) · v in fp32, cast to
    q.dtype, where cap(s) = softcap·tanh(s / softcap) when softcap > 0 (Gemma 2's logit
    soft-capping) and s otherwise; rows with every key masked give 0. `sinks` (Hq,): one more
    logit per head in every row's softmax, with no value (GPT-OSS's attention sinks: it
    takes a share of the weight). RoPE (`rope`, default: cos given) is
    `advisor.kernels.rope.reference` (rotated q, k rounded to q.dtype, as HF does before
    attention). v's head dim Dv may differ from q's and k's: out (B, Hq, Tq, Dv).

    >>> q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
    >>> reference(q, k, k, causal=True).shape
    torch.Size([1, 4, 3, 8])
    >>> reference(q, k, torch.randn(1, 2, 3, 6)).shape  # Dv = 6
    torch.Size([1, 4, 3, 6])
    """
    tq, tk = q.shape[2], k.shape[2]
    if cos is not None if rope is None else rope:
        # rope.reference rotates a pair; the 1-head slice is a cheap partner we discard.
        q = _rope_ref(q, cos[..., tk - tq:, :], sin[..., tk - tq:, :], interleaved)
        k = _rope_ref(k, cos, sin, interleaved)
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # (B, Hq, Tk, D)
    vf = v.float().repeat_interleave(group, dim=1)  # (B, Hq, Tk, Dv)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = q.float() @ kf.transpose(-1, -2) * scale  # (B, Hq, Tq, Tk)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s + mask.float()
    if causal:
        keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        s = s.masked_fill(~keep, float("-inf"))
    if q_pos is not None:
        s = s.masked_fill(~position_keep(q_pos, tq, tk), float("-inf"))
    if tk == 0:
        return q.new_zeros((*q.shape[:-1], v.shape[-1]))
    m = s.amax(-1, keepdim=True)
    sink = None if sinks is None else sinks.float().reshape(1, -1, 1, 1)  # (1, Hq, 1, 1)
    if sink is not None:
        m = torch.maximum(m, sink)
    m = torch.where(m == float("-inf"), 0.0, m)  # fully masked row: p = 0 instead of NaN
    p = torch.exp(s - m)
    total = p.sum(-1, keepdim=True) + (0 if sink is None else torch.exp(sink - m))
    return ((p @ vf) / torch.where(total == 0, 1.0, total)).to(q.dtype)


def _rope_ref(x, cos, sin, interleaved):
    return rope.reference(x, x[:, :1], cos, sin, interleaved)[0]


def position_keep(q_pos, tq: int, tk: int) -> torch.Tensor:
    """(B|1, 1, Tq, Tk) bool: key j visible to query i of batch b iff j <= q_pos[b, i]."""
    keys = torch.arange(tk, device=q_pos.device)
    return (keys <= q_pos.reshape(-1, tq)[..., None])[:, None]


def reference_op(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos=None,
                 softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """`reference` in the custom op's argument order (the KernelSpec tuple)."""
    return reference(q, k, v, cos, sin, causal, scale, mask, cos is not None, interleaved, q_pos,
                     softcap, sinks)


def unfused(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos=None,
            softcap: float = 0.0, sinks=None) -> torch.Tensor:
    """The eager ops a `transformers` model runs instead: RoPE as separate elementwise ops
    (`rope.unfused`), then `scaled_dot_product_attention` with its best backend (GQA through
    `enable_gqa`, causal through `is_causal` where queries and keys align, else a bottom-right
    boolean mask); with a softcap or sinks, which SDPA has not, the eager matmul → scale →
    cap → mask → [cat sinks] → softmax → matmul Gemma 2 and GPT-OSS run. The benchmark's
    baseline; rows with every key masked give NaN here."""
    tq, tk = q.shape[2], k.shape[2]
    if cos is not None:
        if tq == tk:
            q, k = rope.unfused(q, k, cos, sin, interleaved)
        else:
            q = rope.unfused(q, q[:, :1], cos[..., tk - tq:, :], sin[..., tk - tq:, :], interleaved)[0]
            k = rope.unfused(k, k[:, :1], cos, sin, interleaved)[0]
    attn_mask, is_causal = mask, False
    if q_pos is not None:  # what transformers builds for a static cache: an additive mask
        keep = position_keep(q_pos, tq, tk)
        attn_mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill(
            ~keep, float("-inf")) + (0 if mask is None else mask)
    if causal and tq > 1:
        if attn_mask is None and tq == tk:
            is_causal = True
        else:
            keep = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
            attn_mask = keep if attn_mask is None else attn_mask.masked_fill(~keep, float("-inf"))
    if softcap or sinks is not None:
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        s = q @ k.transpose(-1, -2) * (q.shape[-1] ** -0.5 if scale is None else scale)
        s = torch.tanh(s / softcap) * softcap if softcap else s
        if is_causal:
            attn_mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
        if attn_mask is not None:
            s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask
        if sinks is None:
            return torch.softmax(s.float(), -1).to(q.dtype) @ v
        sink = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat([s, sink], -1).float(), -1)[..., :-1]
        return p.to(q.dtype) @ v
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=q.shape[1] != k.shape[1])


# --------------------------------------------------------------------------- kernels


@triton.jit
def _load_rows(base, row_off, row_ok, s_d, cos, sin, tab_off, D, R: tl.constexpr,
               INTERLEAVED: tl.constexpr, INTERP_BF16: tl.constexpr, ROW_MASK: tl.constexpr,
               EVEN_D: tl.constexpr, BLOCK_D: tl.constexpr):
    """A (ROWS, BLOCK_D) tile of q or k in the input dtype, rotated in fp32 and rounded once
    when R (rotary dim; 0: no RoPE) > 0. base: pointer at the tile's first row; row_off
    (ROWS,) int64 row offsets from it; cos/sin: tables at that row's position; tab_off
    (ROWS,) int64 offsets of the rows' positions in them. ROW_MASK: rows past row_ok read
    0; EVEN_D (D == BLOCK_D): no head-dim mask, so whole tiles load without any mask. R is
    constexpr so the rotate-half partner loads stay vectorised."""
    d = tl.arange(0, BLOCK_D)
    ptrs = base + row_off[:, None] + d[None, :] * s_d
    x = _load_tile(ptrs, row_ok, d < D, ROW_MASK, EVEN_D)
    if R > 0:
        rot = d < R
        partner, sign = rope_partner(d, R, INTERLEAVED)
        tmask = rot[None, :]
        if ROW_MASK:
            tmask = row_ok[:, None] & tmask
        # Pass-through dims (d >= R) load cos=1, sin=0, partner=0: y = x exactly.
        c = tl.load(cos + tab_off[:, None] + d[None, :], mask=tmask, other=1.0)
        s = tl.load(sin + tab_off[:, None] + d[None, :], mask=tmask, other=0.0)
        xp = tl.load(base + row_off[:, None] + partner[None, :] * s_d, mask=tmask, other=0.0)
        y = x.to(tl.float32) * c.to(tl.float32) + sign[None, :] * xp.to(tl.float32) * s.to(
            tl.float32)
        x = cast_rn(y, x.dtype, INTERP_BF16)
    return x


@triton.jit
def _load_tile(ptrs, row_ok, d_ok, ROW_MASK: tl.constexpr, EVEN_D: tl.constexpr):
    """tl.load of a (ROWS, BLOCK_D) tile with only the masks it needs (0 where masked)."""
    if ROW_MASK:
        if EVEN_D:
            x = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    elif EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=d_ok[None, :], other=0.0)
    return x


@triton.jit
def _dot(a, b, acc, INTERP_BF16: tl.constexpr):
    """acc + a @ b with fp32 accumulation (acc None: a @ b). fp32 inputs use 3xTF32 (≈ fp32
    accuracy on tensor cores; plain tf32 misses fp32 tolerances, "ieee" falls back to FMAs
    and spills ~7 KB). INTERP_BF16: upcast first (the interpreter's tl.dot multiplies bf16
    bit patterns)."""
    if INTERP_BF16:
        a, b = a.to(tl.float32), b.to(tl.float32)
    if a.dtype == tl.float32:
        out = tl.dot(a, b, acc, input_precision="tf32x3")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _attend(acc, l_i, m_i, q, k_base, v_base, KD, VD, kd_b, kd_h, cos, sin, mask_base, mask_rows,
            i, row_ok, pos_i, lo, hi, off, qk_scale, cap2, sk_t, sk_d, sv_t, sv_d, sc_t, sm_j, D,
            DV, R: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_POS: tl.constexpr,
            SOFTCAP: tl.constexpr,
            INTERLEAVED: tl.constexpr, MASKED: tl.constexpr, FAST: tl.constexpr,
            EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, INTERP_BF16: tl.constexpr,
            TMA: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_DV: tl.constexpr):
    """Online-softmax update over keys [lo, hi) in BLOCK_N steps, m in the log2 domain
    (scores · qk_scale, qk_scale = scale · log2 e; p = 2^(s − m)). MASKED: apply the key
    bound (hi), the causal diagonal and each row's position bound (pos_i, (BLOCK_M,));
    unmasked calls cover whole blocks every row sees, so their k/v loads need no mask
    (none at all when EVEN_D, EVEN_DV). k tiles are (BLOCK_N, BLOCK_D) over D, v tiles
    (BLOCK_N, BLOCK_DV) over v's head dim DV; acc is (BLOCK_M, BLOCK_DV). FAST (an unmasked
    call without an additive mask, qk_scale >= 0): every score is finite, so no -inf
    guard, and the row max is taken before scaling (max(s)·c = max(s·c) for c >= 0),
    leaving one FMA per score. TMA (no RoPE on load): k and v tiles come by descriptor (KD
    over (B, Hkv, Tk, D), block (1, 1, BLOCK_N, BLOCK_D); VD over (B, Hkv, Tk, DV), block
    (1, 1, BLOCK_N, BLOCK_DV); at batch kd_b, kv head kd_h); keys past Tk read 0. SOFTCAP:
    scores capped as cap2·tanh(s / cap2) in the log2 domain (cap2 = softcap · log2 e: the
    same as capping before the change of base), before the mask; never FAST."""
    dv = tl.arange(0, BLOCK_DV)
    nl = tl.arange(0, BLOCK_N).to(tl.int64)  # key offsets within a block
    k_rows = nl * sk_t  # loop-invariant tile offsets; each block moves only the base
    t_rows = nl * sc_t
    v_off = nl[:, None] * sv_t + dv[None, :] * sv_d  # (BLOCK_N, BLOCK_DV)
    m_off = mask_rows[:, None] + nl[None, :] * sm_j  # (BLOCK_M, BLOCK_N), read iff HAS_MASK
    for start in range(lo, hi, BLOCK_N):
        s0 = tl.cast(start, tl.int64)
        n = start + tl.arange(0, BLOCK_N)  # (BLOCK_N,) key positions
        n_ok = n < hi
        if TMA:
            k = tl.reshape(KD.load([kd_b, kd_h, start, 0]), (BLOCK_N, BLOCK_D))
            v = tl.reshape(VD.load([kd_b, kd_h, start, 0]), (BLOCK_N, BLOCK_DV))
            if MASKED:  # keys in [hi, Tk) are real memory here (a cache's unwritten tail,
                v = tl.where(n_ok[:, None], v, 0.0)  # NaN maybe): p = 0 must not meet them
        else:
            k = _load_rows(k_base + s0 * sk_t, k_rows, n_ok, sk_d, cos + s0 * sc_t,
                           sin + s0 * sc_t, t_rows, D, R, INTERLEAVED, INTERP_BF16, MASKED,
                           EVEN_D, BLOCK_D)  # (BLOCK_N, BLOCK_D)
            v = _load_tile(v_base + s0 * sv_t + v_off, n_ok, dv < DV, MASKED, EVEN_DV)
        s = _dot(q, tl.trans(k), None, INTERP_BF16)  # (BLOCK_M, BLOCK_N) fp32, unscaled
        if FAST:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.math.exp2(s * qk_scale - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
        else:
            s = s * qk_scale
            if SOFTCAP:  # tanh(y) = 1 - 2 / (e^2y + 1): ±1 where e^2y over/underflows
                s = cap2 - 2.0 * cap2 / (tl.math.exp2(s * (2.0 / cap2) * LOG2E) + 1.0)
            if HAS_MASK:
                ok = row_ok[:, None]
                if MASKED:
                    ok = ok & n_ok[None, :]
                mk = tl.load(mask_base + s0 * sm_j + m_off, mask=ok, other=0.0).to(tl.float32)
                # HF's finite minimum (-3.4e38) would overflow to -inf once scaled by log2 e
                # (a row masked that way averages v instead of returning 0): floor it first.
                s += tl.where(mk == float("-inf"), mk, tl.maximum(mk, -2.0e38)) * LOG2E
            if MASKED:
                valid = n_ok[None, :]
                if CAUSAL:
                    valid = valid & (n[None, :] <= i[:, None] + off)
                if HAS_POS:
                    valid = valid & (n[None, :] <= pos_i[:, None])
                s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: p = 0
            alpha = tl.math.exp2(m_i - m_use)
            p = tl.math.exp2(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # P·V runs in the input dtype (tensor cores), as in FlashAttention.
        acc = _dot(cast_rn(p, v.dtype, INTERP_BF16), v, acc * alpha[:, None], INTERP_BF16)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _key_range(r0, lo, CHUNK, ROWS, TQ, TK, pos_min, pos_max, CAUSAL: tl.constexpr,
               HAS_POS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys of a split [lo, lo + CHUNK) for tile rows [r0, r0 + BLOCK_M) as (lo, full, hi):
    [lo, full) whole blocks every row sees unmasked, [full, hi) blocks needing masks; keys
    past hi are masked for every row (causal, positions in [pos_min, pos_max]) and skipped."""
    hi = tl.minimum(lo + CHUNK, TK)
    full = hi
    if HAS_POS:
        hi = tl.minimum(hi, pos_max + 1)
        full = tl.minimum(hi, pos_min + 1)
    if CAUSAL:  # query positions of the tile: [i_lo, i_hi] (all of them across heads)
        r1 = tl.minimum(r0 + BLOCK_M, ROWS) - 1
        one_head = r0 // TQ == r1 // TQ
        i_lo = tl.where(one_head, r0 % TQ, 0)
        i_hi = tl.where(one_head, r1 % TQ, TQ - 1)
        hi = tl.minimum(hi, i_hi + TK - TQ + 1)
        full = tl.minimum(tl.minimum(hi, full), i_lo + TK - TQ + 1)
    return lo, lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N, hi


@triton.jit
def _attn_kernel(
    Q, K, V,  # (B, Hq, Tq, D), (B, Hkv, Tk, D), (B, Hkv, Tk, DV); any strides
    KD, VD,  # TMA: descriptors of K and V (see _attend); else unused
    COS, SIN,  # (Bc, Tk, R) contiguous tables (read iff R > 0)
    SINKS,  # (Hq,) fp32: a logit per head with no value in every row's softmax (iff HAS_SINKS)
    MASK,  # additive mask as a (B, Hq, Tq, Tk) view, stride 0 on broadcast dims (iff HAS_MASK)
    POS,  # integer positions (B|1, Tq), strides sp_b (0: one row for every batch), sp_t (iff HAS_POS)
    OUT,  # SPLIT: fp32 partial acc (SPLITS, B, Hq, Tq, DV); else out (B, Hq, Tq, DV) contiguous
    M_PART, L_PART,  # SPLIT: fp32 (SPLITS, B, Hq, Tq) running max / sum per row
    TQ, TK, HQ, D, DV, N_ROWS,  # D: q/k head dim, DV: v's (and out's); N_ROWS = B·Hq·Tq
    GROUP, PACK,  # Hq/Hkv; q heads per program (1 prefill, GROUP decode)
    CHUNK, qk_scale,  # keys per split (multiple of BLOCK_N); softmax scale · log2 e
    cap2,  # softcap · log2 e (read iff SOFTCAP)
    sq_b, sq_h, sq_t, sq_d, sk_b, sk_h, sk_t, sk_d, sv_b, sv_h, sv_t, sv_d,
    sc_b, sc_t, sm_b, sm_h, sm_i, sm_j,  # table strides (R contiguous); mask strides
    sp_b, sp_t,  # position strides
    R: tl.constexpr,  # rotary dim of q (<= D, even); 0: no RoPE
    R_K: tl.constexpr,  # rotary dim of k tiles on load: R, or 0 (k rotated before, or no RoPE)
    CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_POS: tl.constexpr,
    INTERLEAVED: tl.constexpr, SPLIT: tl.constexpr, INTERP_BF16: tl.constexpr,
    FINITE: tl.constexpr,  # no additive mask, no softcap, qk_scale >= 0: the FAST path
    SOFTCAP: tl.constexpr,  # logits soft-capped (see _attend)
    HAS_SINKS: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D: no head-dim masks on q, k
    EVEN_DV: tl.constexpr,  # DV == BLOCK_DV: none on v
    DV_IS_D: tl.constexpr,  # v's head dim is D: v tiles and out share q's, k's `d < D` masks
    PREFILL: tl.constexpr,  # grid (B·Hq, cdiv(Tq, BLOCK_M)): heads first, see below
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,  # v tiles, acc, out (== BLOCK_D when DV == D)
    BLOCK_TQ: tl.constexpr,  # next_power_of_2(Tq) when SPLIT and HAS_POS, else 1
    GDC: tl.constexpr,  # programmatic dependent launch (_triton.pdl_launch)
    TMA: tl.constexpr = False,  # k, v tiles by descriptor (prefill, R_K = 0)
):
    gdc_enter(GDC)
    if DV_IS_D:  # one head-dim bound, as before DV existed (a second one is not CSE'd with it)
        DV = D
    # grid = (cdiv(PACK·Tq, BLOCK_M), B·Hq/PACK, SPLITS); row r of the program's tile is
    # query i = r % Tq of q head h0 + r // Tq. PREFILL: grid (B·Hq, cdiv(Tq, BLOCK_M), 1),
    # programs start in launch order (x fastest), so every head's last query block (the
    # most keys when causal) comes first and the final wave is the short blocks.
    if PREFILL:
        pid_bh = tl.program_id(0)
        pid_m = tl.program_id(1)
        if CAUSAL:
            pid_m = tl.num_programs(1) - 1 - pid_m
    else:
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
    split = tl.program_id(2)
    b = (pid_bh // (HQ // PACK)).to(tl.int64)
    h0 = (pid_bh % (HQ // PACK)) * PACK
    kvh = (h0 // GROUP).to(tl.int64)
    r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = r < PACK * TQ
    head = (h0 + r // TQ).to(tl.int64)
    i = r % TQ  # (BLOCK_M,) query positions
    i64 = i.to(tl.int64)
    off = TK - TQ
    cos = COS + b * sc_b
    sin = SIN + b * sc_b
    q = _load_rows(Q + b * sq_b, head * sq_h + i64 * sq_t, row_ok, sq_d, cos, sin,
                   (i64 + off) * sc_t, D, R, INTERLEAVED, INTERP_BF16, True, EVEN_D, BLOCK_D)
    chunk = CHUNK
    pos_i = i  # (BLOCK_M,) key bound per row (read iff HAS_POS)
    pos_min = 0
    pos_max = 0
    if HAS_POS:
        # clamped in the positions' own dtype first: int64 positions past 2^31 see every key
        pos_i = tl.load(POS + b * sp_b + i64 * sp_t, mask=row_ok, other=0)
        pos_i = tl.minimum(tl.maximum(pos_i, -1), TK).to(tl.int32)
        pos_min = tl.min(tl.where(row_ok, pos_i, TK), 0)
        pos_max = tl.max(tl.where(row_ok, pos_i, -1), 0)
        if SPLIT:  # the splits share out the keys the batch's last query sees, not all TK
            t = tl.arange(0, BLOCK_TQ)
            last = tl.max(tl.load(POS + b * sp_b + t * sp_t, mask=t < TQ, other=-1), 0)
            live = (tl.minimum(tl.maximum(last, -1), TK - 1) + 1).to(tl.int32)
            chunk = tl.cdiv(tl.cdiv(live, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo, full, hi = _key_range(pid_m * BLOCK_M, split * chunk, chunk, PACK * TQ, TQ, TK,
                              pos_min, pos_max, CAUSAL, HAS_POS, BLOCK_M, BLOCK_N)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    if HAS_SINKS:
        if split == 0:  # the sink is a key of the first split's: m = its logit, l = e^0
            m_i = tl.load(SINKS + head, mask=row_ok, other=0.0) * LOG2E
            l_i = tl.full((BLOCK_M,), 1.0, tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    k_base = K + b * sk_b + kvh * sk_h
    v_base = V + b * sv_b + kvh * sv_h
    mask_rows = b * sm_b + head * sm_h + i64 * sm_i
    kd_b, kd_h = b.to(tl.int32), kvh.to(tl.int32)  # descriptor coordinates (TMA)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, KD, VD, kd_b, kd_h, cos, sin, MASK,
                            mask_rows, i, row_ok, pos_i, lo, full, off, qk_scale, cap2, sk_t, sk_d,
                            sv_t, sv_d, sc_t, sm_j, D, DV, R_K, CAUSAL, HAS_MASK, HAS_POS,
                            SOFTCAP, INTERLEAVED, False, FINITE, EVEN_D, EVEN_DV, INTERP_BF16, TMA,
                            BLOCK_N, BLOCK_D, BLOCK_DV)
    acc, l_i, m_i = _attend(acc, l_i, m_i, q, k_base, v_base, KD, VD, kd_b, kd_h, cos, sin, MASK,
                            mask_rows, i, row_ok, pos_i, full, hi, off, qk_scale, cap2, sk_t, sk_d,
                            sv_t, sv_d, sc_t, sm_j, D, DV, R_K, CAUSAL, HAS_MASK, HAS_POS,
                            SOFTCAP, INTERLEAVED, True, False, EVEN_D, EVEN_DV, INTERP_BF16, TMA,
                            BLOCK_N, BLOCK_D, BLOCK_DV)

    d = tl.arange(0, BLOCK_DV)
    orow = (b * HQ + head) * TQ + i64  # (BLOCK_M,) row of out
    omask = row_ok[:, None] & (d < DV)[None, :]
    if SPLIT:
        prow = split.to(tl.int64) * N_ROWS + orow
        tl.store(M_PART + prow, m_i * LN2, mask=row_ok)  # natural-log max for the combine
        tl.store(L_PART + prow, l_i, mask=row_ok)
        tl.store(OUT + prow[:, None] * DV + d[None, :], acc, mask=omask)
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # fully masked rows: 0
        out = cast_rn(out, OUT.dtype.element_ty, INTERP_BF16)
        tl.store(OUT + orow[:, None] * DV + d[None, :], out, mask=omask)


@triton.jit
def _combine_kernel(ACC, M_PART, L_PART, OUT, N_ROWS, D, SPLITS, INTERP_BF16: tl.constexpr,
                    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, GDC: tl.constexpr):
    """One program per out row: merge SPLITS partial (m, l, acc) (scratch as above; D is
    v's head dim, BLOCK_D its tile)."""
    gdc_enter(GDC)
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < SPLITS
    prow = s.to(tl.int64) * N_ROWS + row  # (BLOCK_S,)
    m = tl.load(M_PART + prow, mask=s_ok, other=float("-inf"))
    l_s = tl.load(L_PART + prow, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    w = tl.exp(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits: 0
    denom = tl.sum(w * l_s, 0)
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(ACC + prow[:, None] * D + d[None, :], mask=s_ok[:, None] & (d < D)[None, :],
                  other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(OUT + row * D + d, cast_rn(out, OUT.dtype.element_ty, INTERP_BF16), mask=d < D)


# --------------------------------------------------------------------------- config space

_ELT = {"torch.float32": 4, "torch.float16": 2, "torch.bfloat16": 2}
SMEM_LIMIT = 200 * 1024  # bytes the default may plan; of the 227 KB the rest is left to the compiler
# What `keep` admits: the opt-in shared memory per block of compute capability 9.0 (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability": 227 KB), so the search
# may try tiles the default does not risk (a compile that runs out of it is a failed trial).
SMEM_MAX = 227 * 1024
# fp32 accumulator values (BLOCK_M·BLOCK_DV: v's head dim) per thread. q's (BLOCK_M, BLOCK_D)
# tile is not counted: loaded once, it is a shared-memory operand of q·kᵀ (`_smem`).
MAX_ACC_PER_THREAD = 64
# Decode: the default splits the keys until this many programs (~2 per SM of an H100/H200)
# or one key block per split. H200 probe (benchmarks/attention_decode_probe.py, Llama-3-8B
# heads, BLOCK_N 64, 2 stages): 1024 slots 6.6 µs at SPLITS 16 vs 11.4 at the old default
# (4: >= 4 blocks per split, ~1 wave); 4096 slots 9.6 at 32 vs 12.3 at 16.
_TARGET_PROGRAMS = 256


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot needs K >= 16


def _block_dv(p: Problem) -> int:
    """v's head-dim tile: v tiles, the accumulator and out (problems without "dv": D)."""
    return _block_d(p.get("dv", p["d"]))


def _rows(p: Problem) -> int:
    """Rows of the M tile space per program group: Tq (prefill) or Hq/Hkv·Tq (decode)."""
    return p["tq"] * (p["hq"] // p["hkv"] if p["tq"] <= DECODE_MAX_TQ else 1)


def _smem(cfg: Config, p: Problem) -> int:
    """Shared bytes: q, num_stages k and v tiles (k, q BLOCK_D wide, v BLOCK_DV), one mask
    tile (additive mask). Equal to the compiler's figure for sm_90 at D=128 bf16 (triton
    3.9, 128x128 tiles, 2-3 stages).
    RoPE on load (below ROTATE_ONCE_MIN_TQ queries) pipelines k's rotate partner and the
    cos/sin rows too: counted as 4 K-side tiles per stage (H200, 128 queries, 128x128 at 2
    stages: the compiler asked 256 KB where k + v alone is 160 KB; 4 tiles give 288 KB)."""
    bd = _block_d(p["d"])
    mask = cfg["BLOCK_M"] * cfg["BLOCK_N"] if p.get("mask") else 0
    k_tiles = 4 if _rope_on_load(p) else 1
    stage = cfg["BLOCK_N"] * (bd * k_tiles + _block_dv(p))  # K side + v
    return (stage * cfg["num_stages"] + cfg["BLOCK_M"] * bd + mask) * _ELT.get(p["dtype"], 4)


def _keep(cfg: Config, p: Problem) -> bool:
    """Drop tiles that cannot fit (shared memory, accumulator registers), that only waste
    (wider than the problem, 8 warps on a small score tile) or that lose at this size
    (small tiles at long sequences), and split-K off the decode path or past the blocks."""
    bm, bn, w, splits = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"], cfg["SPLITS"]
    rows, tk = triton.next_power_of_2(max(_rows(p), 1)), triton.next_power_of_2(max(p["tk"], 1))
    return (
        min(64, rows // 4) <= bm <= max(16, rows)  # small M tiles re-read k/v; big ones idle
        and min(64, tk // 4) <= bn <= max(16, tk)
        and bn * 4 >= bm
        and _smem(cfg, p) <= SMEM_MAX
        and bm * _block_dv(p) <= MAX_ACC_PER_THREAD * 32 * w
        and (w == 4 or bm * bn >= 2048)  # 8 warps on a smaller score tile leave lanes idle
        and (splits == 1 or (p["tq"] <= DECODE_MAX_TQ and splits <= triton.cdiv(p["tk"], bn)))
        and (not cfg.get("TMA", 0) or (p["tq"] > DECODE_MAX_TQ and splits == 1 and not _rope_on_load(p)))
    )


def _k_on_load(tq: int, tk: int) -> bool:
    """With RoPE, k tiles are rotated as they are loaded: below ROTATE_ONCE_MIN_TQ queries
    or Tq != Tk. Otherwise one launch rotates k before the kernel (`_rotate_k_once`)."""
    return not tq == tk >= ROTATE_ONCE_MIN_TQ


def _rope_on_load(p: Problem) -> bool:
    """RoPE rotates k tiles as they are loaded (see `_k_on_load`); q is always on load."""
    return bool(p.get("rope")) and _k_on_load(p["tq"], p["tk"])


def _default(p: Problem) -> Config:
    bdv = _block_dv(p)  # the accumulator's width (registers); k's and q's width is in _smem
    bm = min(128, max(16, triton.next_power_of_2(max(_rows(p), 1))),
             MAX_ACC_PER_THREAD * 32 * 8 // bdv)
    # Prefill: 128-row tiles once they give ~2 programs per SM, else 64 (more programs).
    # H200 probe (NOTES.md, session 11; causal, 32/8 heads, d 128, bf16, µs): 512 tokens
    # 64x64w4s3 12.1 vs 128x64w8s3 13.6 (SDPA 12.9); 2048: 87.9 (128x64) vs 88.5 (64x64);
    # 8192: 1158 vs 1208. BLOCK_N 128 lost at every length (95 / 1251 µs at 2 stages).
    if p["tq"] > DECODE_MAX_TQ and bm == 128 and (
            p["batch"] * p["hq"] * triton.cdiv(p["tq"], 128) < _TARGET_PROGRAMS):
        bm = 64
    bn = min(64, max(16, triton.next_power_of_2(max(p["tk"], 1))))
    # 8 warps once the accumulator needs them or at BLOCK_M=128 (4 spill there at D=64).
    w = 8 if (bm * bdv > MAX_ACC_PER_THREAD * 32 * 4 or bm >= 128) and bm * bn >= 2048 else 4
    bm = min(bm, MAX_ACC_PER_THREAD * 32 * w // bdv)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": 3, "SPLITS": 1, "TMA": 0}
    while cfg["num_stages"] > 1 and _smem(cfg, p) > SMEM_LIMIT:
        cfg["num_stages"] -= 1
    # one stage still over (fp32 at D 192-256 with a mask or RoPE on load; q's tile is
    # BLOCK_D wide where BLOCK_M was sized by v's): fewer rows, then fewer keys per tile
    while _smem(cfg, p) > SMEM_LIMIT and (cfg["BLOCK_M"] > 16 or cfg["BLOCK_N"] > 16):
        key = "BLOCK_M" if cfg["BLOCK_M"] >= cfg["BLOCK_N"] and cfg["BLOCK_M"] > 16 else "BLOCK_N"
        cfg[key] //= 2
        if cfg["BLOCK_M"] * cfg["BLOCK_N"] < 2048:
            cfg["num_warps"] = 4  # 8 warps on a smaller score tile leave lanes idle (_keep)
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if (p["tq"] >= TMA_MIN_TQ and p["tk"] >= 128 and bm == 128 and _ELT.get(p["dtype"], 4) == 2
            and not p.get("mask") and not _rope_on_load(p)):
        # H100, session 17 (results/h100-s17A-attention-probe.json; causal, 32/8 heads,
        # d 128, bf16, µs at 2048 / 8192): k, v by TMA in 128x128 tiles, 8 warps, 3
        # stages: 85.6 / 1071.5 against 87.0 / 1129.0 for 128x64 by pointers (SDPA 85.1 /
        # 1006.3); 2 stages 93.9 / 1192.7. The 224 KB of 3 stages fit (SMEM_MAX).
        tma = {**cfg, "BLOCK_N": 128, "TMA": 1, "num_stages": 3}
        while tma["num_stages"] > 2 and _smem(tma, p) > SMEM_MAX:
            tma["num_stages"] -= 1
        # Only where two stages fit: at D 192 (multi-head latent attention) one 128x128
        # stage lost to 128x64 by pointers, 2 stages (H100, session 31, results/
        # h100-s31A-mla-attention-check.json; 16 heads, Dv 128, causal 2048, µs): 83.4 vs
        # 70.3 (SDPA 65.0; 64x64 s3 77.3, 128x128 TMA s2 over the limit).
        if _smem(tma, p) <= SMEM_MAX:
            cfg = tma
    if p["tq"] <= DECODE_MAX_TQ:  # split the keys until ~2 programs per SM
        programs = p["batch"] * p["hkv"] * triton.cdiv(_rows(p), bm)
        blocks = triton.cdiv(p["tk"], bn)
        while (cfg["SPLITS"] < 32 and 2 * cfg["SPLITS"] * programs <= _TARGET_PROGRAMS
               and 2 * cfg["SPLITS"] <= blocks):  # >= 1 key block per split
            cfg["SPLITS"] *= 2
        cfg["num_stages"] = min(cfg["num_stages"], 2)  # 2 beat 3 at every SPLITS probed
    return cfg


SPACE = ConfigSpace(
    axes={"BLOCK_M": (16, 32, 64, 128), "BLOCK_N": (16, 32, 64, 128), "num_warps": (4, 8),
          "num_stages": (1, 2, 3), "SPLITS": (1, 2, 4, 8, 16, 32),
          "TMA": (0, 1)},  # 1: k, v by TMA descriptor (prefill without RoPE on load; tma_ok)
    default=_default,
    keep=_keep,
    fill={"TMA": 0},  # configs stored before the axis: pointer loads
)


def problem(q, k, v, cos=None, sin=None, mask=None, causal=False, scale=None,
            interleaved=False, q_pos=None, softcap=0.0, sinks=None) -> Problem:
    """Shape facts for `SPACE` (custom-op argument order, as the KernelSpec tuple); "dv"
    (v's head dim) only where it differs from "d" (v None: as k)."""
    b, hq, tq, d = q.shape
    dv = {} if v is None or v.shape[-1] == d else {"dv": v.shape[-1]}
    return {"dtype": str(q.dtype), "batch": b, "hq": hq, "hkv": max(k.shape[1], 1), "tq": tq,
            "tk": k.shape[2], "d": d, **dv, "causal": int(bool(causal)),
            "rope": int(cos is not None), "mask": int(mask is not None), "pos": int(q_pos is not None)}


# --------------------------------------------------------------------------- launcher


def _check_qkv(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        check(t.dim() == 4, f"{name} must be (B, H, T, D); got {tuple(t.shape)}")
        check_float(name, t)
        check(t.dtype == q.dtype and t.device == q.device,
              f"{name}: {t.dtype} on {t.device}, q: {q.dtype} on {q.device}")
    b, hq, _, d = q.shape
    check(k.shape[:3] == v.shape[:3], f"v {tuple(v.shape)} does not match k {tuple(k.shape)} "
          "in B, Hkv, Tk (v's head dim may differ)")
    check(k.shape[0] == b and k.shape[3] == d, f"k {tuple(k.shape)} does not match q "
          f"{tuple(q.shape)} in B, D")
    check(k.shape[1] >= 1 and hq % k.shape[1] == 0, f"Hq={hq} is not a multiple of Hkv={k.shape[1]}")
    check(d <= MAX_D, f"head dim {d} > {MAX_D}")
    check(v.shape[3] <= MAX_D, f"v head dim {v.shape[3]} > {MAX_D}")


def _tables(q, k, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (Tk, R), (B|1, Tk, R) or (B|1, 1, Tk, R) -> contiguous (Bc, Tk, R)."""
    check(sin is not None and cos.shape == sin.shape, "cos and sin must have one shape")
    check_float("cos", cos)
    check_float("sin", sin)
    check(2 <= cos.dim() <= 4 and (cos.dim() < 4 or cos.shape[1] == 1),
          f"cos/sin must be (T,R), (B|1,T,R) or (B|1,1,T,R); got {tuple(cos.shape)}")
    b, tq, d = q.shape[0], q.shape[2], q.shape[3]
    c, s = (t.select(1, 0) if t.dim() == 4 else t for t in (cos, sin))
    c, s = (t.unsqueeze(0) if t.dim() == 2 else t for t in (c, s))
    check(c.shape[0] in (1, b) and c.shape[1] == k.shape[2],
          f"cos/sin {tuple(cos.shape)} do not broadcast to (B={b}, Tk={k.shape[2]}, R)")
    check(c.shape[2] % 2 == 0 and c.shape[2] <= d, f"rotary dim {c.shape[2]} must be even, <= D")
    check(tq <= k.shape[2], "RoPE needs Tq <= Tk (query i sits at position i + Tk - Tq)")
    check(c.device == q.device and s.device == q.device, "cos/sin on another device than q")
    return c.contiguous(), s.contiguous()


def _mask4(q, k, mask) -> torch.Tensor:
    """The additive mask as a (B, Hq, Tq, Tk) view (stride 0 where it broadcasts)."""
    check_float("mask", mask)
    check(mask.device == q.device and mask.dim() <= 4, "mask: <= 4 dims, on q's device")
    b, hq, tq, _ = q.shape
    try:
        return mask.expand(b, hq, tq, k.shape[2])
    except RuntimeError:
        raise KernelInputError(f"mask {tuple(mask.shape)} does not broadcast to "
                               f"{(b, hq, tq, k.shape[2])}") from None


def _positions(q, q_pos) -> torch.Tensor:
    """q_pos (Tq,), (B|1, Tq), or either with size-1 dims added (e.g. (B, 1, Tq, 1)) -> (B|1, Tq)."""
    b, tq = q.shape[0], q.shape[2]
    check(q_pos.dtype in (torch.int32, torch.int64), f"q_pos must be int32/int64; got {q_pos.dtype}")
    check(q_pos.device == q.device, f"q_pos on {q_pos.device}, q on {q.device}")
    dims = [d for d in q_pos.shape if d != 1]
    check(dims in ([d for d in (tq,) if d != 1], [d for d in (b, tq) if d != 1]),
          f"q_pos {tuple(q_pos.shape)}: need (Tq,) or (B|1, Tq) with Tq={tq}, B={b}")
    return q_pos.reshape(-1, tq) if tq else q_pos.reshape(1, 0)


def _prepare(q, k, v, cos, sin, mask, causal, scale, interleaved, config, q_pos=None, softcap=0.0,
             sinks=None):
    """Check everything; return (config, (cos, sin) as (Bc, Tk, R) or None, mask view or
    None, positions as (B|1, Tq) or None)."""
    _check_qkv(q, k, v)
    tables = _tables(q, k, cos, sin) if cos is not None else None
    m4 = _mask4(q, k, mask) if mask is not None else None
    pos = _positions(q, q_pos) if q_pos is not None else None
    check(softcap >= 0 and math.isfinite(softcap),
          f"softcap must be finite and >= 0 (0: none); got {softcap}")
    if sinks is not None:
        check_float("sinks", sinks)
        check(sinks.shape == (q.shape[1],) and sinks.device == q.device,
              f"sinks {tuple(sinks.shape)} on {sinks.device}: need (Hq={q.shape[1]},) on {q.device}")
    p = problem(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos)
    return SPACE.resolve(config, p), tables, m4, pos


def _run(q, k, v, tables, m4, causal, scale, interleaved, cfg: Config, warmup=False, pos=None,
         softcap=0.0, sinks=None):
    """Launch (or only compile: `warmup`) on checked inputs. Returns (out, compiled)."""
    b, hq, tq, d = q.shape
    hkv, tk, dv = k.shape[1], k.shape[2], v.shape[3]
    out = torch.empty((b, hq, tq, dv), dtype=q.dtype, device=q.device)  # (B, Hq, Tq, Dv)
    if out.numel() == 0 or tk == 0:
        return out.zero_(), None  # no keys: every row is fully masked
    c, s = tables if tables is not None else (q, q)  # dummies, never read
    rot = c.shape[2] if tables is not None else 0
    mask_strides = m4.stride() if m4 is not None else (0, 0, 0, 0)
    pos_strides = (0 if pos.shape[0] == 1 else pos.stride(0), pos.stride(1)) if pos is not None else (0, 0)
    pack = hq // hkv if tq <= DECODE_MAX_TQ else 1
    splits, bn = cfg["SPLITS"], cfg["BLOCK_N"]
    prefill = tq > DECODE_MAX_TQ and splits == 1
    rot_k = rot if _k_on_load(tq, tk) else 0  # else k came rotated (`_rotate_k_once`)
    tma = bool(cfg.get("TMA", 0)) and prefill and rot_k == 0 and tma_ok(k, v)
    if cfg.get("TMA", 0) and not tma:  # no descriptor for k or v: pointer loads, whose
        bn = min(bn, 64)  # 128-wide key tiles lost at every length probed (see _default)
    grid = (triton.cdiv(pack * tq, cfg["BLOCK_M"]), b * hq // pack, splits)
    if prefill:
        grid = (grid[1], grid[0], 1)  # heads first (see _attn_kernel)
    scale = float(d ** -0.5 if scale is None else scale)
    acc, ml = out, out.new_empty((2, 1), dtype=torch.float32)  # unsplit: out, dummies
    if splits > 1:  # fp32 scratch: partial acc and (m, l) of every split and out row
        acc = torch.empty((splits, b, hq, tq, dv), dtype=torch.float32, device=q.device)
        ml = torch.empty((2, splits, b, hq, tq), dtype=torch.float32, device=q.device)
    kd, vd = ((descriptor(k, [1, 1, bn, _block_d(d)]), descriptor(v, [1, 1, bn, _block_d(dv)]))
              if tma else (q, q))  # unused: dummies
    sinks32 = sinks.float().contiguous() if sinks is not None else q  # (Hq,) fp32, or a dummy
    args = (q, k, v, kd, vd, c, s, sinks32, m4 if m4 is not None else q, pos if pos is not None else q,
            acc, ml[0], ml[1],
            tq, tk, hq, d, dv, b * hq * tq, hq // hkv, pack,
            triton.cdiv(triton.cdiv(tk, splits), bn) * bn,  # keys per split, whole blocks
            scale * math.log2(math.e),  # qk_scale: exp(x) = exp2(x · log2 e)
            float(softcap) * math.log2(math.e),  # cap2
            *q.stride(), *k.stride(), *v.stride(),
            0 if c.shape[0] == 1 else c.stride(0), c.stride(1), *mask_strides, *pos_strides)
    meta = {"R": rot, "R_K": rot_k, "CAUSAL": bool(causal), "HAS_MASK": m4 is not None,
            "HAS_POS": pos is not None,
            "INTERLEAVED": bool(interleaved) and rot > 0, "SPLIT": splits > 1,
            "INTERP_BF16": interpreting() and q.dtype == torch.bfloat16,
            "FINITE": m4 is None and scale >= 0 and not softcap, "SOFTCAP": bool(softcap),
            "HAS_SINKS": sinks is not None,
            "EVEN_D": d == _block_d(d), "EVEN_DV": dv == _block_d(dv), "DV_IS_D": dv == d,
            "PREFILL": prefill,
            "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": bn, "BLOCK_D": _block_d(d),
            "BLOCK_DV": _block_d(dv),
            "BLOCK_TQ": triton.next_power_of_2(tq) if splits > 1 and pos is not None else 1,
            "TMA": tma, "num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    if warmup:
        return out, _attn_kernel.warmup(*args, grid=grid, GDC=False, **meta)
    pdl = pdl_launch(out)
    compiled = _attn_kernel[grid](*args, **meta, **pdl)
    if splits > 1:
        _combine_kernel[(b * hq * tq,)](
            acc, ml[0], ml[1], out, b * hq * tq, dv, splits, INTERP_BF16=meta["INTERP_BF16"],
            BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=_block_d(dv),
            num_warps=max(1, min(4, triton.next_power_of_2(splits) * _block_d(dv) // 512)), **pdl)
    return out, compiled


def _rotate_k_once(q, k, cos, sin, interleaved) -> torch.Tensor:
    """k for the kernel: rotated by one rope launch where the kernel will not rotate it on
    load (`_k_on_load`; same rounding as on load: fp32, rounded once), else as given. q is
    rotated on load either way: each program loads its q tile once."""
    if cos is not None and not _k_on_load(q.shape[2], k.shape[2]):
        return rope.launch_rope_k(k, cos, sin, interleaved)
    return k


def _causal_for_mask(q, k, mask, causal) -> tuple[Any, bool]:
    """(mask, causal): a mask marked causal (kernels/masks.py) over Tq == Tk is read as
    `causal=True`, and its T x T values are never loaded."""
    if mask is not None and reads_as_causal(mask, q.shape[2], k.shape[2]):
        return None, True
    return mask, causal


def launch_attention(q, k, v, cos=None, sin=None, mask=None, causal: bool = False,
                     scale: float | None = None, interleaved: bool = False, q_pos=None,
                     softcap: float = 0.0, sinks=None,
                     config: Mapping[str, int] | None = None) -> torch.Tensor:
    """Attention of q (B, Hq, Tq, D) over k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv); RoPE (of q
    and k) iff cos is given. Returns a new contiguous (B, Hq, Tq, Dv) tensor (`reference_op`
    semantics)."""
    mask, causal = _causal_for_mask(q, k, mask, causal)
    k = _rotate_k_once(q, k, cos, sin, interleaved)
    cfg, tables, m4, pos = _prepare(q, k, v, cos, sin, mask, causal, scale, interleaved, config,
                                    q_pos, softcap, sinks)
    return _run(q, k, v, tables, m4, causal, scale, interleaved, cfg, pos=pos, softcap=softcap,
                sinks=sinks)[0]


def spills_attention(q, k, v, cos=None, sin=None, mask=None, causal=False, scale=None,
                     interleaved=False, q_pos=None, softcap=0.0, sinks=None, config=None) -> int | None:
    """Register spills of the compiled attention kernel; None under the interpreter or off
    CUDA (the combine kernel is tiny and not reported)."""
    if interpreting() or q.device.type != "cuda" or q.numel() == 0 or k.shape[2] == 0:
        _prepare(q, k, v, cos, sin, mask, causal, scale, interleaved, config, q_pos, softcap, sinks)
        return None
    mask, causal = _causal_for_mask(q, k, mask, causal)  # the kernel that would run
    k = _rotate_k_once(q, k, cos, sin, interleaved)
    cfg, tables, m4, pos = _prepare(q, k, v, cos, sin, mask, causal, scale, interleaved, config,
                                    q_pos, softcap, sinks)
    res = resources(_run(q, k, v, tables, m4, causal, scale, interleaved, cfg, True, pos, softcap,
                         sinks)[1])
    return None if res is None else res.n_spills


def flops(q, k, v=None, *_, causal: bool = False) -> int:  # q_pos bounds: counted as all keys
    """Matmul FLOPs: 2·B·Hq·(D + Dv) per visible (query, key) pair (2·D for q·kᵀ, 2·Dv for
    P·v; v None: Dv = D)."""
    b, hq, tq, d = q.shape
    tk, dv = k.shape[2], d if v is None else v.shape[-1]
    pairs = (sum(min(max(i + tk - tq + 1, 0), tk) for i in range(tq)) if causal
             else tq * tk)
    return 2 * b * hq * (d + dv) * pairs


# --------------------------------------------------------------------------- custom op


@torch.library.custom_op(
    "advisor::attention", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor? cos, Tensor? sin, Tensor? mask, bool causal, "
           "float scale, bool interleaved, Tensor? q_pos, float softcap, Tensor? sinks, "
           "str config) -> Tensor")
def attention(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos, softcap, sinks, config):
    if triton_can_run(q) and q.dim() == 4 and max(q.shape[-1], v.shape[-1]) <= MAX_D:
        return launch_attention(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos,
                                softcap, sinks, config=decode(config) or None)
    return reference_op(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos,
                        softcap, sinks).contiguous()


attention.register_fake(lambda q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos, softcap,
                        sinks, config: q.new_empty((*q.shape[:-1], v.shape[-1])))  # (B, Hq, Tq, Dv)


# --------------------------------------------------------------------------- registry


def make_inputs(dims, dtype, device, generator) -> tuple:
    """(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos, softcap, sinks): q/k/v are HF-style
    transposed (B, T, H, D) views (v's head dim: `dv`, default `d`); `mask` adds a
    left-padding mask (batch row b masks its first 2·b keys with -inf, so early rows of
    later batches are fully masked when causal);
    `pos` gives query i of batch b the position Tk - Tq + i - 5·b (a static cache with
    dead slots at its end; the first rows of later batches see no key at all)."""
    b, hq, hkv, tq, tk, d = (dims[n] for n in ("batch", "hq", "hkv", "tq", "tk", "d"))

    def rand(h, t, width=d):
        return randn_nonzero((b, t, h, width), dtype, device, generator).transpose(1, 2)

    q, k, v = rand(hq, tq), rand(hkv, tk), rand(hkv, tk, dims.get("dv", d))
    inter = bool(dims.get("interleaved", 0))
    cos = sin = mask = None
    if dims.get("rope", 0):
        cos, sin = rope.rope_tables(torch.arange(tk, device=device), dims.get("r", d), inter,
                                    dtype)
    if dims.get("mask", 0):
        pad = (2 * torch.arange(b, device=device))[:, None, None, None]  # (B, 1, 1, 1)
        keys = torch.arange(tk, device=device)[None, None, None, :]
        mask = torch.zeros((b, 1, tq, tk), dtype=dtype, device=device).masked_fill(
            keys < pad, float("-inf"))
    q_pos = None
    if dims.get("pos", 0):
        rows = torch.arange(tq, device=device)[None, :] - 5 * torch.arange(b, device=device)[:, None]
        q_pos = (tk - tq + rows).clamp(min=-1)  # (B, Tq) int64
    # softcap: Gemma 2's 50 would cap nothing at unit scores; 2 caps most of them
    softcap = float(dims.get("softcap", 0))
    # sinks: logits of a few units, as GPT-OSS's are: a visible share of every row's weight
    sinks = 2 * randn_nonzero((hq,), torch.float32, device, generator) if dims.get("sinks", 0) else None
    return q, k, v, cos, sin, mask, bool(dims.get("causal", 0)), d ** -0.5 * dims.get("gain", 1), \
        inter, q_pos, softcap, sinks


def _unique_bytes(t: torch.Tensor | None) -> int:
    """Bytes of the distinct elements of a (possibly broadcast) tensor."""
    if t is None:
        return 0
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def bytes_moved(q, k, v, cos=None, sin=None, mask=None, causal=False, scale=None,
                interleaved=False, q_pos=None, softcap=0.0, sinks=None) -> int:
    """Read q, k, v, cos, sin, mask once; write out (B, Hq, Tq, Dv)."""
    tables = _unique_bytes(cos) + _unique_bytes(sin)
    out = math.prod(q.shape[:-1]) * v.shape[-1] * q.element_size()
    return _unique_bytes(q) + out + _unique_bytes(k) + _unique_bytes(v) + tables + _unique_bytes(
        mask)


def _bench_dims(tokens: int) -> dict[str, int]:
    """Llama-3-8B prefill, causal with RoPE; flops(*inputs, causal=True) ≈ 2·Hq·T²·D."""
    return {"batch": 1, "hq": 32, "hkv": 8, "d": 128, "tq": tokens, "tk": tokens,
            "causal": 1, "rope": 1}


def _bench_decode_dims(tokens: int) -> dict[str, int]:
    """One new token over a `tokens`-long cache; no RoPE (cached keys are already rotated by
    rope_qk_cache); flops = 4·Hq·tokens·D."""
    return {"batch": 1, "hq": 32, "hkv": 8, "d": 128, "tq": 1, "tk": tokens, "causal": 1}


register(KernelSpec(
    name="attention", reference=reference_op, launch=launch_attention, space=SPACE,
    make_inputs=make_inputs, problem=problem, bytes_moved=bytes_moved,
    spills=spills_attention, bench_dims=_bench_dims, unfused_launches=19,
    unfused=unfused, flops=lambda q, k, v, *rest: flops(q, k, v, causal=rest[3]), matrix_kernel=True,
    test_dims=({"batch": 2, "hq": 4, "hkv": 2, "tq": 19, "tk": 19, "d": 32, "causal": 1,
                "rope": 1, "mask": 1},
               {"batch": 1, "hq": 3, "hkv": 1, "tq": 21, "tk": 26, "d": 16, "r": 8,
                "rope": 1, "interleaved": 1},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 18, "tk": 30, "d": 16, "pos": 1},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 23, "tk": 23, "d": 32, "causal": 1, "mask": 1,
                "softcap": 2, "gain": 4},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 20, "tk": 20, "d": 16, "causal": 1, "mask": 1,
                "sinks": 1},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 19, "tk": 19, "d": 24, "dv": 16, "causal": 1,
                "rope": 1, "mask": 1}),  # MLA's v narrower than q, k (DeepSeek: 192 / 128)
))
register(KernelSpec(
    name="attention_decode", reference=reference_op, launch=launch_attention, space=SPACE,
    make_inputs=make_inputs, problem=problem, bytes_moved=bytes_moved,
    spills=spills_attention, bench_dims=_bench_decode_dims, unfused_launches=9,
    unfused=unfused, flops=lambda q, k, v, *rest: flops(q, k, v, causal=rest[3]), matrix_kernel=True,
    test_dims=({"batch": 2, "hq": 4, "hkv": 2, "tq": 1, "tk": 37, "d": 32, "causal": 1},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 2, "tk": 45, "d": 32, "pos": 1},
               {"batch": 1, "hq": 3, "hkv": 1, "tq": 3, "tk": 29, "d": 16, "rope": 1,
                "mask": 1},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 1, "tk": 41, "d": 32, "softcap": 2, "gain": 4},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 2, "tk": 37, "d": 16, "sinks": 1, "mask": 1},
               {"batch": 2, "hq": 4, "hkv": 2, "tq": 1, "tk": 37, "d": 24, "dv": 16, "causal": 1}),
))
