"""attention / attention_decode: Triton (interpreter) vs the eager reference, and the reference
vs torch's scaled_dot_product_attention. Sizes stay tiny (Tq, Tk <= 40; decode Tk <= 64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from advisor.errors import KernelInputError
from advisor.kernels import attention as attn
from advisor.kernels import registry, rope
from advisor.kernels.testing import assert_close, randn_nonzero

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CPU = torch.device("cpu")


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv(b, hq, hkv, tq, tk, d, dtype, gen, transposed=True, dv=None):
    """q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv; Dv = D unless given): views
    of HF's (B, T, H, D), or contiguous."""
    def rand(h, t, width=d):
        if transposed:
            return randn_nonzero((b, t, h, width), dtype, CPU, gen).transpose(1, 2)
        return randn_nonzero((b, h, t, width), dtype, CPU, gen)
    return rand(hq, tq), rand(hkv, tk), rand(hkv, tk, d if dv is None else dv)


def _cfg(bm, bn, splits=1, w=4, stages=2):
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": stages, "SPLITS": splits}


def _check(q, k, v, cos=None, sin=None, mask=None, causal=False, interleaved=False,
           config=None, scale=None, q_pos=None, softcap=0.0, sinks=None):
    out = attn.launch_attention(q, k, v, cos, sin, mask, causal, scale, interleaved, q_pos,
                                softcap, sinks, config=config)
    ref = attn.reference(q, k, v, cos, sin, causal, scale, mask, None, interleaved, q_pos, softcap,
                         sinks)
    assert out.is_contiguous() and out.dtype == q.dtype and out.shape == (*q.shape[:-1], v.shape[-1])
    assert_close(out, ref)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_gqa_strided(dtype, causal):
    # Tq = Tk = 33: partial last M and N blocks; GQA 4:2; q/k/v transposed views.
    q, k, v = _qkv(2, 4, 2, 33, 33, 32, dtype, _gen(1))
    for cfg in (_cfg(16, 16, stages=1), _cfg(64, 32, w=8)):
        _check(q, k, v, causal=causal, config=cfg, scale=0.3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_prefill_unmasked_fast_paths(dtype, causal):
    """The unmasked loop's variants: D == BLOCK_D (no load masks at all) or not (D=24),
    FINITE (no mask, scale >= 0: max before scaling, no -inf guard) or not (a negative
    scale, an additive mask); odd Tq = Tk = 37 and 70 (partial M and N blocks, causal
    blocks launched heaviest first), Tq != Tk; GQA 4:2, batch 2."""
    gen = _gen(21)
    for (tq, tk), d, cfg in (((37, 37), 32, _cfg(16, 16)), ((70, 70), 24, _cfg(32, 32)),
                             ((37, 53), 32, _cfg(16, 32))):
        q, k, v = _qkv(2, 4, 2, tq, tk, d, dtype, gen)
        mask = randn_nonzero((2, 1, tq, tk), dtype, CPU, gen)
        _check(q, k, v, causal=causal, config=cfg, scale=0.3)
        _check(q, k, v, causal=causal, config=cfg, scale=-0.3)
        _check(q, k, v, mask=mask, causal=causal, config=cfg)


@pytest.mark.parametrize("tq, tk", [(20, 37), (24, 17)])
def test_causal_bottom_right(tq, tk):
    # Query i sees keys <= i + Tk - Tq. With Tq > Tk the first Tq - Tk rows see nothing: 0.
    q, k, v = _qkv(1, 2, 1, tq, tk, 16, torch.float32, _gen(2), transposed=False)
    for cfg in (_cfg(16, 16), _cfg(32, 32)):
        out = _check(q, k, v, causal=True, config=cfg)
        if tq > tk:
            assert torch.equal(out[:, :, : tq - tk], torch.zeros_like(out[:, :, : tq - tk]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_additive_mask_broadcast_forms(dtype):
    gen = _gen(3)
    b, hq, tq, tk = 2, 4, 17, 23
    q, k, v = _qkv(b, hq, 2, tq, tk, 32, dtype, gen)
    full = randn_nonzero((b, hq, tk, tq), torch.float32, CPU, gen).transpose(-1, -2)  # strided
    for mask in (full[:, :1].to(dtype), full[:1], full[0, 0].to(torch.bfloat16), full):
        _check(q, k, v, mask=mask, config=_cfg(16, 16))
    _check(q, k, v, mask=full[:, :1], causal=True, config=_cfg(32, 32))


def test_padding_mask_fully_masked_rows_are_zero():
    # Left padding of 0 and 12 keys with -inf; causal => rows 0..11 of batch 1 see no key.
    gen = _gen(4)
    b, tq, tk = 2, 19, 19
    q, k, v = _qkv(b, 4, 2, tq, tk, 32, torch.bfloat16, gen)
    pad = torch.tensor([0, 12])[:, None, None, None]
    mask = torch.zeros(b, 1, tq, tk).masked_fill(torch.arange(tk) < pad, float("-inf"))
    for cfg in (_cfg(16, 16), _cfg(32, 16, splits=1)):
        out = _check(q, k, v, mask=mask, causal=True, config=cfg)
        assert torch.equal(out[1, :, :12], torch.zeros_like(out[1, :, :12]))
        assert (out[1, :, 12:] != 0).any() and not out.isnan().any()
    # HF-style finite min instead of -inf: fully masked rows average v, like eager softmax.
    _check(q, k, v, mask=mask.clamp(min=torch.finfo(torch.bfloat16).min), causal=True,
           config=_cfg(16, 16))


@pytest.mark.parametrize("hq, hkv", [(6, 2), (3, 1), (2, 2)])
def test_gqa_mqa_heads(hq, hkv):
    gen = _gen(5)
    q, k, v = _qkv(1, hq, hkv, 18, 18, 16, torch.float16, gen)
    _check(q, k, v, causal=True, config=_cfg(16, 16))
    q1 = randn_nonzero((1, 1, hq, 16), torch.float16, CPU, gen).transpose(1, 2)  # decode
    _check(q1, k, v, causal=True, config=_cfg(16, 16, splits=1))


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_on_load(interleaved, dtype):
    gen = _gen(6)
    b, tq, tk, d = 2, 13, 21, 32
    q, k, v = _qkv(b, 4, 2, tq, tk, d, dtype, gen)
    # Random tables (not real angles) catch cos[d] / cos[partner] mix-ups; R=24 < D partial.
    # Scaled so c² + s² ≈ 1 like real angles (bigger q·k turns bf16 rounding into 2e-2).
    cos, sin = (randn_nonzero((b, tk, 24), dtype, CPU, gen, scale=0.7) for _ in range(2))
    for cfg in (_cfg(16, 16), _cfg(16, 32)):
        _check(q, k, v, cos, sin, causal=True, interleaved=interleaved, config=cfg)
    c1, s1 = rope.rope_tables(torch.arange(tk), d, interleaved, dtype)  # (1, Tk, D)
    for cos, sin in ((c1, s1), (c1[0], s1[0]), (c1[:, None], s1[:, None])):
        _check(q, k, v, cos, sin, interleaved=interleaved, config=_cfg(16, 16))


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_k_rotated_once_before_long_prefill(interleaved, monkeypatch):
    """From ROTATE_ONCE_MIN_TQ queries (Tq == Tk), k is rotated by one rope launch and q on
    load (k tiles then load plain, by TMA where it can): same result, every table form,
    partial rotary."""
    gen = _gen(16)
    b, t, d = 2, 19, 32
    q, k, v = _qkv(b, 4, 2, t, t, d, torch.bfloat16, gen)
    calls = []
    real = rope.launch_rope_k
    monkeypatch.setattr(rope, "launch_rope_k", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(attn, "ROTATE_ONCE_MIN_TQ", t)
    cos, sin = (randn_nonzero((b, t, 24), torch.bfloat16, CPU, gen, scale=0.7) for _ in range(2))
    _check(q, k, v, cos, sin, causal=True, interleaved=interleaved, config=_cfg(16, 16))
    c1, s1 = rope.rope_tables(torch.arange(t), d, interleaved, torch.bfloat16)
    _check(q, k, v, c1[:, None], s1[:, None], causal=True, interleaved=interleaved)
    assert len(calls) == 2
    q2, k2, v2 = _qkv(b, 4, 2, t - 1, t, d, torch.bfloat16, gen)  # Tq != Tk: on load
    _check(q2, k2, v2, c1, s1, causal=True, interleaved=interleaved)
    assert len(calls) == 2


def test_reference_rope_is_rope_reference():
    gen = _gen(7)
    q, k, v = _qkv(1, 4, 2, 9, 9, 16, torch.bfloat16, gen)
    cos, sin = rope.rope_tables(torch.arange(9), 16, False, torch.bfloat16)
    qr, kr = rope.reference(q, k, cos, sin, False)
    assert torch.equal(attn.reference(q, k, v, cos, sin, True),
                       attn.reference(qr, kr, v, causal=True))
    assert torch.equal(attn.reference(q, k, v, cos, sin, True, rope=False),
                       attn.reference(q, k, v, causal=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_split_k(dtype, splits):
    gen = _gen(8)
    tk = 64  # 4 key blocks of 16: one per split
    for tq, use_rope, use_mask in ((1, False, False), (3, True, True)):
        q, k, v = _qkv(2, 4, 2, tq, tk, 32, dtype, gen)
        cos, sin = rope.rope_tables(torch.arange(tk), 32, False, dtype) if use_rope else (None,
                                                                                          None)
        mask = randn_nonzero((2, 1, tq, tk), dtype, CPU, gen) if use_mask else None
        for bn in (16, 32):
            if splits * bn <= tk:
                _check(q, k, v, cos, sin, mask, causal=True, config=_cfg(16, bn, splits))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_static_cache_mask_skips_hidden_blocks(dtype):
    """A static cache at decode: slots past the position are -inf in the mask (whole key
    blocks and splits of them), one block in the middle is hidden too, one row of a tile is
    live in a block the others cannot see. Skipped blocks change nothing."""
    gen = _gen(10)
    tk, tq = 80, 2
    q, k, v = _qkv(2, 4, 2, tq, tk, 32, dtype, gen)
    mask = torch.zeros(2, 1, tq, tk)
    mask[..., 45:] = float("-inf")  # unwritten slots: blocks 3-4 of 16 and part of block 2
    mask[..., 16:32] = float("-inf")  # a hidden block between live ones
    mask[1, 0, 0, 20] = 0.0  # ... except for one query of batch 1
    mask = mask.to(dtype)
    for cfg in (_cfg(16, 16), _cfg(16, 16, splits=4), _cfg(16, 32, splits=2)):
        _check(q, k, v, mask=mask, config=cfg)
    _check(q, k, v, mask=mask, causal=True, config=_cfg(16, 16, splits=4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_positions_instead_of_a_static_cache_mask(dtype):
    """q_pos: key j visible to query i of batch b iff j <= q_pos[b, i], the additive mask
    transformers builds for a static cache. Batch rows sit at different positions (dead
    slots at the end of the cache, whole dead splits); the decode splits share out only the
    live keys; a row at position -1 sees nothing (0); every spelling of the positions."""
    gen = _gen(17)
    tk = 80
    for tq, pos in ((1, torch.tensor([[52], [9]])), (2, torch.tensor([[40, 41], [-1, 70]]))):
        q, k, v = _qkv(2, 4, 2, tq, tk, 32, dtype, gen)
        mask = torch.zeros(2, 1, tq, tk).masked_fill(~attn.position_keep(pos, tq, tk),
                                                     float("-inf")).to(dtype)
        want = attn.reference(q, k, v, mask=mask)
        for cfg in (_cfg(16, 16), _cfg(16, 16, splits=4), _cfg(16, 32, splits=2), _cfg(32, 16, splits=4)):
            out = _check(q, k, v, q_pos=pos, config=cfg)
            assert_close(out, want)
        # more splits than live key blocks (past `keep`): the last splits are empty
        _, tables, m4, p2 = attn._prepare(q, k, v, None, None, None, False, None, False, None, pos)
        assert_close(attn._run(q, k, v, tables, m4, False, None, False, _cfg(16, 16, splits=8),
                               pos=p2)[0], want)
        if tq == 2:
            assert torch.equal(out[1, :, 0], torch.zeros_like(out[1, :, 0]))
    q, k, v = _qkv(2, 4, 2, 1, tk, 32, dtype, gen)
    for spelling in (torch.tensor([33]), torch.tensor([[33]]), torch.tensor([33, 33]).view(2, 1, 1, 1)):
        _check(q, k, v, q_pos=spelling.to(torch.int32), config=_cfg(16, 16, splits=4))
    q3 = _qkv(2, 4, 2, 3, tk, 32, dtype, gen)[0]
    with pytest.raises(KernelInputError, match="q_pos"):  # (Tq, B): not (b, i) order
        attn.launch_attention(q3, k, v, q_pos=torch.zeros(3, 2, dtype=torch.int64))


def test_positions_past_the_cache_and_the_int32_range():
    """Positions at or past Tk see every key, whatever their dtype's range (clamped before
    any arithmetic): int32's max, int64 past 2^32; split and unsplit."""
    q, k, v = _qkv(1, 4, 2, 1, 40, 16, torch.float32, _gen(20))
    want = attn.reference(q, k, v)
    for pos in (torch.tensor([2**31 - 1], dtype=torch.int32), torch.tensor([2**32 + 5]),
                torch.tensor([40])):
        for cfg in (_cfg(16, 16), _cfg(16, 16, splits=2)):
            assert_close(attn.launch_attention(q, k, v, q_pos=pos, config=cfg), want)


def test_positions_at_prefill_with_causal():
    """Tq > 16 (prefill tiles): per-row bounds from the positions, alone and with is_causal."""
    gen = _gen(18)
    b, tq, tk = 2, 21, 37
    q, k, v = _qkv(b, 4, 2, tq, tk, 16, torch.bfloat16, gen)
    pos = torch.stack([torch.arange(tq) + 3, torch.arange(tq) * 2 - 4])  # (B, Tq), some < 0
    for cfg in (_cfg(16, 16), _cfg(32, 32)):
        _check(q, k, v, q_pos=pos, config=cfg)
        _check(q, k, v, q_pos=pos, causal=True, config=cfg)


def test_decode_empty_splits():
    # A config the space drops (SPLITS 8 > key blocks) still computes right: empty splits
    # leave (m, l) = (-inf, 0) and get weight 0 in the combine.
    q, k, v = _qkv(1, 3, 1, 2, 20, 16, torch.float32, _gen(9))
    cfg, tables, m4, _ = attn._prepare(q, k, v, None, None, None, True, None, False, None)
    out, _ = attn._run(q, k, v, tables, m4, True, None, False, _cfg(16, 16, splits=8))
    assert_close(out, attn.reference(q, k, v, causal=True))


def test_unfused_baseline_takes_positions():
    """The benchmark's eager baseline builds the mask transformers would from q_pos (with
    and without causal): the same result as the reference."""
    gen = _gen(19)
    q, k, v = _qkv(2, 4, 2, 6, 6, 16, torch.float32, gen)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5], [2, 2, 3, 3, 4, 5]])
    for causal in (False, True):
        assert_close(attn.unfused(q, k, v, None, None, None, causal, None, False, pos),
                     attn.reference(q, k, v, causal=causal, q_pos=pos))


def test_reference_matches_sdpa():
    gen = _gen(10)
    q, k, v = _qkv(2, 4, 2, 11, 11, 16, torch.float32, gen)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    assert_close(attn.reference(q, k, v, causal=True),
                 F.scaled_dot_product_attention(q, kr, vr, is_causal=True))
    mask = randn_nonzero((2, 1, 11, 11), torch.float32, CPU, gen)
    assert_close(attn.reference(q, k, v, mask=mask, scale=0.2),
                 F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=0.2))


def test_custom_op_and_compile(monkeypatch):
    calls = []
    launch = attn.launch_attention
    monkeypatch.setattr(attn, "launch_attention",
                        lambda *a, **kw: calls.append(kw["config"]) or launch(*a, **kw))
    gen = _gen(11)
    q, k, v = _qkv(1, 4, 2, 17, 17, 16, torch.bfloat16, gen)
    cos, sin = rope.rope_tables(torch.arange(17), 16, True, torch.bfloat16)
    mask = randn_nonzero((1, 1, 17, 17), torch.bfloat16, CPU, gen)
    out = torch.ops.advisor.attention(q, k, v, None, None, None, True, 0.25, False, None, 0.0, None, "")
    assert_close(out, attn.reference(q, k, v, causal=True, scale=0.25))
    cfg = "BLOCK_M=32,BLOCK_N=16,SPLITS=1,num_stages=2,num_warps=4"
    fn = torch.compile(lambda *a: torch.ops.advisor.attention(*a, False, 0.25, True, None, 0.0, None, cfg),
                       backend="eager", fullgraph=True)
    assert_close(fn(q, k, v, cos, sin, mask),
                 attn.reference(q, k, v, cos, sin, False, 0.25, mask, True, True))
    assert calls == [None, _cfg(32, 16)]  # Triton ran both times


def test_rejects_bad_input():
    gen = _gen(12)
    q, k, v = _qkv(1, 4, 2, 5, 7, 16, torch.float32, gen)
    cos, sin = rope.rope_tables(torch.arange(7), 16, False, torch.float32)
    bad = [
        dict(q=q.to(torch.int32)), dict(k=k.half()), dict(v=v[:, :, :6]),  # dtype, shapes
        dict(k=k[:, :1].expand(1, 3, 7, 16), v=v[:, :1].expand(1, 3, 7, 16)),  # 4 % 3
        dict(k=k[..., :8], v=v[..., :8]), dict(q=q[0]),  # D mismatch, 3-D q
        dict(mask=torch.zeros(1, 4, 5, 6)), dict(mask=torch.zeros(5, 7, dtype=torch.int32)),
        dict(cos=cos[:, :6], sin=sin[:, :6]), dict(cos=cos, sin=sin[..., :8]),
        dict(q=randn_nonzero((1, 4, 8, 16), torch.float32, CPU, gen), cos=cos, sin=sin),
        dict(config={"BLOCK_M": 16}), dict(q_pos=torch.arange(5.0)),  # float positions
        dict(q_pos=torch.arange(3)),  # neither Tq nor B·Tq positions
    ]
    base = dict(q=q, k=k, v=v, cos=None, sin=None, mask=None, q_pos=None, config=None)
    for change in bad:
        args = base | change
        with pytest.raises(KernelInputError):
            attn.launch_attention(args["q"], args["k"], args["v"], args["cos"], args["sin"],
                                  args["mask"], False, None, False, args["q_pos"],
                                  config=args["config"])
    # A config outside `keep` for this problem (more splits than key blocks, as a config
    # tuned at a longer context would be) runs the problem's default: same result.
    out = attn.launch_attention(q, k, v, None, None, None, False, None, False,
                                config=_cfg(16, 16, splits=2))
    assert_close(out, attn.reference(q, k, v))
    wide = torch.zeros(1, 1, 2, 264)
    with pytest.raises(KernelInputError, match="head dim"):
        attn.launch_attention(wide, wide, wide)
    assert torch.ops.advisor.attention(wide, wide, wide, None, None, None, False, 1.0, False,
                                       None, 0.0, None, "").shape == wide.shape  # falls back to the reference


def test_empty():
    q, k = torch.empty(2, 4, 0, 16), torch.empty(2, 2, 5, 16)
    assert attn.launch_attention(q, k, k).shape == q.shape
    q, k = torch.randn(1, 2, 3, 16), torch.empty(1, 1, 0, 16)
    assert torch.equal(attn.launch_attention(q, k, k), torch.zeros_like(q))
    assert torch.equal(attn.reference(q, k, k), torch.zeros_like(q))


def test_space():
    for name in ("attention", "attention_decode"):
        spec = registry.get(name)
        for tokens in (1, 16, 128, 4096, 32768):
            for d in (64, 128, 256):
                dims = {**spec.bench_dims(tokens), "d": d}
                inputs = [torch.empty(dims["batch"], h, t, d, device="meta")
                          for h, t in ((dims["hq"], dims["tq"]), (dims["hkv"], dims["tk"]))]
                p = attn.problem(inputs[0], inputs[1], inputs[1])
                cfgs = spec.space.configs(p)
                # <= 128: the prefill tiles twice over (TMA 0/1)
                assert 1 <= len(cfgs) <= 128 and spec.space.default(p) in cfgs, (name, tokens, d)
                assert all(c["SPLITS"] == 1 for c in cfgs) or dims["tq"] <= attn.DECODE_MAX_TQ
                assert all(attn._smem(c, p) <= attn.SMEM_MAX for c in cfgs)
                assert attn._smem(spec.space.default(p), p) <= attn.SMEM_LIMIT
    def meta_problem(tq, tk):
        return attn.problem(torch.empty(1, 32, tq, 128, device="meta"),
                            torch.empty(1, 8, tk, 128, device="meta"), None)

    assert attn.SPACE.default(meta_problem(1, 4096))["SPLITS"] == 32  # batch-1 decode splits
    assert attn.SPACE.default(meta_problem(1, 1024))["SPLITS"] == 16  # one key block each
    split2 = _cfg(16, 16, splits=2)
    assert attn.SPACE.keep(split2, meta_problem(16, 64))
    assert not attn.SPACE.keep(split2, meta_problem(17, 64))  # prefill path: no split-K


@pytest.mark.parametrize("name", ["attention", "attention_decode"])
def test_registry(name):
    spec = registry.get(name)
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, torch.bfloat16, CPU, _gen(13))
        assert spec.problem(*inputs)["dtype"] == "torch.bfloat16"
        assert spec.bytes_moved(*inputs) > 0 and spec.spills(*inputs, config=None) is None
        assert attn.flops(*inputs, causal=inputs[6]) > 0
        assert_close(spec.launch(*inputs, config=spec.default_config(*inputs)),
                     spec.reference(*inputs))
    q, k = torch.empty(1, 2, 4, 8), torch.empty(1, 1, 4, 8)
    assert attn.flops(q, k, causal=True) == 4 * 2 * 8 * 10
    assert attn.flops(q, k) == 4 * 2 * 8 * 16


def _count_tma(monkeypatch) -> list:
    """The TMA flag of every prefill launch of `_attn_kernel`."""
    flags, kernel = [], attn._attn_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                flags.append(meta["TMA"])
                return kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(attn, "_attn_kernel", Spy())
    return flags


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("b, hq, hkv, tq, tk, d, causal, masked", [
    (2, 4, 2, 19, 19, 32, True, False),   # GQA, causal, ragged last key block
    (1, 2, 1, 21, 30, 16, False, True),   # Tq < Tk, additive mask
    (2, 4, 2, 40, 40, 64, True, True),    # both, two key blocks
])
def test_tma_loads_of_k_and_v(monkeypatch, dtype, b, hq, hkv, tq, tk, d, causal, masked):
    """TMA=1: k, v tiles by descriptor over HF's transposed (B, T, H, D) views; keys past Tk
    read zeros, which the key bound masks."""
    flags = _count_tma(monkeypatch)
    q, k, v = _qkv(b, hq, hkv, tq, tk, d, dtype, _gen(3))
    mask = None
    if masked:
        mask = torch.zeros(b, 1, tq, tk, dtype=dtype)
        mask[..., :3] = float("-inf")
    p = attn.problem(q, k, v, None, None, mask, causal)
    cfg = {**attn.SPACE.default(p), "TMA": 1}
    assert attn.SPACE.keep(cfg, p)
    _check(q, k, v, mask=mask, causal=causal, config=cfg)
    assert flags == [True]


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_q_on_load_over_tma_k(monkeypatch, interleaved):
    """k rotated once (Tq == Tk from ROTATE_ONCE_MIN_TQ), q rotated on load, k and v tiles
    by TMA: partial rotary, per-batch tables."""
    flags = _count_tma(monkeypatch)
    monkeypatch.setattr(attn, "ROTATE_ONCE_MIN_TQ", 19)
    gen = _gen(17)
    q, k, v = _qkv(2, 4, 2, 19, 19, 32, torch.bfloat16, gen)
    cos, sin = (randn_nonzero((2, 19, 24), torch.bfloat16, CPU, gen, scale=0.7) for _ in range(2))
    p = attn.problem(q, k, v, cos, sin, causal=True, interleaved=interleaved)
    cfg = {**attn.SPACE.default(p), "TMA": 1}
    assert attn.SPACE.keep(cfg, p)
    _check(q, k, v, cos, sin, causal=True, interleaved=interleaved, config=cfg)
    assert flags == [True]


def test_tma_only_for_prefill_without_rope_on_load(monkeypatch):
    def problem(**over):
        return {"dtype": "torch.bfloat16", "batch": 1, "hq": 32, "hkv": 8, "tq": 2048,
                "tk": 2048, "d": 128, "causal": 1, "rope": 0, "mask": 0, "pos": 0, **over}

    def tma_kept(p):
        return any(c["TMA"] for c in attn.SPACE.configs(p))

    assert tma_kept(problem()) and tma_kept(problem(rope=1))  # rope: rotated once at 2048
    assert not tma_kept(problem(tq=128, tk=128, rope=1))  # RoPE on load reads k's partner
    assert not tma_kept(problem(tq=1))  # decode: packed heads, split keys
    assert attn.SPACE.well_formed({k: v for k, v in attn.SPACE.default(problem()).items()
                                   if k != "TMA"})["TMA"] == 0  # stored before the axis
    flags = _count_tma(monkeypatch)  # k with a non-unit last stride: pointer loads
    q, k, v = _qkv(1, 2, 1, 20, 20, 16, torch.float32, _gen(4))
    k2 = torch.cat([k, k], -1)[..., ::2]
    p = attn.problem(q, k2, v, causal=True)
    _check(q, k2, v, causal=True, config={**attn.SPACE.default(p), "TMA": 1})
    assert flags == [False]


def test_tma_keys_past_the_last_position_are_never_read_into_the_output(monkeypatch):
    """A static cache's unwritten tail (NaN here) past every query's position: the masked
    block's v rows come by TMA too and must be zeroed, not multiplied by p = 0."""
    flags = _count_tma(monkeypatch)
    q, k, v = _qkv(1, 4, 2, 20, 40, 32, torch.float32, _gen(5))
    pos = torch.arange(20)[None, :]  # query i sees keys <= i
    clean_k, clean_v = k.clone(), v.clone()
    k[:, :, 20:], v[:, :, 20:] = float("nan"), float("nan")
    p = attn.problem(q, k, v, q_pos=pos)
    cfg = {**attn.SPACE.default(p), "TMA": 1}
    assert attn.SPACE.keep(cfg, p)
    out = attn.launch_attention(q, k, v, q_pos=pos, config=cfg)
    assert flags == [True] and not out.isnan().any()
    assert_close(out, attn.reference(q, clean_k, clean_v, q_pos=pos))


def test_long_prefill_default_takes_tma_128_wide_key_tiles():
    """From TMA_MIN_TQ queries (16-bit, no mask, RoPE not on load): TMA k/v in 128x128 tiles
    at 3 stages, over SMEM_LIMIT but within SMEM_MAX; fewer than 128 keys keep the pointer
    tiles (a 128-wide key tile would not be kept)."""
    def p(tq, tk, dtype=torch.bfloat16, **kw):
        return attn.problem(torch.empty(1, 32, tq, 128, device="meta", dtype=dtype),
                            torch.empty(1, 8, tk, 128, device="meta", dtype=dtype),
                            torch.empty(1, 8, tk, 128, device="meta", dtype=dtype), **kw)

    long = p(attn.TMA_MIN_TQ, attn.TMA_MIN_TQ, causal=True)
    cfg = attn.SPACE.default(long)
    assert (cfg["TMA"], cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]) == (1, 128, 128, 3)
    assert attn.SPACE.keep(cfg, long) and attn._smem(cfg, long) <= attn.SMEM_MAX
    for other in (p(attn.TMA_MIN_TQ // 2, attn.TMA_MIN_TQ // 2, causal=True),  # shorter
                  p(attn.TMA_MIN_TQ, 64),  # cross-attention to 64 keys
                  p(attn.TMA_MIN_TQ, attn.TMA_MIN_TQ, torch.float32),
                  p(attn.TMA_MIN_TQ, attn.TMA_MIN_TQ, mask=torch.empty(1, 1, 1, 1, device="meta"))):
        d = attn.SPACE.default(other)
        assert d["TMA"] == 0 and attn.SPACE.keep(d, other)
    # head dim 192 (MLA): one 128x128 TMA stage fits, two do not; 128x64 pointer tiles at
    # 2 stages instead (faster on the H100, session 31)
    mla = attn.problem(torch.empty(1, 16, 2048, 192, device="meta", dtype=torch.bfloat16),
                       torch.empty(1, 16, 2048, 192, device="meta", dtype=torch.bfloat16),
                       torch.empty(1, 16, 2048, 128, device="meta", dtype=torch.bfloat16), causal=True)
    cfg = attn.SPACE.default(mla)
    assert (cfg["TMA"], cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"]) == (0, 128, 64, 2)
    assert attn.SPACE.keep(cfg, mla)


def test_a_tma_config_without_descriptors_reads_64_key_tiles(monkeypatch):
    """k, v no descriptor can read (here: tma_ok says no): pointer loads, and the key tile
    narrows to 64 (128-wide pointer tiles lost at every length probed)."""
    q, k, v = _qkv(1, 2, 2, 40, 40, 32, torch.float16, _gen(7))
    cfg = {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2, "SPLITS": 1, "TMA": 1}
    seen = []
    kernel = attn._attn_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **meta):
                seen.append((meta["TMA"], meta["BLOCK_N"]))
                return kernel[grid](*args, **meta)
            return launch

    monkeypatch.setattr(attn, "tma_ok", lambda *t: False)
    monkeypatch.setattr(attn, "_attn_kernel", Spy())
    _check(q, k, v, causal=True, config=cfg)
    assert seen == [(False, 64)]


def test_softcap_reference_is_gemma2s_eager_attention():
    """reference(softcap=c) is transformers' Gemma 2 eager form: scores · scale, then
    c·tanh(s / c), then the mask, softmax in fp32; and `unfused` (the benchmark baseline,
    SDPA has no softcap) agrees."""
    gen = _gen(3)
    q, k, v = _qkv(2, 4, 2, 9, 9, 16, torch.float32, gen)
    mask = torch.zeros(2, 1, 9, 9).masked_fill(torch.ones(9, 9, dtype=torch.bool).triu(1), float("-inf"))
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.9
    s = torch.tanh(s / 1.5) * 1.5 + mask
    want = torch.softmax(s, -1) @ v.repeat_interleave(2, 1)
    assert_close(attn.reference(q, k, v, scale=0.9, mask=mask, softcap=1.5), want)
    assert_close(attn.unfused(q, k, v, None, None, mask, False, 0.9, False, None, 1.5), want)
    assert_close(attn.unfused(q, k, v, None, None, None, True, 0.9, False, None, 1.5),
                 attn.reference(q, k, v, causal=True, scale=0.9, softcap=1.5))
    # the cap is doing something at these sizes
    assert (attn.reference(q, k, v, scale=0.9, mask=mask) - want).abs().max() > 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_kernel_prefill_and_decode(dtype):
    """The capped scores in every path: masked and unmasked blocks, causal, an additive
    mask, split keys (decode), scores large enough that tanh saturates (±cap)."""
    gen = _gen(4)
    q, k, v = _qkv(2, 4, 2, 21, 21, 32, dtype, gen)
    mask = torch.zeros(2, 1, 21, 21, dtype=dtype).masked_fill(
        torch.arange(21)[None, None, None, :] < 3 * torch.arange(2)[:, None, None, None], float("-inf"))
    for cfg in (_cfg(16, 16), _cfg(32, 16, stages=1)):
        _check(q, k, v, causal=True, config=cfg, scale=2.0, softcap=3.0)
        _check(q, k, v, mask=mask, config=cfg, scale=0.5, softcap=0.7)
    q1 = q[:, :, :1]
    _check(q1, k, v, config=_cfg(16, 16, splits=2), scale=4.0, softcap=2.0)
    _check(q1, k, v, mask=mask[:, :, :1], config=_cfg(16, 16, splits=1), scale=4.0, softcap=2.0)


def test_softcap_must_be_finite_and_not_negative():
    q, k, v = _qkv(1, 2, 1, 3, 3, 16, torch.float32, _gen())
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(KernelInputError, match="softcap"):
            attn.launch_attention(q, k, v, softcap=bad)


def test_sinks_reference_is_gpt_oss_eager_attention():
    """reference(sinks=s) is transformers' GPT-OSS eager form: the scores with one more
    column per head (the sink's logit), softmax, the column dropped; `unfused` agrees.
    A row with every key masked gives 0 (all the weight on the sink), as there."""
    gen = _gen(5)
    q, k, v = _qkv(2, 4, 2, 7, 7, 16, torch.float32, gen)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    mask = torch.zeros(2, 1, 7, 7).masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
    mask[1, :, 0] = float("-inf")  # batch 1, query 0: every key masked
    s = q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.3 + mask
    logits = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(2, -1, 7, 1)], -1)
    want = torch.softmax(logits - logits.amax(-1, keepdim=True), -1)[..., :-1] @ v.repeat_interleave(2, 1)
    assert_close(attn.reference(q, k, v, scale=0.3, mask=mask, sinks=sinks), want)
    assert_close(attn.unfused(q, k, v, None, None, mask, False, 0.3, False, None, 0.0, sinks), want)
    assert (want[1, :, 0] == 0).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_sinks_kernel_prefill_and_split_decode(dtype):
    """The sink counts once per row: in the prefill tiles, in decode's packed heads, and in
    one split of the keys only (split 0), with and without masks (a fully masked row: 0)."""
    gen = _gen(6)
    q, k, v = _qkv(2, 4, 2, 19, 19, 16, dtype, gen)
    sinks = 2 * randn_nonzero((4,), torch.float32, CPU, gen)
    mask = torch.zeros(2, 1, 19, 19, dtype=dtype)
    mask[1, :, :3] = float("-inf")
    for cfg in (_cfg(16, 16), _cfg(32, 16, stages=1)):
        _check(q, k, v, causal=True, config=cfg, sinks=sinks)
        _check(q, k, v, mask=mask, config=cfg, sinks=sinks, scale=0.4)
    for splits in (1, 2, 4):
        _check(q[:, :, :2], k, v, config=_cfg(16, 16, splits=splits), sinks=sinks)
    with pytest.raises(KernelInputError, match="sinks"):
        attn.launch_attention(q, k, v, sinks=sinks[:3])


# --------------------------------------------------------------------------- v's own head dim
# Multi-head latent attention (DeepSeek-V2/V3, Kimi, MiniCPM3, non-absorbed as in
# transformers): q, k 192 wide, v 128. Tiny here: Dk 24 / Dv 16 (v narrower; BLOCK_D 32 is
# masked, BLOCK_DV 16 is not), 40 / 64 (v wider), 32 / 24 (k's tile whole, v's masked).
DV_PAIRS = [(24, 16), (40, 64), (32, 24)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, dv", DV_PAIRS)
def test_v_head_dim_differs_prefill(dtype, d, dv):
    """out (B, Hq, Tq, Dv): GQA 4:2 over HF's transposed views, causal with ragged last
    blocks (unmasked and masked key loops), an additive mask over Tq < Tk, contiguous v."""
    gen = _gen(22)
    q, k, v = _qkv(2, 4, 2, 33, 33, d, dtype, gen, dv=dv)
    for cfg in (_cfg(16, 16), _cfg(32, 32, stages=1)):
        _check(q, k, v, causal=True, config=cfg, scale=0.3)
    q, k, v = _qkv(2, 4, 2, 21, 30, d, dtype, gen, transposed=False, dv=dv)
    mask = randn_nonzero((2, 1, 21, 30), dtype, CPU, gen)
    _check(q, k, v, mask=mask, config=_cfg(16, 16))
    _check(q, k, v, mask=mask, causal=True, config=_cfg(32, 16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, dv", DV_PAIRS[:2])
def test_v_head_dim_differs_split_decode(dtype, d, dv):
    """One query (and three, masked) against 37 keys: decode's packed heads, the keys split
    2 ways (partial acc (SPLITS, B, Hq, Tq, Dv) and the combine over Dv) and unsplit, and 4
    splits over 3 key blocks (an empty split)."""
    gen = _gen(23)
    q, k, v = _qkv(2, 4, 2, 1, 37, d, dtype, gen, dv=dv)
    for cfg in (_cfg(16, 16), _cfg(16, 16, splits=2), _cfg(16, 32, splits=2)):
        assert attn.SPACE.keep(cfg, attn.problem(q, k, v, causal=True))  # not replaced
        _check(q, k, v, causal=True, config=cfg)
    _, tables, m4, _ = attn._prepare(q, k, v, None, None, None, True, None, False, None)
    out, _ = attn._run(q, k, v, tables, m4, True, None, False, _cfg(16, 16, splits=4))
    assert out.shape == (2, 4, 1, dv)
    assert_close(out, attn.reference(q, k, v, causal=True))
    q3 = _qkv(2, 4, 2, 3, 37, d, dtype, gen)[0]
    mask = randn_nonzero((2, 1, 3, 37), dtype, CPU, gen)
    _check(q3, k, v, mask=mask, causal=True, config=_cfg(16, 16, splits=2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_v_head_dim_differs_rope_on_load(dtype):
    """cos/sin rotate q and k (Dk 24, partial rotary 16) and never v (Dv 16): prefill,
    per-batch random tables, causal; decode split in two; k rotated once before the
    kernel (from ROTATE_ONCE_MIN_TQ)."""
    gen = _gen(24)
    b, tq, tk = 2, 13, 21
    q, k, v = _qkv(b, 4, 2, tq, tk, 24, dtype, gen, dv=16)
    cos, sin = (randn_nonzero((b, tk, 16), dtype, CPU, gen, scale=0.7) for _ in range(2))
    for interleaved in (False, True):
        _check(q, k, v, cos, sin, causal=True, interleaved=interleaved, config=_cfg(16, 16))
    c1, s1 = rope.rope_tables(torch.arange(tk), 24, False, dtype)  # (1, Tk, 24): all of Dk
    _check(q[:, :, -1:], k, v, c1, s1, causal=True, config=_cfg(16, 16, splits=2))
    q2, k2, v2 = _qkv(b, 4, 2, tk, tk, 24, dtype, gen, dv=16)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn, "ROTATE_ONCE_MIN_TQ", tk)
        _check(q2, k2, v2, c1, s1, causal=True, config=_cfg(16, 16))


@pytest.mark.parametrize("d, dv", DV_PAIRS[:2])
def test_v_head_dim_differs_tma(monkeypatch, d, dv):
    """TMA=1: v's descriptor has its own block (1, 1, BLOCK_N, BLOCK_DV); keys past Tk and
    past the last position (NaN here, a cache's unwritten tail) never reach the output."""
    flags = _count_tma(monkeypatch)
    q, k, v = _qkv(1, 4, 2, 20, 40, d, torch.bfloat16, _gen(25), dv=dv)
    pos = torch.arange(20)[None, :] + 3
    clean_v = v.clone()
    v[:, :, 23:] = float("nan")
    for causal in (False, True):
        p = attn.problem(q, k, v, q_pos=pos, causal=causal)
        cfg = {**attn.SPACE.default(p), "TMA": 1}
        assert attn.SPACE.keep(cfg, p)
        out = attn.launch_attention(q, k, v, causal=causal, q_pos=pos, config=cfg)
        assert out.shape == (1, 4, 20, dv) and not out.isnan().any()
        assert_close(out, attn.reference(q, k, clean_v, causal=causal, q_pos=pos))
    assert flags == [True, True]


def test_v_must_match_k_in_batch_heads_and_keys():
    """v's head dim may differ from k's; its B, Hkv and Tk may not; nor may it pass MAX_D
    (the custom op then runs the reference)."""
    q, k, v = _qkv(2, 4, 2, 5, 7, 24, torch.float32, _gen(26), dv=16)
    for bad in (v[:, :, :6], v[:1], v[:, :1]):  # Tk, B, Hkv
        with pytest.raises(KernelInputError, match=r"v \(.*\) does not match k .* in B, Hkv, Tk"):
            attn.launch_attention(q, k, bad)
    wide = torch.randn(2, 2, 7, 264)
    with pytest.raises(KernelInputError, match="v head dim 264 > 256"):
        attn.launch_attention(q, k, wide)
    out = torch.ops.advisor.attention(q, k, wide, None, None, None, False, 0.2, False, None, 0.0,
                                      None, "")
    assert_close(out, attn.reference(q, k, wide, scale=0.2))


def test_v_head_dim_differs_custom_op_and_compile(monkeypatch):
    """The op's fake output is (B, Hq, Tq, Dv): a graph that splits its last dim as 4 x 4
    traces whole (not as Dk = 24), and the op runs Triton."""
    calls = []
    launch = attn.launch_attention
    monkeypatch.setattr(attn, "launch_attention", lambda *a, **kw: calls.append(1) or launch(*a, **kw))
    q, k, v = _qkv(1, 4, 2, 17, 17, 24, torch.bfloat16, _gen(27), dv=16)
    fn = torch.compile(lambda q, k, v: torch.ops.advisor.attention(
        q, k, v, None, None, None, True, 0.25, False, None, 0.0, None, "").unflatten(-1, (4, 4)),
        backend="eager", fullgraph=True)
    assert_close(fn(q, k, v), attn.reference(q, k, v, causal=True, scale=0.25).unflatten(-1, (4, 4)))
    assert calls == [1]


def test_v_head_dim_differs_reference_unfused_and_sdpa():
    """reference and the eager baseline (`unfused`: SDPA, and the matmul form taken for
    softcap / sinks) agree with SDPA at Dv != Dk; no keys give (B, Hq, Tq, Dv) zeros."""
    gen = _gen(28)
    q, k, v = _qkv(2, 4, 2, 9, 11, 24, torch.float32, gen, dv=16)
    mask = randn_nonzero((2, 1, 9, 11), torch.float32, CPU, gen)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    want = F.scaled_dot_product_attention(q, kr, vr, attn_mask=mask, scale=0.3)
    assert want.shape == (2, 4, 9, 16)
    assert_close(attn.reference(q, k, v, mask=mask, scale=0.3), want)
    assert_close(attn.unfused(q, k, v, None, None, mask, False, 0.3, False), want)
    cos, sin = rope.rope_tables(torch.arange(11), 24, False, torch.float32)
    for kw in ({"causal": True}, {"softcap": 2.0}, {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])}):
        causal, softcap, sinks = kw.get("causal", False), kw.get("softcap", 0.0), kw.get("sinks")
        assert_close(attn.unfused(q, k, v, cos, sin, None, causal, None, False, None, softcap, sinks),
                     attn.reference_op(q, k, v, cos, sin, None, causal, None, False, None, softcap,
                                       sinks))
    empty_k, empty_v = k[:, :, :0], v[:, :, :0]
    for out in (attn.reference(q, empty_k, empty_v), attn.launch_attention(q, empty_k, empty_v)):
        assert torch.equal(out, torch.zeros(2, 4, 9, 16))


def test_v_head_dim_in_problem_flops_bytes_and_space():
    """flops: 2·D per pair for q·kᵀ, 2·Dv for P·v; bytes: out is (B, Hq, Tq, Dv); the
    problem carries "dv" only where it differs; the space sizes v tiles and the
    accumulator by Dv (DeepSeek-V3's 192 / 128 heads)."""
    q, k, v = torch.empty(1, 2, 4, 24), torch.empty(1, 1, 4, 24), torch.empty(1, 1, 4, 16)
    assert attn.flops(q, k, v, causal=True) == 2 * 2 * (24 + 16) * 10
    assert attn.flops(q, k, v) == 2 * 2 * (24 + 16) * 16
    assert attn.flops(q, k, k) == attn.flops(q, k) == 4 * 2 * 24 * 16
    assert attn.bytes_moved(q, k, v) == 4 * (2 * 4 * 24 + 2 * 4 * 16 + 4 * 24 + 4 * 16)
    assert attn.problem(q, k, v)["dv"] == 16 and "dv" not in attn.problem(q, k, k)

    def meta(tq, tk, d, dv, **kw):
        return attn.problem(*(torch.empty(1, 128, t, w, device="meta", dtype=torch.bfloat16)
                              for t, w in ((tq, d), (tk, d), (tk, dv))), **kw)

    for tq, tk in ((1, 4096), (128, 128), (512, 512), (4096, 4096)):
        p, same = meta(tq, tk, 192, 128, causal=True), meta(tq, tk, 192, 192, causal=True)
        cfgs = attn.SPACE.configs(p)
        assert cfgs and all(attn._smem(c, p) <= attn.SMEM_MAX for c in cfgs)
        assert attn._smem(attn.SPACE.default(p), p) <= attn.SMEM_LIMIT
        assert attn._smem(cfgs[0], p) < attn._smem(cfgs[0], same)  # v tiles 128, not 256, wide
    # 8 warps hold a (128, 128) fp32 accumulator (v's 128 dims), not a (128, 256) one
    wide = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1, "SPLITS": 1, "TMA": 0}
    assert attn.SPACE.keep(wide, meta(512, 512, 192, 128))
    assert not attn.SPACE.keep(wide, meta(512, 512, 192, 192))


@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
def test_every_default_fits_shared_memory_and_registers(dtype):
    """fp32 at head dims 192-256 (MLA's 192/128 included) with a mask or RoPE on load: one
    stage was still over shared memory and the default stopped there (a compile failure on
    the GPU, a lost site at confirmation); it now takes fewer rows, then fewer keys."""
    import itertools

    for d, dv, mask, rotary, (tq, tk) in itertools.product(
            (64, 128, 192, 256), (64, 128, 192, 256), (0, 1), (0, 1),
            ((1, 37), (4, 2048), (512, 512), (512, 2048), (2048, 2048))):
        p = {"dtype": dtype, "batch": 1, "hq": 32, "hkv": 8, "tq": tq, "tk": tk, "d": d,
             "causal": int(tq == tk), "rope": rotary, "mask": mask, "pos": 0, **({"dv": dv} if dv != d else {})}
        cfg = attn.SPACE.default(p)
        assert attn._smem(cfg, p) <= attn.SMEM_MAX, (p, cfg)
        assert cfg["BLOCK_M"] * attn._block_dv(p) <= attn.MAX_ACC_PER_THREAD * 32 * cfg["num_warps"], (p, cfg)
        assert cfg["num_warps"] == 4 or cfg["BLOCK_M"] * cfg["BLOCK_N"] >= 2048, (p, cfg)
