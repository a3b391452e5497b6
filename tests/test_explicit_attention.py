"""Attention written out by hand, as models we have not seen spell it: one attention kernel
per layer, whatever the spelling, checked against eager on the interpreter's kernel.

- nanoGPT: `(q @ kᵀ) * (1/√d)`, `masked_fill(bias[:, :, :T, :T] == 0, -inf)` (a causal
  buffer per layer, True where a score is dropped), softmax, `@ v`.
- Meta's Llama reference: `q @ kᵀ / √d`, `+ mask` (a triu(-inf) tensor made in forward),
  `F.softmax(scores.float(), dim=-1).type_as(q)`, `@ v`.
- a finite fill (-1e9) where some rows drop every key: eager averages v there, and so must
  the kernel (a -inf mask would give 0).
- GPT-Neo / GPT-J: q, k upcast to fp32, `where(keep, s, finfo.min)`, a scale after it.
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, HEADS, c // HEADS).transpose(1, 2) for z in self.qkv(x).split(c, dim=2))
        if self.spelling == "nanogpt":
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :t, :t] == 0, float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        elif self.spelling == "padded":  # a finite fill, and the first 3 keys dropped for all:
            # rows 0-2 drop every key, and eager averages v there (all scores -1e9)
            drop = (self.bias[:, :, :t, :t] == 0) | (torch.arange(t, device=x.device) < 3)
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            y = F.softmax(att.masked_fill(drop, -1e9), dim=-1) @ v
        elif self.spelling == "gpt-neo":  # where(keep, s, finfo.min) in fp32, no scale, then / c
            keep = self.bias[:, :, :t, :t].bool()
            att = torch.matmul(q.float(), k.float().transpose(-1, -2))
            att = torch.where(keep, att, torch.tensor(torch.finfo(att.dtype).min)) / 2.0
            y = torch.matmul(F.softmax(att, dim=-1).to(v.dtype), v)
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


@pytest.mark.parametrize("spelling", ["nanogpt", "meta", "padded", "gpt-neo"])
def test_hand_written_attention_is_one_kernel(spelling):
    torch.manual_seed(0)
    model = _Model(spelling).eval()
    refs = {t: model(_ids(t)) for t in (1, 7)}
    fast = apply(model, Plan(("attention",)))
    for t, ref in refs.items():
        assert max_violation(fast(_ids(t)), ref, tolerance(torch.float32, model=True)) <= 0
    rows = fast.summary()
    row = next(r for r in rows if r["family"] == "attention")
    assert row["applied"] >= 2 and not row["unfused"], row
    total = next(r for r in rows if r["family"] == "(all)")
    assert total["launches_after"] < total["launches_before"] - 8, total  # ~6 ops a layer each
    # with every family on, the outputs still match
    fast = apply(model, ALL_FUSIONS)
    assert max_violation(fast(_ids(7)), refs[7], tolerance(torch.float32, model=True)) <= 0
