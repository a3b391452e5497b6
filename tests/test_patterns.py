"""Candidate detection on models written differently: what a graph computes, not names."""

import functools

import pytest
import torch
import torch.nn.functional as F

from advisor.graph.candidates import Costs, candidates, matches_of
from advisor.graph.capture import capture, clean_path
from advisor.loader import build, inputs_for, load_model_file
from tests.hf_models import ids, tiny_hf

COSTS = Costs(launch_us=8.0, copy_gbps=4000.0)


def _families(model, inputs) -> dict[str, int]:
    return {c.family: c.count for c in candidates(matches_of(capture(model, inputs)), COSTS)}


@pytest.mark.parametrize("path", ["examples/tiny_llama.py", "examples/llama_hf.py"])
def test_examples_find_the_core_families(path):
    mf = load_model_file(path)
    model = build(mf, torch.device("cpu"), torch.bfloat16)
    fams = _families(model, inputs_for(mf, 7, 1, torch.device("cpu")))
    # 2 layers: 4 residual add+norm sites (incl. across the layer boundary and into the
    # final norm), one plain norm (first layer), RoPE, QKV and gate/up merges, SwiGLU.
    assert fams["add_rms_norm"] == 4 and fams["rms_norm"] == 1
    assert fams["rope"] == 2 and fams["qkv_merge"] == 2
    assert fams["gated_act"] == 2 and fams["gate_up_merge"] == 2
    assert fams["gate_up_swiglu"] == 2  # the same MLPs as one GEMM with the activation inside
    assert fams["gated_act_linear"] == 2  # or the product in down_proj's prologue
    assert fams["attention_rope"] == 2


@pytest.mark.parametrize("family,expect", [
    ("Gemma", {"add_rms_norm": 4, "gated_act": 2, "gate_up_swiglu": 2, "rope": 2, "qkv_merge": 2,
               "gated_act_linear": 2}),  # (1+w), GeGLU-tanh
    ("Qwen2", {"add_rms_norm": 4, "qkv_merge": 2, "rope": 2}),                   # q/k/v with bias
    ("GPTNeoX", {"add_layer_norm": 2, "layer_norm": 3, "bias_act": 2, "rope": 2}),  # LayerNorm, GeLU+bias, partial rotary
    ("Phi3", {"add_rms_norm": 4, "gated_act": 2, "rope": 2, "gated_act_linear": 2}),  # merged qkv/gate_up
])
def test_transformers_families(family, expect):
    fams = _families(tiny_hf(family), ids(7, batch=1))
    for fam, count in expect.items():
        assert fams.get(fam) == count, (fam, fams)


class _RotaryFromSizes(torch.nn.Module):
    """RoPE whose table is built in forward from sizes alone (no positions input): the
    runtime computes the table once per length (graph/shape_only.py), fused or not."""

    def forward(self, x):  # x (B, T, D)
        d = x.shape[-1]
        inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
        freqs = torch.arange(x.shape[1])[None, :, None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return x * emb.cos() + x.flip(-1) * emb.sin()


def test_sites_computed_once_per_length_are_not_candidates():
    model = _RotaryFromSizes()
    assert "rope_table" not in _families(model, (torch.randn(2, 5, 12),))

    class FromPositions(torch.nn.Module):  # the same table from a caller's positions
        def forward(self, x, pos):
            d = x.shape[-1]
            inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
            emb = torch.cat([pos[:, :, None].float() * inv_freq] * 2, dim=-1)
            return x * emb.cos() + x.flip(-1) * emb.sin()
    assert _families(FromPositions(), (torch.randn(2, 5, 12), torch.arange(5)[None].expand(2, 5)))["rope_table"] == 1


def test_a_table_too_large_to_keep_is_a_candidate(monkeypatch):
    """Past the memo's byte budget the runtime keeps nothing and recomputes the table each
    call: the fusion saves launches there."""
    import advisor.graph.shape_only as so
    monkeypatch.setattr(so, "MEMO_BYTES", 64)  # the (1, 5, 12) fp32 cos and sin tables: 480 bytes
    assert _families(_RotaryFromSizes(), (torch.randn(2, 5, 12),)).get("rope_table") == 1


def test_candidates_are_priced_and_ranked():
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    cands = candidates(matches_of(capture(model, inputs_for(mf, 8, 1, torch.device("cpu")))), COSTS)
    savings = [c.predicted_saving_ms for c in cands]
    assert savings == sorted(savings, reverse=True)
    add_norm = next(c for c in cands if c.family == "add_rms_norm")
    # Eager add+RMSNorm in fp32: add, pow, mean, add eps, rsqrt, mul, mul w = 7 kernels -> 1.
    assert add_norm.launches_removed == 4 * 6
    assert add_norm.bytes_avoided > 0
    expected = add_norm.launches_removed * 8e-3 + add_norm.bytes_avoided / 4e12 * 1e3
    assert add_norm.predicted_saving_ms == pytest.approx(expected)


def test_hand_written_spellings():
    """x*x instead of pow, x/sqrt instead of rsqrt, sigmoid-form SiLU, (1+w) weights."""
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(24) + 0.5)
            self.up = torch.nn.Linear(24, 40, bias=False)
            self.gate = torch.nn.Linear(24, 40, bias=False)

        def forward(self, x, r):
            h = r + x
            n = h / torch.sqrt((h * h).mean(dim=-1, keepdim=True) + 1e-6) * (1 + self.w)
            g = self.gate(n)
            return g * torch.sigmoid(g) * self.up(n), h

    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    model, x = Odd(), (torch.randn(2, 5, 24), torch.randn(2, 5, 24))
    fams = _families(model, x)
    assert fams["add_rms_norm"] == 1 and fams["gated_act"] == 1 and fams["gate_up_merge"] == 1
    # the sigmoid-form SiLU reads the gate projection twice, both reads inside the activation:
    # still one GEMM with two accumulators
    assert fams["gate_up_swiglu"] == 1
    ref = model(*x)
    fast = apply(model, Plan(("gate_up_swiglu",)))
    for got, want in zip(fast(*x), ref):
        assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert [r["applied"] for r in fast.summary() if r["family"] == "gate_up_swiglu"] == [1]


class _LibraryNorms(torch.nn.Module):
    """Residual block with the library's RMSNorms: torch 2.13 decomposes `F.rms_norm` and
    `nn.RMSNorm` with eps as an add.Scalar operand, not a tensor add."""

    def __init__(self, functional: bool):
        super().__init__()
        self.functional = functional
        self.n1, self.n2 = torch.nn.RMSNorm(24, eps=1e-6), torch.nn.RMSNorm(24, eps=1e-6)
        for n in (self.n1, self.n2):
            torch.nn.init.uniform_(n.weight, 0.5, 1.5)
        self.up = torch.nn.Linear(24, 40, bias=False)
        self.down = torch.nn.Linear(40, 24, bias=False)

    def norm(self, n, x):
        return torch.nn.functional.rms_norm(x, (24,), n.weight, 1e-6) if self.functional else n(x)

    def forward(self, x):
        h = x + self.down(torch.relu(self.up(self.norm(self.n1, x))))
        return self.norm(self.n2, h)


@pytest.mark.parametrize("functional", [True, False], ids=["F.rms_norm", "nn.RMSNorm"])
def test_library_rms_norms_are_rms_norms_and_apply(functional):
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    model = _LibraryNorms(functional)
    x = torch.randn(2, 5, 24)
    fams = _families(model, (x,))
    assert fams["rms_norm_linear"] == 1 and fams["add_rms_norm"] == 1, fams
    ref = model(x)
    fast = apply(model, Plan(("rms_norm", "add_rms_norm")))
    got = fast(x)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    applied = {r["family"]: r["applied"] for r in fast.summary() if "applied" in r}
    assert applied == {"rms_norm": 1, "add_rms_norm": 1}


@pytest.mark.parametrize("spelling", ["sum/D", "sum*(1/D)", "pow-0.5"])
def test_rms_norm_spelled_with_a_sum_or_a_power(spelling):
    """mean(x²) written sum(x², -1, keepdim) / D (or · 1/D), rsqrt written (·) ** -0.5: the
    same RMSNorm. A sum over a width it is not divided by, or x / rsqrt(·), is none."""
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    def ms(x):
        if spelling == "sum/D":
            return x.pow(2).sum(-1, keepdim=True) / 24
        if spelling == "sum*(1/D)":
            return (x * x).sum(-1, keepdim=True) * (1.0 / 24)
        return x.pow(2).mean(-1, keepdim=True)

    class Norms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(24) + 0.5)

        def forward(self, x, r):
            h = x + r
            inv = (ms(h) + 1e-6) ** -0.5 if spelling == "pow-0.5" else torch.rsqrt(ms(h) + 1e-6)
            not_a_norm = x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) / 12 + 1e-6)  # / 12
            not_a_norm = not_a_norm / torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)  # x·√
            return h * inv * self.w, h, not_a_norm

    model, x = Norms(), (torch.randn(2, 5, 24), torch.randn(2, 5, 24))
    fams = _families(model, x)
    assert fams.get("add_rms_norm") == 1 and not fams.get("rms_norm"), fams  # not the other two
    ref = model(*x)
    fast = apply(model, Plan(("add_rms_norm",)))
    for got, want in zip(fast(*x), ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [r["applied"] for r in fast.summary() if r["family"] == "add_rms_norm"] == [1]


@pytest.mark.parametrize("spelling", ["F.normalize*scale*g", "g*F.normalize*scale", "x/norm.clamp",
                                      "no-weight", "bf16-upcast", "x/(norm*D^-1/2).clamp*g",
                                      "x/(norm/sqrtD).clamp"])
def test_l2_normalised_times_root_width_is_an_rms_norm(spelling):
    """F.normalize(x, dim=-1) · √D [· g] (x-transformers' RMSNorm; the product by √D and
    the weight in either order, or x / x.norm(dim=-1, keepdim=True).clamp(min=ε)) is the
    RMSNorm with eps ε²/D; x / (‖x‖·D^-½).clamp(min=ε) [· g] (its older spelling) the one
    with eps ε². · √D / 2, another ord, no keepdim, and floors that are no eps (<= 0: no
    floor at all; 1: far from RMSNorm) are none. A zero row stays zero, as F.normalize
    leaves it in fp32 (an fp16 floor of 1e-12 rounds to 0: eager's is NaN there)."""
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    class Norms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.g, self.scale = torch.nn.Parameter(torch.rand(24) + 0.5), 24 ** 0.5

        def forward(self, x, r):
            h = x + r
            if spelling == "F.normalize*scale*g":
                y = F.normalize(h, dim=-1) * self.scale * self.g
            elif spelling == "g*F.normalize*scale":
                y = self.g * F.normalize(h, dim=-1, eps=1e-6) * self.scale
            elif spelling == "x/norm.clamp":
                y = h / h.norm(dim=-1, keepdim=True).clamp(min=1e-8) * self.scale * self.g
            elif spelling == "no-weight":
                y = F.normalize(h, dim=-1) * self.scale
            elif spelling == "x/(norm*D^-1/2).clamp*g":
                y = h / (torch.norm(h, dim=-1, keepdim=True) * 24 ** -0.5).clamp(min=1e-8) * self.g
            elif spelling == "x/(norm/sqrtD).clamp":
                y = h / (h.norm(dim=-1, keepdim=True) / self.scale).clamp(min=1e-8)
            else:
                y = (F.normalize(h.float(), dim=-1) * self.scale * self.g.float()).to(h.dtype)
            not_norms = (F.normalize(x, dim=-1) * (self.scale / 2) * self.g,
                         x / x.norm(p=1, dim=-1, keepdim=True) * self.scale,
                         x / torch.linalg.vector_norm(x, dim=-1).clamp(min=1e-6)[..., None] * self.scale,
                         r / r.norm(dim=-1, keepdim=True).clamp(min=-1.0) * self.scale * self.g,
                         (x2 := 2 * x) / x2.norm(dim=-1, keepdim=True).clamp(min=1.0) * self.scale * self.g,
                         (x3 := x - 1) / (x3.norm(dim=-1, keepdim=True) * 24 ** 0.5).clamp(min=1e-8) * self.g)
            return y, h, *not_norms

    dtype = torch.bfloat16 if spelling == "bf16-upcast" else torch.float32
    model = Norms().to(dtype)
    x = (torch.randn(2, 5, 24, dtype=dtype), torch.randn(2, 5, 24, dtype=dtype))
    x[0][0, 1], x[1][0, 1] = 1.0, -1.0  # h's row (0, 1) is zero
    fams = _families(model, x)
    assert fams.get("add_rms_norm") == 1 and not fams.get("rms_norm"), fams  # not the three others
    ref = model(*x)
    fast = apply(model, Plan(("add_rms_norm",)))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for got, want in zip(fast(*x), ref):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert [r["applied"] for r in fast.summary() if r["family"] == "add_rms_norm"] == [1]
    assert not fast(*x)[0][0, 1].any()


def test_a_mean_square_without_keepdim_is_no_rms_norm():
    """x (B, 1, D) · rsqrt(mean(x², -1) + eps): the (B, 1) mean broadcasts against (1, D),
    (B, B, D) out — not a norm of x (it was offered, and refused as a mismatch)."""
    class Broadcast(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(24) + 0.5)

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1) + 1e-6) * self.w

    assert not _families(Broadcast(), (torch.randn(3, 1, 24),)).get("rms_norm")


def test_an_eps_add_with_alpha_is_not_an_rms_norm():
    """add.Scalar(ms, eps, alpha) adds alpha·eps: not the norm's eps. Beside a plain norm of
    the same shape it would pass on that norm's confirmation (one per site signature)."""
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    class TwoNorms(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.rand(24) + 0.5)

        def norm(self, x, alpha):
            ms = x.pow(2).mean(-1, keepdim=True)
            return x * torch.rsqrt(torch.ops.aten.add.Scalar(ms, 1e-6, alpha)) * self.w

        def forward(self, x):
            return self.norm(self.norm(x, 1) * 1e-3, 1e5)

    model, x = TwoNorms(), torch.randn(2, 5, 24)
    assert _families(model, (x,)).get("rms_norm") == 1
    ref = model(x)
    torch.testing.assert_close(apply(model, Plan(("rms_norm",)))(x), ref)


def test_silu_of_a_projection_times_itself_is_not_a_gate_up_pair():
    class SelfGated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.g = torch.nn.Linear(24, 40, bias=False)

        def forward(self, x):
            h = self.g(x)
            return torch.nn.functional.silu(h) * h

    fams = _families(SelfGated(), (torch.randn(2, 5, 24),))
    assert fams.get("gated_act") == 1 and "gate_up_swiglu" not in fams, fams


_HALVES = {  # id: x -> (x1, x2), the two halves of the last dim, spelled differently
    "slice": lambda x: (x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]),
    "negative_slice": lambda x: (x[..., : x.shape[-1] // 2], x[..., -(x.shape[-1] // 2):]),
    "split": lambda x: torch.split(x, x.shape[-1] // 2, dim=-1),
    "split_with_sizes": lambda x: torch.split(x, [x.shape[-1] // 2] * 2, dim=-1),
    "chunk": lambda x: x.chunk(2, dim=-1),
}


class _RopeQK(torch.nn.Module):
    def __init__(self, halves):
        super().__init__()
        self.halves = halves

    def forward(self, q, k, cos, sin):  # q (B, Hq, T, D), k (B, Hkv, T, D), cos/sin (B, T, D)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)

        def rot(x):
            x1, x2 = self.halves(x)
            return x * c + torch.cat((-x2, x1), dim=-1) * s
        return rot(q) * 1.5, rot(k) - 1.0


@pytest.mark.parametrize("spelling", sorted(_HALVES))
def test_rotate_half_spelled_any_way_is_one_rope_site(spelling):
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    model = _RopeQK(_HALVES[spelling])
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g),
         torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g))
    assert _families(model, x).get("rope") == 1
    ref = model(*x)
    fast = apply(model, Plan(("rope",)))
    for got, want in zip(fast(*x), ref):
        torch.testing.assert_close(got, want)
    assert [r["applied"] for r in fast.summary() if r["family"] == "rope"] == [1]


class _RopePerCallViews(torch.nn.Module):
    """RoPE in a function called for q and for k, each call taking its own cos/sin views:
    the same value in two nodes, merged before matching so q and k pair (graph/cse.py)."""

    def forward(self, q, k, v, cos, sin):  # q (B, 4, T, 16), k/v (B, 2, T, 16), cos/sin (B, T, 16)
        def rot(x):  # the chunk's size arithmetic runs between q's and k's cos views
            return x * cos.unsqueeze(1) + torch.cat((-x.chunk(2, -1)[1], x.chunk(2, -1)[0]), -1) * sin.unsqueeze(1)
        return torch.nn.functional.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True,
                                                                enable_gqa=True)


@pytest.mark.parametrize("family", ["rope", "attention_rope"])
def test_rope_taking_its_table_views_per_call_is_one_site(family):
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g),
         torch.randn(2, 2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g),
         torch.randn(2, 5, 16, generator=g))
    model = _RopePerCallViews()
    ref = model(*x)
    fast = apply(model, Plan((family,)))  # a dynamic trace: size arithmetic between the views
    torch.testing.assert_close(fast(*x), ref, atol=1e-4, rtol=1e-4)
    (row,) = [r for r in fast.summary() if r["family"] == family]
    assert row["applied"] == 1, row


def _pairs_rope(x, freqs):
    """gpt-fast's RoPE: x (B, T, H, D) as (re, im) pairs, freqs (T, D/2, 2) = (cos, sin)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    f = freqs.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                       xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1)
    return out.flatten(3).type_as(x)


def _complex_rope(x, freqs):
    """Meta's Llama reference: x (B, T, H, D) as complex pairs, freqs (T, D/2) complex."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs.view(1, xc.shape[1], 1, xc.shape[-1])).flatten(3).type_as(x)


def _pairs_rope_bhtd(x, freqs):
    """The pairs written out on x (B, H, T, D) with a (T, D/2) table of each."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    c, s = freqs[..., 0], freqs[..., 1]
    out = torch.stack([xs[..., 0] * c - xs[..., 1] * s, xs[..., 1] * c + xs[..., 0] * s], -1)
    return out.flatten(3).type_as(x)


def _halves(x, freqs, rotate, bthd=False):
    """RoPE written out on x's halves with half-width tables c, s (T, D/2); x (B, H, T, D),
    or (B, T, H, D) with tables (1, T, 1, D/2)."""
    c, s = freqs[..., 0], freqs[..., 1]
    if bthd:
        c, s = c[None, :, None], s[None, :, None]
    return rotate(x, c, s)


def _halves_gpt_oss(x, c, s):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _halves_nanochat(x, c, s):  # the rotation the other way (sin negated), −sin as a factor
    d = x.shape[3] // 2
    x1, x2 = x[..., :d], x[..., d:]
    return torch.cat([x1 * c + x2 * s, x1 * (-s) + x2 * c], 3)


def _halves_fp32(x, c, s):  # fp32 math, tables first in each product, cast back
    xf = x.float()
    x1, x2 = xf[..., :8], xf[..., 8:]
    return torch.cat((c.float() * x1 - s.float() * x2, s.float() * x1 + c.float() * x2), -1).to(x.dtype)


def _halves_fp32_tables(x, c, s):  # fp32 tables promote x's halves; cast back at the end
    x1, x2 = x.chunk(2, -1)
    c, s = c.float(), s.float()
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1).to(x.dtype)


_PAIRS = {"gpt-fast": _pairs_rope, "complex": _complex_rope, "bhtd": _pairs_rope_bhtd,
          **{f"halves-{n}": functools.partial(_halves, rotate=f) for n, f in (
              ("gpt-oss", _halves_gpt_oss), ("nanochat", _halves_nanochat), ("fp32", _halves_fp32),
              ("fp32-tables", _halves_fp32_tables))},
          "halves-bthd": functools.partial(_halves, rotate=_halves_gpt_oss, bthd=True)}
_BHTD = {"bhtd", "halves-gpt-oss", "halves-nanochat", "halves-fp32", "halves-fp32-tables"}  # rotated after the transpose


class _PairsRopeAttention(torch.nn.Module):
    """Projections (static head counts and dims, as in a model), the RoPE, attention."""

    def __init__(self, spelling):
        super().__init__()
        self.spelling = spelling
        self.wq, self.wk, self.wv = (torch.nn.Linear(32, h * 16, bias=False) for h in (4, 2, 2))

    def forward(self, x, freqs):  # x (B, T, 32)
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, 16) for w in (self.wq, self.wk, self.wv))
        if self.spelling in _BHTD:
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        rope = _PAIRS[self.spelling]
        q, k = rope(q, freqs), rope(k, freqs)
        if self.spelling not in _BHTD:
            q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("family", ["rope", "attention_rope"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spelling", sorted(_PAIRS))
def test_rope_on_re_im_pairs_is_one_rope_site(spelling, dtype, family):
    from advisor.kernels.testing import max_violation, tolerance
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    g = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    model = _PairsRopeAttention(spelling).to(dtype)
    fast = apply(model, Plan((family,)))
    for t in (5, 3):  # one dynamic graph for both lengths
        x = torch.randn(2, t, 32, generator=g).to(dtype)
        angles = torch.outer(torch.arange(t).float(), torch.rand(8, generator=g))
        freqs = torch.polar(torch.ones_like(angles), angles) if spelling == "complex" else \
            torch.stack([angles.cos(), angles.sin()], -1).to(dtype)
        ref = model(x, freqs)
        assert max_violation(fast(x, freqs), ref, tolerance(dtype, model=True)) <= 0
    rows = {r["family"]: r for r in fast.summary()}
    assert rows[family]["applied"] == 1 and rows["(all)"]["compiles"] == 1, rows


@pytest.mark.parametrize("rotate", [
    lambda x1, x2, c, s: (x1 * c - x2 * s, x2 * c - x1 * s),  # both terms subtract
    lambda x1, x2, c, s: (x1 * c - x2 * s, x1 * c + x2 * s),  # the second half from x1's cos
    lambda x1, x2, c, s: (x2 * c - x1 * s, x1 * c + x2 * s),  # halves swapped
    lambda x1, x2, c, s: (x1 * c - x2 * s, x2 * s + x1 * c),  # sin on the wrong half
    lambda x1, x2, c, s: (x1 * c - x2 * s, x2 * (c + 0.5) + x1 * s),  # another cos table
    lambda x1, x2, c, s: (x1 * c - x2[..., :1] * s, x2 * c + x1[..., :1] * s),  # a column broadcast
], ids=["signs", "x1-twice", "swapped", "wrong-sin", "other-cos", "narrow"])
def test_wrong_rotations_of_halves_are_not_ropes(rotate):
    def f(q, k, c, s):
        def rope(x):
            x1, x2 = x.chunk(2, -1)
            return torch.cat(rotate(x1, x2, c, s), -1)
        return rope(q), rope(k)
    q, k, c, s = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 5, 16), torch.randn(5, 8), torch.randn(5, 8)
    assert "rope" not in _families(_Fn(f), (q, k, c, s))
    right = _families(_Fn(lambda q, k, c, s: tuple(
        torch.cat((x[..., :8] * c - x[..., 8:] * s, x[..., 8:] * c + x[..., :8] * s), -1) for x in (q, k))),
        (q, k, c, s))
    assert right.get("rope") == 1, right  # the same harness finds the true rotation


class _Fn(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class _GPTJRope(torch.nn.Module):
    """GPT-J's RoPE: interleaved, on (B, T, H, D) before the heads move, partial (the first
    8 of 16 dims), tables (1, T, 1, 8) repeated per pair; then permuted for attention."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv = (torch.nn.Linear(32, h * 16, bias=False) for h in (4, 2, 2))

    def forward(self, x, sincos):  # x (B, T, 32), sincos (1, T, 8): sin | cos halves
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, 16) for w in (self.wq, self.wk, self.wv))
        sin, cos = (torch.repeat_interleave(z[:, :, None, :], 2, 3) for z in torch.split(sincos, 4, -1))

        def rot(z):
            zr, zp = z[..., :8], z[..., 8:]
            pairs = torch.stack((-zr[..., 1::2], zr[..., ::2]), dim=-1).flatten(-2)
            return torch.cat([zr * cos + pairs * sin, zp], dim=-1)
        q, k, v = (z.permute(0, 2, 1, 3) for z in (rot(q), rot(k), v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


@pytest.mark.parametrize("family", ["rope", "attention_rope"])
def test_rope_on_batch_seq_heads_layout_is_one_site(family):
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    torch.manual_seed(5)
    model = _GPTJRope()
    fast = apply(model, Plan((family,)))
    for t in (5, 3):  # dynamic: the rotary slice is a full slice of dim 1 too
        x, sincos = torch.randn(2, t, 32), torch.randn(1, t, 8)
        torch.testing.assert_close(fast(x, sincos), model(x, sincos), atol=1e-4, rtol=1e-4)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows[family]["applied"] == 1 and rows["(all)"]["compiles"] == 1, rows


class _MQARope(torch.nn.Module):
    """transformers' layout with one KV head: at one token, k (B, 1, 1, D) reads as
    (B, T, H, D) as well as (B, H, T, D); q's layout settles it."""

    def __init__(self, kv_heads):
        super().__init__()
        self.wq, self.wk, self.wv = (torch.nn.Linear(32, h * 16, bias=False) for h in (4, kv_heads, kv_heads))

    def forward(self, x, cos, sin):  # cos/sin (B, T, 16)
        b, t, _ = x.shape
        q, k, v = (w(x).view(b, t, -1, 16).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        half = lambda z: torch.cat((-z[..., 8:], z[..., :8]), -1)  # noqa: E731
        q, k = q * c + half(q) * s, k * c + half(k) * s
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)


@pytest.mark.parametrize("family", ["rope", "attention_rope"])
@pytest.mark.parametrize("kv_heads", [1, 4])
def test_one_token_rope_with_one_kv_head_is_one_site(family, kv_heads):
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    torch.manual_seed(6)
    model = _MQARope(kv_heads)
    fast = apply(model, Plan((family,)))
    x, cos, sin = torch.randn(2, 1, 32), torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    torch.testing.assert_close(fast(x, cos, sin), model(x, cos, sin), atol=1e-4, rtol=1e-4)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows[family]["applied"] == 1, rows


class _FlatExpertMLP(torch.nn.Module):
    """A MoE block's shared expert: hidden states flattened to (B·T, D) once, read by the
    router too (so the flat view is shared); the expert's output stays (B·T, D)."""

    def __init__(self, d=32, f=48):
        super().__init__()
        self.router = torch.nn.Linear(d, 4, bias=False)
        self.gate, self.up = torch.nn.Linear(d, f, bias=False), torch.nn.Linear(d, f, bias=False)

    def forward(self, x):  # x (B, T, D)
        h = x.view(-1, x.shape[-1])
        return torch.nn.functional.silu(self.gate(h)) * self.up(h), self.router(h)


def test_gate_up_of_a_shared_flat_view_keeps_the_flat_shape():
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    torch.manual_seed(7)
    model, x = _FlatExpertMLP(), torch.randn(2, 5, 32)
    fast = apply(model, Plan(("gate_up_swiglu",)))
    for got, want in zip(fast(x), model(x)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["gate_up_swiglu"]["applied"] == 1 and not rows["gate_up_swiglu"]["unfused"], rows


class _PartialRope(torch.nn.Module):
    """Partial rotary applied per tensor: q's cat(rotated, passed) reads q's rotation before
    k's slice is taken, so the fused op's operand (k's slice) must move up."""

    def __init__(self, read_passed: bool = False):
        super().__init__()
        self.read_passed = read_passed

    def forward(self, q, k, cos, sin):  # q (B, Hq, T, D), k (B, Hkv, T, D), cos/sin (B, T, D/2)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)

        def rot(x):
            xr, xp = x[..., :8], x[..., 8:]
            half = torch.cat((-xr[..., 4:], xr[..., :4]), dim=-1)
            return torch.cat((xr * c + half * s, xp), dim=-1)
        if self.read_passed:  # k's passed dims read elsewhere too: a view two nodes share
            return rot(q), rot(k), k[..., 8:] * 2
        return rot(q), rot(k)


@pytest.mark.parametrize("read_passed", [False, True])
def test_partial_rotary_applied_per_tensor_is_one_rope_site(read_passed):
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g),
         torch.randn(2, 5, 8, generator=g), torch.randn(2, 5, 8, generator=g))
    model = _PartialRope(read_passed)
    ref = model(*x)
    fast = apply(model, Plan(("rope",)))
    for got, want in zip(fast(*x), ref):
        torch.testing.assert_close(got, want)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["rope"]["applied"] == 1, rows
    # the cats that join the rotated and passed dims are the kernel's too (patterns/rope.py
    # `_partial`): one launch left of 12 (and the `* 2` of the passed dims)
    assert rows["(all)"]["launches_after"] == 1 + read_passed, rows


class _EagerAttention(torch.nn.Module):
    """transformers' eager attention on 4-D tensors: GQA by expand, softmax upcast to fp32
    and cast back; `@` lowers to expand → view → bmm on both sides of the softmax."""

    def __init__(self, read_by_matmul: bool = True):
        super().__init__()
        self.read_by_matmul = read_by_matmul

    def forward(self, q, k, v, mask):  # q (B, 4, T, D), k/v (B, 2, T, D), mask (T, T)
        k, v = (t[:, :, None].expand(-1, -1, 2, -1, -1).reshape(q.shape[0], 4, *t.shape[2:])
                for t in (k, v))
        scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return p @ v if self.read_by_matmul else p.sum(-1)


@pytest.mark.parametrize("read_by_matmul", [True, False])
def test_explicit_4d_attention_is_an_attention_candidate(read_by_matmul):
    t = 6
    x = (torch.randn(2, 4, t, 16, dtype=torch.bfloat16), torch.randn(2, 2, t, 16, dtype=torch.bfloat16),
         torch.randn(2, 2, t, 16, dtype=torch.bfloat16),
         torch.full((t, t), -1e4, dtype=torch.bfloat16).triu(1))
    fams = _families(_EagerAttention(read_by_matmul), x)
    assert fams.get("attention") == (1 if read_by_matmul else None), fams


def test_clean_path():
    assert clean_path("L['args'][0].model.layers[0].mlp") == "model.layers.0.mlp"
    assert clean_path("L['self']._modules['layers']._modules['3'].attn") == "layers.3.attn"
    # apply's entry calls the module, a local named model: paths as from the module's own trace
    assert clean_path("L['model'].layers.0.feed_forward") == "layers.0.feed_forward"
    assert clean_path("L['model']") == ""
    assert clean_path("L['fn'].0") == "0"  # an nn.Sequential traced at the top


# --- activations recognised by what they compute (patterns/activation.py spelled_activation)

SPELLINGS = {  # id: (the activation it computes, a spelling of it)
    # GPT-2 / GPT-J / Phi "gelu_new"
    "gelu_new": ("gelu_tanh", lambda x: 0.5 * x * (1.0 + torch.tanh(
        0.7978845608028654 * (x + 0.044715 * torch.pow(x, 3.0))))),
    # "gelu_fast": the same function, written otherwise
    "gelu_fast": ("gelu_tanh", lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))),
    "gelu_erf": ("gelu", lambda x: x * 0.5 * (1.0 + torch.erf(x / 1.4142135623730951))),
    "silu_exp": ("silu", lambda x: x / (1.0 + torch.exp(-x))),
    "silu_cast": ("silu", lambda x: (x.float() * torch.sigmoid(x.float())).to(x.dtype)),
    "relu_clamp": ("relu", lambda x: torch.clamp_min(x, 0.0)),
    "relu_where": ("relu", lambda x: torch.where(x > 0, x, 0.0)),
    "quick_gelu": ("quick_gelu", lambda x: x * torch.sigmoid(1.702 * x)),  # CLIP
    # NanoChat, modded-nanogpt: matched at the square, not at the relu inside it
    "relu2_square": ("relu2", lambda x: F.relu(x).square()),
    "relu2_pow": ("relu2", lambda x: torch.relu(x).pow(2)),
    "relu2_mul": ("relu2", lambda x: F.relu(x) * F.relu(x)),
}


class _SpelledMLP(torch.nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc1, self.fc2, self.act = torch.nn.Linear(16, 24), torch.nn.Linear(24, 16), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("spelling", sorted(SPELLINGS))
def test_spelled_activations_are_recognised_and_fused(spelling):
    from advisor.graph.patterns.activation import activation_of
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    name, fn = SPELLINGS[spelling]
    torch.manual_seed(0)
    model = _SpelledMLP(fn).eval()
    x = torch.randn(2, 5, 16)
    fams = _families(model, (x,))
    assert fams.get("linear_bias_act") == 1 and fams.get("bias_act") == 1, fams
    site = next(m for m in matches_of(capture(model, (x,))) if m.family == "bias_act")
    assert site.operands["activation"] == name == activation_of(site.outputs["y"])[0]
    for family in ("bias_act", "linear_bias_act"):
        fast = apply(model, Plan((family,)))
        torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
        assert {r["family"]: r for r in fast.summary()}[family]["applied"] == 1


class _BiasFreeMLP(torch.nn.Module):
    """MPT's MLP, gelu(x·W_upᵀ)·W_downᵀ with no biases; `gated`: silu(x·W_gᵀ)·(x·W_uᵀ)."""

    def __init__(self, gated=False, act=F.gelu):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 16, bias=False)
        self.gate = torch.nn.Linear(16, 24, bias=False) if gated else None
        self.act = act

    def forward(self, x):
        if self.gate is None:
            return self.down(self.act(self.up(x)))
        return self.down(F.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("act", [F.gelu, lambda h: F.relu(h).square()], ids=["gelu", "relu2"])
def test_a_bias_free_projections_activation_goes_into_its_epilogue(act):
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    torch.manual_seed(0)
    model, x = _BiasFreeMLP(act=act).eval(), torch.randn(2, 5, 16)
    assert _families(model, (x,)).get("linear_bias_act") == 1
    fast = apply(model, Plan(("linear_bias_act",)))
    torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    assert {r["family"]: r for r in fast.summary()}["linear_bias_act"]["applied"] == 1
    # a gate's activation is one factor of act(g)·u: the gated forms take it
    assert "linear_bias_act" not in _families(_BiasFreeMLP(gated=True).eval(), (x,))


@pytest.mark.parametrize("fn", [
    lambda x: x * torch.sigmoid(1.5 * x),  # no kernel implements it
    lambda x: torch.tanh(x) * 2.0,
    lambda x: x * x + x,                      # polynomial
    lambda x: 0.5 * x * (1.0 + torch.tanh(0.79788 * (x + 0.05 * x * x * x))),  # a near miss
], ids=["sigmoid_1.5", "tanh", "poly", "near_gelu"])
def test_other_elementwise_chains_are_not_activations(fn):
    fams = _families(_SpelledMLP(fn).eval(), (torch.randn(2, 5, 16),))
    assert "bias_act" not in fams and "linear_bias_act" not in fams, fams


def test_spelled_activation_whose_intermediate_is_read_elsewhere_is_left():
    """tanh(·) also returned: replacing the chain would leave that reader without a value."""
    class Leaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(16, 24)

        def forward(self, x):
            h = self.fc1(x)
            t = torch.tanh(0.7978845608028654 * (h + 0.044715 * h * h * h))
            return 0.5 * h * (1.0 + t), t

    fams = _families(Leaky().eval(), (torch.randn(2, 5, 16),))
    assert "bias_act" not in fams and "linear_bias_act" not in fams, fams


def test_gpt_style_families_fuse_their_spelled_gelu():
    """GPT-J's MLP is fc_in (bias) → gelu_new (an elementwise chain) → fc_out."""
    import transformers

    config = transformers.GPTJConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256,
                                     rotary_dim=8)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    fams = _families(transformers.GPTJForCausalLM(config).eval(), ids(7, batch=1))
    assert fams.get("linear_bias_act") == 2 and fams.get("bias_act") == 2, fams


# --- LayerNorm spelled out, norms computed in fp32 and cast back (patterns/norm.py) ---------

class _SpelledLayerNorm(torch.nn.Module):
    """Cohere's LayerNorm: fp32 statistics, x - mean computed twice, a cast weight, a cast
    back; optionally a bias (a hand-written nn.LayerNorm)."""

    def __init__(self, n: int = 24, bias: bool = False, twice: bool = True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(n) + 0.5)
        self.bias = torch.nn.Parameter(torch.randn(n) * 0.1) if bias else None
        self.twice = twice
        self.proj = torch.nn.Linear(n, n, bias=False)

    def forward(self, x, r):
        h = x + r
        hf = h.to(torch.float32)
        mean = hf.mean(-1, keepdim=True)
        d = hf - mean
        var = d.pow(2).mean(-1, keepdim=True)
        y = ((hf - mean) if self.twice else d) * torch.rsqrt(var + 1e-5)
        y = self.weight.to(torch.float32) * y
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return self.proj(y.to(h.dtype)), h


@pytest.mark.parametrize("bias,twice", [(False, True), (True, False)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spelled_layer_norm_is_a_layer_norm(bias, twice, dtype):
    from advisor.kernels.testing import max_violation, tolerance
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    torch.manual_seed(0)
    model = _SpelledLayerNorm(bias=bias, twice=twice).to(dtype).eval()
    x, r = torch.randn(2, 5, 24, dtype=dtype), torch.randn(2, 5, 24, dtype=dtype)
    fams = _families(model, (x, r))
    assert fams.get("add_layer_norm") == 1 and "rms_norm" not in fams, fams
    site = next(m for m in matches_of(capture(model, (x, r))) if m.family == "add_layer_norm")
    assert (site.operands["bias"] is not None) == bias and site.operands["eps"] == 1e-5
    fast = apply(model, Plan(("add_layer_norm",)))
    for got, want in zip(fast(x, r), model(x, r)):
        assert max_violation(got, want, tolerance(dtype, model=True)) <= 0
    assert {r["family"]: r for r in fast.summary()}["add_layer_norm"]["applied"] == 1


class _WeightlessNorms(torch.nn.Module):
    """An RMSNorm with no weight, one whose weight multiplies after a reshape (Bamba's
    grouped norm), after a residual add, `F.rms_norm` with no weight (NanoChat,
    modded-nanogpt), and beside them a weighted one."""

    def __init__(self, d: int = 24, groups: int = 2):
        super().__init__()
        self.w, self.groups = torch.nn.Parameter(torch.rand(d) + 0.5), groups
        self.v = torch.nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x, r):
        h = x + r
        plain = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + 1e-6)
        weighted = self.v * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        return plain, self.w * g.view(h.shape), weighted, F.rms_norm(r * 2.0, (r.shape[-1],))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weightless_rms_norms_run_the_norm_kernel_without_a_scale(dtype):
    """The same kernel and family as the weighted one (its HAS_WEIGHT off); the grouped
    norm's weight stays a multiply after the view."""
    from advisor.kernels.testing import max_violation, tolerance
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import ALL_FUSIONS

    model = _WeightlessNorms().to(dtype).eval()
    x, r = torch.randn(2, 5, 24).to(dtype), torch.randn(2, 5, 24).to(dtype)
    matches = matches_of(capture(model, (x, r)))
    norms = sorted((m.family, m.kernel) for m in matches if "rms_norm" in m.family)
    assert norms == [("add_rms_norm", "add_rms_norm"), ("rms_norm", "rms_norm"),
                     ("rms_norm", "rms_norm"), ("rms_norm", "rms_norm")], norms
    fast = apply(model, ALL_FUSIONS)
    for got, want in zip(fast(x, r), model(x, r)):
        assert max_violation(got, want, tolerance(dtype, model=True)) <= 0
    rows = {row["family"]: row for row in fast.summary()}
    assert not [row for row in rows.values() if row.get("unfused")], rows
    assert rows["rms_norm"]["applied"] == 3 and rows["add_rms_norm"]["applied"] == 1, rows


def test_bf16_gemma_norms_read_their_cast_weight():
    """Gemma computes (1 + w.float())·n in fp32 and casts back: in bf16 the weight is a
    cast node, which the norm pattern follows to the parameter."""
    from advisor.kernels.testing import max_violation, tolerance
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import Plan

    model = tiny_hf("Gemma", torch.bfloat16)
    fast = apply(model, Plan(("rms_norm", "add_rms_norm")))
    got, want = fast(**ids(6)).logits, model(**ids(6)).logits
    assert max_violation(got, want, tolerance(torch.bfloat16, model=True)) <= 0
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["rms_norm"]["applied"] == 1 and rows["add_rms_norm"]["applied"] == 4, rows
    assert not rows["rms_norm"]["unfused"] and not rows["add_rms_norm"]["unfused"]


def test_interleaved_rope_and_spelled_layer_norm_of_cohere():
    """Cohere rotates pairs (stack((-x[..., 1::2], x[..., ::2]), -1) viewed back) and writes
    its LayerNorm out by hand: RoPE (folded into attention) and the norms are found."""
    from advisor.graph.patterns import rope

    model = tiny_hf("Cohere")
    captured = capture(model, ids(7, batch=1))
    sites = [m for part in captured.parts for m in rope.find(part.gm)]
    assert len(sites) == 2 and all(m.operands["interleaved"] for m in sites)
    fams = _families(model, ids(7, batch=1))
    assert fams.get("attention_rope") == 2 and fams.get("rope") == 2, fams
    assert fams.get("layer_norm") == 1 and fams.get("add_layer_norm") == 2, fams


class _CastInside(torch.nn.Module):
    """fp32 MLP whose gate activation rounds through bf16 mid-chain: relu, .to(bf16), .float(),
    square. Not relu² of the gate (the rounding is part of what it computes)."""

    def __init__(self):
        super().__init__()
        self.g, self.u, self.d = (torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(16, 24, bias=False),
                                  torch.nn.Linear(24, 16, bias=False))

    def forward(self, x):
        return self.d(F.relu(self.g(x)).to(torch.bfloat16).float().square() * self.u(x))


class _NarrowNorm(torch.nn.Module):
    """fp32 model normalising a bf16 copy of x: the norm's input is the rounded copy."""

    def forward(self, x):
        h = x.to(torch.bfloat16)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).float() * 2


@pytest.mark.parametrize("model", [_CastInside, _NarrowNorm])
def test_a_narrowing_cast_inside_a_spelling_is_kept(model):
    # review, session 26: the activation chain grew past the bf16 cast (relu² of the fp32
    # gate, 0.1 off); the norm read x before its cast (0.05 off in an fp32 model)
    from advisor.kernels.testing import max_violation, tolerance
    from advisor.runtime.apply import apply
    from advisor.runtime.plan import ALL_FUSIONS

    torch.manual_seed(0)
    m, x = model().eval(), torch.randn(2, 8, 16) * 4
    fast = apply(m, ALL_FUSIONS)
    assert max_violation(fast(x), m(x), tolerance(torch.float32, model=True)) <= 0


def test_relu2_gates_in_fp16_are_left_to_eager():
    # relu(g)² stored in fp16 overflows (g ≥ 256) where the kernels' fp32 act(g)·u does not
    torch.manual_seed(0)
    model = _BiasFreeMLP(gated=True).half().eval()
    model.forward = lambda x: model.down(F.relu(model.gate(x)).square() * model.up(x))
    x = torch.randn(2, 5, 16).half()
    fams = _families(model, (x,))
    assert not {"gated_act", "gate_up_swiglu", "gated_act_linear"} & set(fams), fams
