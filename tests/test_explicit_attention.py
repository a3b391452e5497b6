"""Attention written out by hand, as models we have not seen spell it: one attention kernel
per layer, whatever the spelling, checked against eager on the interpreter's kernel.

- nanoGPT: `(q @ kᵀ) * (1/√d)`, `masked_fill(bias[:, :, :T, :T] == 0, -inf)` (a causal
  buffer per layer, True where a score is dropped), softmax, `@ v`.
- Meta's Llama reference: `q @ kᵀ / √d`, `+ mask` (a triu(-inf) tensor made in forward),
  `F.softmax(scores.float(), dim=-1).type_as(q)`, `@ v`.
- a finite fill (-1e9) where some rows drop every key: eager averages v there, and so must
  the kernel (a -inf mask would give 0).
- GPT-Neo / GPT-J: q, k upcast to fp32, `where(keep, s, finfo.min)`, a scale after it.
- SDPA on its math backend (`sdpa_kernel(SDPBackend.MATH)`; on CUDA also what SDPA falls
  back to where no fused backend takes the inputs): traced, q, k, v upcast to fp32, √scale
  on q and on kᵀ, `_safe_softmax`, the product cast back.
- BLOOM: q·kᵀ on (B·H, T, D) rows by `baddbmm` adding its ALiBi (B·H, 1, Tk), then the
  causal mask; GPT-NeoX-Japanese's baddbmm onto zeros.
- x-transformers: `einsum("bhid,bhjd->bhij")` and `einsum("bhij,bhjd->bhid")`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from advisor.kernels.testing import max_violation, tolerance
from advisor.runtime.apply import apply
from advisor.runtime.plan import ALL_FUSIONS, Plan

D, HEADS, CTX = 32, 4, 64


class _Attention(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.register_buffer("bias", torch.tril(torch.ones(CTX, CTX)).view(1, 1, CTX, CTX))
        self.prefix = nn.Parameter(torch.randn(2, 1, HEADS, 2, D // HEADS))  # "sdpa-prefix": k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        if self.spelling == "nanogpt":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        elif self.spelling == "padded":  # a finite fill, and the first 3 keys dropped for all:
            # rows 0-2 drop every key, and eager averages v there (all scores -1e5; a kernel
            # adding -1e5 to s would give softmax(s) there)
            drop = (self.bias[:, :, :t, :t] == 0) | (torch.arange(t, device=x.device) < 3)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            y = F.softmax(att.masked_fill(drop, -1e5), dim=-1) @ v
        elif self.spelling == "gpt-neo":  # q, k upcast; where(keep, s, finfo.min), / c, then a
            # padding mask added (min at the first 2 keys): a causally dropped padding key is
            # min + min = -inf in eager, a padded one kept is min (rows 0-1: uniform over j <= i)
            keep = self.bias[:, :, :t, :t].bool()
            att = torch.matmul(q.float(), k.float().transpose(-1, -2))
            att = torch.where(keep, att, torch.tensor(torch.finfo(torch.float32).min)) / 2.0
            pad = torch.zeros(t, device=x.device).masked_fill(torch.arange(t, device=x.device) < 2,
                                                              torch.finfo(torch.float32).min)
            y = torch.matmul(F.softmax(att + pad, dim=-1).to(v.dtype), v)
        elif self.spelling in ("bloom", "baddbmm-zeros"):  # on (B·H, T, D) rows: BLOOM adds its
            # ALiBi (B·H, 1, Tk) in baddbmm, GPT-NeoX-Japanese zeros; then the causal mask
            rows = lambda z: z.reshape(b * HEADS, t, c // HEADS)  # noqa: E731
            if self.spelling == "bloom":
                slopes = torch.tensor([2.0 ** (-(i + 1)) for i in range(HEADS)], device=x.device)
                first = (slopes[:, None] * torch.arange(t, device=x.device)).repeat(b, 1)[:, None, :]
            else:
                first = torch.zeros(b * HEADS, t, t, device=x.device, dtype=x.dtype)
            att = torch.baddbmm(first.to(x.dtype), rows(q), rows(k).transpose(-1, -2), beta=1.0,
                                alpha=1 / math.sqrt(c // HEADS)).view(b, HEADS, t, t)
            mask = torch.full((t, t), torch.finfo(x.dtype).min, device=x.device).triu(1)
            probs = F.softmax(att + mask, dim=-1, dtype=torch.float32).to(x.dtype)
            y = torch.bmm(probs.view(b * HEADS, t, t), rows(v)).view(b, HEADS, t, c // HEADS)
        elif self.spelling == "sdpa-math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.MATH):
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        elif self.spelling == "einsum":  # x-transformers: both products by einsum (5-D
            # unsqueeze/permute chains around each bmm: graph/head_products.py)
            att = torch.einsum("bhid,bhjd->bhij", q, k) * (c // HEADS) ** -0.5
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            y = torch.einsum("bhij,bhjd->bhid", att.softmax(dim=-1), v)
        elif self.spelling == "einsum-regrouped":  # the scores reshaped with a size made
            # after the product (2·t): the rewritten view goes where its sizes exist
            att = torch.einsum("bhid,bhjd->bhij", q, k).reshape(b, HEADS // 2, 2 * t, t)
            att = (att * (c // HEADS) ** -0.5).softmax(dim=-1).reshape(b, HEADS, t, t)
            y = torch.einsum("bhij,bhjd->bhid", att, v)
        elif self.spelling == "sdpa-prefix":  # 2 learned keys and values before the tokens'
            # (Tk = Tq + 2) under is_causal, which torch aligns top-left: query i sees keys j <= i
            k, v = (torch.cat([p.expand(b, -1, -1, -1), z], 2) for p, z in zip(self.prefix, (k, v)))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # Meta's reference
            mask = torch.full((t, t), float("-inf"), device=x.device).triu(1)
            scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(c // HEADS) + mask
            y = torch.matmul(F.softmax(scores.float(), dim=-1).type_as(q), v)
        return self.out(y.transpose(1, 2).contiguous().view(b, t, c))


class _Model(nn.Module):
    def __init__(self, spelling: str):
        super().__init__()
        self.emb = nn.Embedding(64, D)
        self.blocks = nn.ModuleList(_Attention(spelling) for _ in range(2))
        self.norms = nn.ModuleList(nn.LayerNorm(D) for _ in range(2))
        self.head = nn.Linear(D, 64, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for norm, block in zip(self.norms, self.blocks):
            x = x + block(norm(x))
        return self.head(x)


def _ids(t: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, t), generator=torch.Generator().manual_seed(t))


@pytest.mark.parametrize("spelling, dtype", [("nanogpt", torch.float32), ("meta", torch.float32),
                                             ("padded", torch.float32), ("gpt-neo", torch.float32),
                                             ("gpt-neo", torch.bfloat16), ("sdpa-math", torch.float32),
                                             ("sdpa-math", torch.bfloat16), ("bloom", torch.float32),
                                             ("bloom", torch.bfloat16), ("baddbmm-zeros", torch.float32),
                                             ("einsum", torch.float32), ("einsum", torch.bfloat16)])
def test_hand_written_attention_is_one_kernel(spelling, dtype):
    """bf16 GPT-Neo: the mask made at emit is fp32 (fp32's min in a bf16 mask is -inf, and
    confirmation refused every site)."""
    torch.manual_seed(0)
    model = _Model(spelling).eval().to(dtype)
    refs = {t: model(_ids(t)) for t in (1, 7)}
    fast = apply(model, Plan(("attention",)))
    for t, ref in refs.items():
        assert max_violation(fast(_ids(t)), ref, tolerance(dtype, model=True)) <= 0
    rows = fast.summary()
    row = next(r for r in rows if r["family"] == "attention")
    assert row["applied"] >= 2 and not row["unfused"], row
    total = next(r for r in rows if r["family"] == "(all)")
    assert total["launches_after"] < total["launches_before"] - 8, total  # ~6 ops a layer each
    # with every family on, the outputs still match
    fast = apply(model, ALL_FUSIONS)
    assert max_violation(fast(_ids(7)), refs[7], tolerance(dtype, model=True)) <= 0


def test_sdpa_is_causal_over_more_keys_than_queries_is_no_site():
    """torch's is_causal with Tk != Tq is top-left (query i sees keys j <= i); the kernel's
    causal is bottom-right (j <= i + Tk - Tq, a KV cache's). The site was offered, and
    confirmation refused it as a numerical mismatch, a misleading reason."""
    torch.manual_seed(0)
    model = _Model("sdpa-prefix").eval()
    refs = {t: model(_ids(t)) for t in (1, 7)}
    fast = apply(model, ALL_FUSIONS)
    for t, ref in refs.items():
        assert max_violation(fast(_ids(t)), ref, tolerance(torch.float32, model=True)) <= 0
    row = next(r for r in fast.summary() if r["family"] == "attention")
    assert row["applied"] == 0 and not row["unfused"], row


class _OneHeadEinsum(nn.Module):
    """One head: the P·V product's (B, 1, T, D) result is also a view of (B, T, D), so the
    reshapes after it run on past the 4-D one (a chain the rewrite must stop in)."""

    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.out = nn.Embedding(64, D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, ids):
        x = self.emb(ids)
        b, t, c = x.shape
        q, k, v = (z.view(b, t, 1, c).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        att = torch.einsum("bhid,bhjd->bhij", q, k) * c ** -0.5
        y = torch.einsum("bhij,bhjd->bhid", att.softmax(dim=-1), v)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("model", ["regrouped", "one-head"])
def test_einsum_attention_read_through_other_reshapes(model):
    torch.manual_seed(0)
    model = _Model("einsum-regrouped").eval() if model == "regrouped" else _OneHeadEinsum().eval()
    refs = {t: model(_ids(t)) for t in (5, 7)}
    fast = apply(model, Plan(("attention",)))
    for t, ref in refs.items():
        assert max_violation(fast(_ids(t)), ref, tolerance(torch.float32, model=True)) <= 0
    row = next(r for r in fast.summary() if r["family"] == "attention")
    assert row["applied"] >= 1 and not row["unfused"], row


def test_constants_are_read_as_the_graph_holds_them():
    """GPT-2's scale is full([], √head_dim, dtype=bf16): 4.46875 for head dim 20, not 4.4721."""
    from torch import fx

    from advisor.graph.patterns.attention import _constant

    graph = fx.Graph()
    node = graph.call_function(torch.ops.aten.full.default, ([], 20 ** 0.5), {"dtype": torch.bfloat16})
    assert _constant(node)[0] == 4.46875
    assert _constant(graph.call_function(torch.ops.aten.full.default, ([], 0.5), {}))[0] == 0.5


def test_confirmation_judges_where_the_truth_is_finite():
    """A where(keep, s, -inf) confirmation whose rows were all dropped made eager's error
    inf, and any output passed (a wrong kernel was accepted): now only finite truth is
    compared, and a truth with none refuses. Bool masks are drawn keeping key 0."""
    from torch import fx

    from advisor.runtime.rewrite import _as_accurate, random_like

    truth = (torch.tensor([1.0, float("nan"), 2.0], dtype=torch.float64),)
    eager = (torch.tensor([1.0, float("nan"), 2.0]),)
    assert _as_accurate((torch.tensor([1.0, 0.0, 2.0]),), eager, truth)
    assert not _as_accurate((torch.tensor([1.5, 0.0, 2.0]),), eager, truth)
    # eager broke at one place (NaN where the truth is finite): the rest is still judged
    broken = (torch.tensor([1.0, float("nan"), 2.0]),)
    finite_truth = (torch.tensor([1.0, 3.0, 2.0], dtype=torch.float64),)
    assert not _as_accurate((torch.tensor([1.0, 3.0, 2.5]),), broken, finite_truth)
    assert _as_accurate((torch.tensor([1.0, 0.0, 2.0]),), broken, finite_truth)
    nothing = (torch.full((3,), float("nan"), dtype=torch.float64),)
    assert not _as_accurate((torch.zeros(3),), (torch.zeros(3),), nothing)
    graph = fx.Graph()
    cond = graph.placeholder("cond")
    cond.meta["val"] = torch.zeros(2, 1, 5, 9, dtype=torch.bool)
    gen = torch.Generator().manual_seed(0)
    keep = random_like(cond, gen, keeps=True)
    drop = random_like(cond, gen)
    assert keep[..., 0].all() and not drop[..., 0].any()
    assert 0.5 < keep.float().mean() < 1 and 0 < drop.float().mean() < 0.5


class _HeadBatched(torch.nn.Module):
    """fairseq-style attention: q, k, v as (B·H, T, D) rows, bmm scores (B·H, T, T), a
    softmax over 3-D scores, bmm by v. `mask`: "causal" a (T, T) additive mask, "fill" a
    (1, T, T) masked_fill, "none", "expanded" the (T, T) mask broadcast to the rows by
    unsqueeze + expand, "padding-4d" a per-batch (B, 1, 1, T) mask added to a 4-D view of
    the scores (BART-style, viewed back), "floored" XGLM's: a causal mask added to the 4-D
    view, then max(s, finfo.min) ("clamped": s.clamp(min=finfo.min)), "scaled-rows" the scale on q's rows instead of the
    scores; no site: "per-row" a (B·H, T, T) additive mask (no (B|1, H|1, T, T) one),
    "grouped" rows (B, H·T, D) (every head's keys in one softmax), "max-0" max(s, 0)
    (it changes every negative score), "floored-inf" a -inf additive mask floored (a row
    of only masked keys is uniform in eager: no site unless the mask is finite by
    construction; "floored-drop" a -inf masked_fill then the floor is one, read as a
    finite drop), and "per-row-keys" a (B·H, Tk) bias unsqueezed to (B·H, 1, Tk)."""

    def __init__(self, mask: str, d: int = 32, heads: int = 4):
        super().__init__()
        self.mask, self.heads = mask, heads
        self.qkv, self.o = torch.nn.Linear(d, 3 * d, bias=False), torch.nn.Linear(d, d, bias=False)

    def forward(self, x):
        b, t, c = x.shape
        h, d = self.heads, c // self.heads
        rows = (b, h * t, d) if self.mask == "grouped" else (b * h, t, d)
        q, k, v = (y.view(b, t, h, d).transpose(1, 2).reshape(rows) for y in self.qkv(x).split(c, -1))
        if self.mask == "scaled-rows":
            s = torch.bmm(q * d ** -0.5, k.transpose(1, 2))
        else:
            s = torch.bmm(q, k.transpose(1, 2)) * d ** -0.5
        if self.mask == "expanded":
            s = s + torch.full((t, t), float("-inf")).triu(1).unsqueeze(0).expand(b * h, t, t)
        elif self.mask == "padding-4d":  # batch 0's keys 2, 5, ... padded
            pad = ((torch.arange(t) % 3 == 2).float() * -1e4 * (torch.arange(b) == 0).float().view(b, 1, 1, 1))
            s = (s.view(b, h, t, t) + pad).view(b * h, t, t)
        elif self.mask in ("floored", "floored-inf", "floored-drop"):
            floor, low = torch.full((), torch.finfo(s.dtype).min), torch.finfo(s.dtype).min
            s4 = s.view(b, h, t, t)
            if self.mask == "floored-drop":  # causal, and batch 0's first 3 keys padded: its
                pad = (torch.arange(b) == 0).view(b, 1, 1, 1) & (torch.arange(t) < 3)  # rows 0-2
                s4 = s4.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1) | pad, float("-inf"))
            else:  # XGLM's finfo.min mask; a -inf one may make rows of only -inf: no site
                s4 = s4 + torch.full((t, t), float("-inf") if self.mask == "floored-inf" else low).triu(1)
            s = torch.max(s4, floor).view(b * h, t, t)
        elif self.mask == "clamped":
            s = (s + torch.full((t, t), torch.finfo(s.dtype).min).triu(1)).clamp(min=torch.finfo(s.dtype).min)
        elif self.mask == "per-row-keys":  # a (B·H, Tk) key bias by unsqueeze(1): per row
            s = s + (torch.arange(b * h * t).view(b * h, t) % 3 == 0).float().mul(-1e4).unsqueeze(1)
        elif self.mask == "max-0":
            s = torch.max(s, torch.zeros(()))
        elif self.mask in ("scaled-rows", "grouped"):
            pass
        elif self.mask == "fill":
            s = s.masked_fill(torch.ones(1, t, t, dtype=torch.bool).triu(1), float("-inf"))
        elif self.mask != "none":
            causal = torch.full((t, t), float("-inf")).triu(1)
            s = s + (causal.expand(b * h, t, t) + 0.0 if self.mask == "per-row" else causal)
        o = torch.bmm(torch.softmax(s, -1), v)  # (B·H, T, D)
        return self.o(o.view(b, h, t, d).transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("mask", ["causal", "fill", "none", "expanded", "padding-4d", "floored",
                                  "floored-drop", "clamped", "scaled-rows", "per-row", "grouped", "max-0",
                                  "floored-inf", "per-row-keys"])
def test_softmax_over_head_batched_3d_scores_is_one_kernel(mask):
    torch.manual_seed(0)
    model = _HeadBatched(mask).eval()
    fast = apply(model, Plan(("attention",)))
    for t in (1, 7):
        x = torch.randn(2, t, 32)
        assert max_violation(fast(x), model(x), tolerance(torch.float32, model=True)) <= 0
    row = next(r for r in fast.summary() if r["family"] == "attention")
    none = mask in ("per-row", "grouped", "max-0", "floored-inf", "per-row-keys")
    assert (row["applied"] == 0 if none else row["applied"] >= 1) and not row["unfused"], row
    # a softmax no pattern read is named, by module, in the summary
    left = next(r for r in fast.summary() if r["family"] == "(all)")["softmax_left"]
    assert left == (["(top)"] if none else []), left  # the model's own forward holds it


def test_an_fp16_floor_is_no_site():
    """XGLM's max(s, finfo.min) in fp16: -65504 does not swamp s in the kernel's fp32, so a
    row of only masked keys (left padding) would be softmax(s) there and uniform in eager."""
    class Floored(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(32, 96, bias=False)

        def forward(self, x, pad):
            b, t, c = x.shape
            q, k, v = (y.view(b, t, 4, 8).transpose(1, 2).reshape(b * 4, t, 8) for y in self.qkv(x).split(c, -1))
            s = torch.bmm(q, k.transpose(1, 2)) * 8 ** -0.5
            keep = ~(pad[:, None, None, :] | torch.ones(t, t, dtype=torch.bool).triu(1))
            low = torch.finfo(x.dtype).min
            mask = torch.where(keep, torch.zeros((), dtype=x.dtype), torch.scalar_tensor(low, dtype=x.dtype))
            s = torch.max(s.view(b, 4, t, t) + mask, torch.full((), low, dtype=s.dtype)).view(b * 4, t, t)
            return torch.bmm(torch.softmax(s.float(), -1).to(v.dtype), v).view(b, 4, t, 8)

    model = Floored().half().eval()
    x, pad = torch.randn(2, 8, 32).half(), torch.zeros(2, 8, dtype=torch.bool)
    pad[0, :3] = True  # batch 0's first 3 queries see only padded keys
    fast = apply(model, Plan(("attention",)))
    torch.testing.assert_close(fast(x, pad), model(x, pad))
    row = next(r for r in fast.summary() if r["family"] == "attention")
    assert row["applied"] == 0 and not row["unfused"], row
