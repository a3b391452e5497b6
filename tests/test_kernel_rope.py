"""rope_qk / rope_qk_cache: Triton (interpreter) vs the eager reference, and the reference vs
transformers' own Llama (rotate-half) and GPT-J (interleaved) functions."""

from __future__ import annotations

import pytest
import torch

from advisor.errors import KernelInputError
from advisor.kernels import registry, rope
from advisor.kernels.testing import assert_close, randn_nonzero

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
SENTINEL = 7.0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qk(b, t, hq, hkv, d, dtype, gen, transposed=True):
    """q (B, Hq, T, D), k (B, Hkv, T, D): views of (B, T, H, D) like HF, or contiguous."""
    if transposed:
        q = randn_nonzero((b, t, hq, d), dtype, "cpu", gen).transpose(1, 2)
        k = randn_nonzero((b, t, hkv, d), dtype, "cpu", gen).transpose(1, 2)
        return q, k
    return (randn_nonzero((b, hq, t, d), dtype, "cpu", gen),
            randn_nonzero((b, hkv, t, d), dtype, "cpu", gen))


def _tables(shape, dtype, gen):
    """Random cos/sin (not real angles: catches cos[d] vs cos[partner] index mix-ups)."""
    return randn_nonzero(shape, dtype, "cpu", gen), randn_nonzero(shape, dtype, "cpu", gen)


def _two_configs(q, k, cos, interleaved):
    cfgs = rope.SPACE.configs(rope._problem(q, k, cos, interleaved))
    return [cfgs[0], cfgs[-1]]


def _check_qk(q, k, cos, sin, interleaved, config=None):
    qo, ko = rope.launch_rope_qk(q, k, cos, sin, interleaved, config)
    rq, rk = rope.reference(q, k, cos, sin, interleaved)
    # Outputs are dense in the inputs' dim order (as eager's elementwise result would be).
    assert qo.stride() == torch.empty_like(q).stride() and ko.stride() == torch.empty_like(k).stride()
    assert qo.dtype == ko.dtype == q.dtype
    assert_close(qo, rq)
    assert_close(ko, rk)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_gqa_partial_rotary_strided(dtype, interleaved):
    # D=40 (not a power of two), R=24 < D, GQA 4:2, q/k transposed views, per-batch tables.
    gen = _gen(1)
    q, k = _qk(2, 3, 4, 2, 40, dtype, gen)
    cos, sin = _tables((2, 3, 24), dtype, gen)
    for cfg in _two_configs(q, k, cos, interleaved):
        _check_qk(q, k, cos, sin, interleaved, cfg)


@pytest.mark.parametrize("interleaved", [False, True])
def test_mqa_multi_chunk(interleaved):
    # MQA (Hkv=1), head blocks partly masked (Hq=3), BLOCK_D=32 < D=96: partners cross chunks.
    gen = _gen(2)
    q, k = _qk(1, 2, 3, 1, 96, torch.bfloat16, gen, transposed=False)
    cos, sin = _tables((2, 64), torch.float32, gen)
    for cfg in ({"BLOCK_D": 32, "HEADS_PER_PROG": 2, "num_warps": 1},
                {"BLOCK_D": 128, "HEADS_PER_PROG": 4, "num_warps": 4}):
        _check_qk(q, k, cos, sin, interleaved, cfg)


def test_cos_sin_broadcast_forms():
    gen = _gen(3)
    b, t, r = 2, 3, 16
    q, k = _qk(b, t, 2, 1, 20, torch.float32, gen)
    c1, s1 = _tables((t, r), torch.float32, gen)  # one table for every batch
    cb, sb = _tables((b, t, r), torch.float32, gen)  # per-batch tables
    wide = randn_nonzero((t, 2 * r), torch.float32, "cpu", gen)[:, ::2]  # stride_r = 2
    full1 = (c1.expand(b, t, r).contiguous(), s1.expand(b, t, r).contiguous())
    forms = [  # (cos, sin, the same tables as contiguous (B, T, R))
        (c1, s1, *full1), (c1[None], s1[None], *full1),
        (c1[None, None], s1[None, None], *full1),
        (c1.expand(b, t, r), s1.expand(b, t, r), *full1),  # stride_b = 0 already
        (cb, sb, cb, sb), (cb[:, None], sb[:, None], cb, sb),
        (wide, wide.flip(0), *(x.expand(b, t, r).contiguous() for x in (wide, wide.flip(0)))),
    ]
    for cos, sin, full_c, full_s in forms:
        qo, ko = rope.launch_rope_qk(q, k, cos, sin, False)
        rq, rk = rope.reference(q, k, full_c, full_s)
        assert_close(qo, rq)
        assert_close(ko, rk)


@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_matches_transformers(interleaved):
    gen = _gen(4)
    b, t, h, d = 2, 5, 3, 16
    x = randn_nonzero((b, t, h, d), torch.float32, "cpu", gen)
    pos = torch.arange(3, 3 + t)
    cos, sin = rope.rope_tables(pos, d, interleaved, torch.float32)  # (1, T, D)
    ours, _ = rope.reference(x.transpose(1, 2), x.transpose(1, 2), cos, sin, interleaved)
    if interleaved:
        gptj = pytest.importorskip("transformers.models.gptj.modeling_gptj")
        theirs = gptj.apply_rotary_pos_emb(x, sin[..., ::2], cos[..., ::2]).transpose(1, 2)
    else:
        llama = pytest.importorskip("transformers.models.llama.modeling_llama")
        theirs, _ = llama.apply_rotary_pos_emb(x.transpose(1, 2), x.transpose(1, 2), cos, sin)
    assert_close(ours, theirs)


def _cache_case(dtype, interleaved, gen, cache_transposed=False):
    b, t, hq, hkv, d, r, smax = 2, 3, 4, 2, 24, 16, 9
    q, k = _qk(b, t, hq, hkv, d, dtype, gen)
    v = randn_nonzero((b, t, hkv, d), dtype, "cpu", gen).transpose(1, 2)
    cos, sin = _tables((1, t, r), dtype, gen)
    shape = (b, smax, hkv, d) if cache_transposed else (b, hkv, smax, d)
    kc = torch.full(shape, SENTINEL, dtype=dtype)
    vc = torch.full(shape, SENTINEL, dtype=dtype)
    if cache_transposed:
        kc, vc = kc.transpose(1, 2), vc.transpose(1, 2)
    pos = torch.tensor([6, 1, 4], dtype=torch.int32 if interleaved else torch.int64)
    return q, k, v, cos, sin, kc, vc, pos  # positions non-contiguous and unsorted


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_cache_write(dtype, interleaved):
    q, k, v, cos, sin, kc, vc, pos = _cache_case(dtype, interleaved, _gen(5),
                                                 cache_transposed=dtype == torch.float16)
    rkc, rvc = kc.clone(), vc.clone()
    rq = rope.reference_cache(q, k, v, cos, sin, rkc, rvc, pos, interleaved)
    cfg = {"BLOCK_D": 32, "HEADS_PER_PROG": 2, "num_warps": 1}
    qo = rope.launch_rope_qk_cache(q, k, v, cos, sin, kc, vc, pos, interleaved, cfg)
    assert_close(qo, rq)
    assert_close(kc, rkc)
    assert_close(vc, rvc)
    untouched = torch.ones(kc.shape[2], dtype=torch.bool)
    untouched[pos] = False
    assert (kc[:, :, untouched] == SENTINEL).all() and (vc[:, :, untouched] == SENTINEL).all()
    assert (kc[:, :, pos] != SENTINEL).all()


def test_cache_out_of_range_positions_are_masked():
    # The launcher rejects them on CPU; skip its position check to prove the store mask.
    q, k, v, cos, sin, kc, vc, _ = _cache_case(torch.float32, False, _gen(6))
    pos = torch.tensor([2, -1, kc.shape[2]])
    rope._run(q, k, v, cos, sin, kc, vc, pos, False, None)  # the launcher minus its checks
    rkc, rvc = torch.full_like(kc, SENTINEL), torch.full_like(vc, SENTINEL)
    rope.reference_cache(q[:, :, :1], k[:, :, :1], v[:, :, :1], cos[:, :1], sin[:, :1], rkc, rvc,
                         pos[:1], False)
    assert torch.equal(kc, rkc) and torch.equal(vc, rvc)
    with pytest.raises(KernelInputError, match="cache_position outside"):
        rope.launch_rope_qk_cache(q, k, v, cos, sin, kc, vc, pos)


def test_custom_ops_and_compile(monkeypatch):
    calls = []
    launch = rope.launch_rope_qk
    monkeypatch.setattr(rope, "launch_rope_qk", lambda *a: calls.append(a[-1]) or launch(*a))
    gen = _gen(7)
    q, k = _qk(1, 3, 4, 2, 24, torch.bfloat16, gen)
    cos, sin = rope.rope_tables(torch.arange(3), 16, False, torch.bfloat16)
    rq, rk = rope.reference(q, k, cos, sin, False)
    qo, ko = torch.ops.advisor.rope_qk(q, k, cos, sin, False, "")
    assert_close(qo, rq)
    assert_close(ko, rk)
    fn = torch.compile(lambda *a: torch.ops.advisor.rope_qk(*a, True, "BLOCK_D=32,"
                                                            "HEADS_PER_PROG=2,num_warps=1"),
                       backend="eager", fullgraph=True)
    qo, ko = fn(q, k, cos, sin)
    rq, rk = rope.reference(q, k, cos, sin, True)
    assert_close(qo, rq)
    assert_close(ko, rk)
    assert calls == [None, {"BLOCK_D": 32, "HEADS_PER_PROG": 2, "num_warps": 1}]  # Triton ran


def test_cache_custom_op_and_compile():
    q, k, v, cos, sin, kc, vc, pos = _cache_case(torch.bfloat16, False, _gen(8))
    rkc, rvc = kc.clone(), vc.clone()
    rq = rope.reference_cache(q, k, v, cos, sin, rkc, rvc, pos, False)

    def step(q, k, v, cos, sin, kc, vc, pos):
        return torch.ops.advisor.rope_qk_cache(q, k, v, cos, sin, kc, vc, pos, False, "")

    for fn in (step, torch.compile(step, backend="eager", fullgraph=True)):
        kc.fill_(SENTINEL)
        vc.fill_(SENTINEL)
        assert_close(fn(q, k, v, cos, sin, kc, vc, pos), rq)
        assert_close(kc, rkc)
        assert_close(vc, rvc)


def test_rejects_bad_input():
    gen = _gen(9)
    q, k = _qk(1, 3, 4, 2, 24, torch.float32, gen)
    cos, sin = _tables((3, 16), torch.float32, gen)
    bad = [
        (q.to(torch.int32), k, cos, sin),  # dtype
        (q, k.half(), cos, sin),  # q/k dtype mismatch
        (q, k[:, :, :2], cos, sin),  # T mismatch
        (q, k, cos[:2], sin[:2]),  # tables for the wrong T
        (q, k, cos[:, :15], sin[:, :15]),  # odd R
        (q, k, torch.ones(3, 26), torch.ones(3, 26)),  # R > D
        (q, k, cos.expand(2, 2, 3, 16), sin.expand(2, 2, 3, 16)),  # 4-D, dim 1 != 1
        (q[0], k[0], cos, sin),  # 3-D q
    ]
    for args in bad:
        with pytest.raises(KernelInputError):
            rope.launch_rope_qk(*args)
    with pytest.raises(KernelInputError):
        rope.launch_rope_qk(q, k, cos, sin, config={"BLOCK_D": 16, "HEADS_PER_PROG": 1,
                                                    "num_warps": 1})
    q, k, v, cos, sin, kc, vc, pos = _cache_case(torch.float32, False, gen)
    for kc2, vc2, pos2 in ((kc[:, :1], vc[:, :1], pos), (kc, vc.half(), pos),
                           (kc, vc, pos[:2]), (kc, vc, pos.float())):
        with pytest.raises(KernelInputError):
            rope.launch_rope_qk_cache(q, k, v, cos, sin, kc2, vc2, pos2)


def test_empty():
    q, k = torch.empty(2, 4, 0, 8), torch.empty(2, 2, 0, 8)
    cos = torch.empty(0, 8)
    qo, ko = rope.launch_rope_qk(q, k, cos, cos)
    assert qo.shape == q.shape and ko.shape == k.shape


def test_space():
    for tokens in (1, 4096):
        for name in ("rope_qk", "rope_qk_cache"):
            spec = registry.get(name)
            dims = spec.bench_dims(tokens)
            p = {"rows": dims["tokens"], "hq": dims["hq"], "hkv": dims["hkv"], "d": dims["d"]}
            cfgs = spec.space.configs(p)
            assert 2 <= len(cfgs) <= 40 and spec.space.default(p) in cfgs
    for d in (8, 40, 64, 96, 256):
        p = {"rows": 3, "hq": 3, "hkv": 1, "d": d}
        assert rope.SPACE.default(p) in rope.SPACE.configs(p)


@pytest.mark.parametrize("name", ["rope_qk", "rope_qk_cache"])
def test_registry(name):
    spec = registry.get(name)
    for dims in spec.test_dims:
        inputs = spec.make_inputs(dims, torch.bfloat16, torch.device("cpu"), _gen(10))
        ref_inputs = tuple(x.clone() if isinstance(x, torch.Tensor) else x for x in inputs)
        assert spec.problem(*inputs)["dtype"] == "torch.bfloat16"
        assert spec.bytes_moved(*inputs) > 0
        assert spec.spills(*inputs, config=None) is None  # interpreter
        out, ref = spec.launch(*inputs, config=spec.default_config(*inputs)), spec.reference(
            *ref_inputs)
        for o, r in zip(out if isinstance(out, tuple) else (out,),
                        ref if isinstance(ref, tuple) else (ref,), strict=True):
            assert_close(o, r)
        if name == "rope_qk_cache":
            assert_close(inputs[5], ref_inputs[5])
            assert_close(inputs[6], ref_inputs[6])
