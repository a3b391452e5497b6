"""A hand-written Llama-style decoder: RMSNorm, RoPE (rotate-half), GQA attention, SwiGLU.

Written the way people write it by hand (x * torch.rsqrt(x.pow(2).mean(-1) + eps),
F.silu(g) * u, SDPA with is_causal), to show advisor matches what a graph computes, not
class names. Tiny on the CPU; Llama-3-8B widths with 8 layers on CUDA
(ADVISOR_EXAMPLE_SIZE=tiny|full overrides).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Dims:
    vocab: int
    dim: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    eps: float = 1e-5
    theta: float = 500000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


def dims_for(device: torch.device) -> Dims:
    size = os.environ.get("ADVISOR_EXAMPLE_SIZE", "full" if device.type == "cuda" else "tiny")
    if size == "full":
        return Dims(vocab=128256, dim=4096, hidden=14336, layers=8, heads=32, kv_heads=8)
    return Dims(vocab=256, dim=128, hidden=344, layers=2, heads=4, kv_heads=2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.wq = nn.Linear(d.dim, d.heads * d.head_dim, bias=False)
        self.wk = nn.Linear(d.dim, d.kv_heads * d.head_dim, bias=False)
        self.wv = nn.Linear(d.dim, d.kv_heads * d.head_dim, bias=False)
        self.wo = nn.Linear(d.heads * d.head_dim, d.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache_position: torch.Tensor | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        hd = self.d.head_dim
        q = self.wq(x).view(b, t, self.d.heads, hd).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(b, t, self.d.kv_heads, hd).transpose(1, 2)  # (B, Hkv, T, D)
        v = self.wv(x).view(b, t, self.d.kv_heads, hd).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        mask, causal = None, True
        if kv is not None and cache_position is not None:
            # Static KV cache (B, Hkv, S_max, D): write this step's keys/values in place at
            # cache_position (T,), then attend over the whole cache, masked to the past.
            k_cache, v_cache = kv
            k_cache.index_copy_(2, cache_position, k)
            v_cache.index_copy_(2, cache_position, v)
            k, v = k_cache, v_cache
            slots = torch.arange(k_cache.shape[2], device=x.device)
            mask, causal = slots[None, :] <= cache_position[:, None], False  # (T, S_max)
        rep = self.d.heads // self.d.kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)  # (B, H, T, D)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.w1 = nn.Linear(d.dim, d.hidden, bias=False)  # gate
        self.w3 = nn.Linear(d.dim, d.hidden, bias=False)  # up
        self.w2 = nn.Linear(d.hidden, d.dim, bias=False)  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.attention_norm = RMSNorm(d.dim, d.eps)
        self.attention = Attention(d)
        self.ffn_norm = RMSNorm(d.dim, d.eps)
        self.feed_forward = FeedForward(d)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache_position: torch.Tensor | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, kv, cache_position)
        return h + self.feed_forward(self.ffn_norm(h))


class TinyLlama(nn.Module):
    def __init__(self, d: Dims):
        super().__init__()
        self.d = d
        self.tok_embeddings = nn.Embedding(d.vocab, d.dim)
        self.layers = nn.ModuleList(Block(d) for _ in range(d.layers))
        self.norm = RMSNorm(d.dim, d.eps)
        self.output = nn.Linear(d.dim, d.vocab, bias=False)
        inv_freq = 1.0 / (d.theta ** (torch.arange(0, d.head_dim, 2).float() / d.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, tokens: torch.Tensor, cache: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
                cache_position: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, T); with `cache` (per layer (k, v), each (B, Hkv, S_max, D)) the
        tokens sit at `cache_position` (T,) and the cache is updated in place."""
        t = tokens.shape[1]
        if cache_position is None:
            pos = torch.arange(t, device=tokens.device, dtype=torch.float32)
        else:
            pos = cache_position.to(torch.float32)
        freqs = torch.outer(pos, self.inv_freq)  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        h = self.tok_embeddings(tokens)
        cos, sin = emb.cos().to(h.dtype), emb.sin().to(h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache[i] if cache is not None else None, cache_position)
        return self.output(self.norm(h))


def build_model(device: torch.device, dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    d = dims_for(torch.device(device))
    with torch.device(device):
        model = TinyLlama(d)
        # Non-trivial norm weights so a dropped weight multiply is caught.
        for m in model.modules():
            if isinstance(m, RMSNorm):
                nn.init.uniform_(m.weight, 0.5, 1.5)
    return model.to(dtype=dtype).eval()


def make_inputs(seq_len: int, batch: int, device: torch.device) -> tuple:
    d = dims_for(torch.device(device))
    g = torch.Generator().manual_seed(seq_len * 1000 + batch)
    return (torch.randint(0, d.vocab, (batch, seq_len), generator=g).to(device),)


def make_decode_inputs(context_len: int, batch: int, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> dict:
    """One decode step: a new token per sequence at position `context_len`, and a static KV
    cache (random past keys/values) with room for max(context_len, 256) more steps."""
    d = dims_for(torch.device(device))
    g = torch.Generator().manual_seed(context_len * 7 + batch)
    s_max = context_len + max(context_len, 256)
    shape = (batch, d.kv_heads, s_max, d.head_dim)
    cache = [(torch.randn(shape, generator=g).to(device=device, dtype=dtype),
              torch.randn(shape, generator=g).to(device=device, dtype=dtype)) for _ in range(d.layers)]
    tokens = torch.randint(0, d.vocab, (batch, 1), generator=g).to(device)
    return {"tokens": tokens, "cache": cache,
            "cache_position": torch.tensor([context_len], device=device)}


def next_decode_inputs(inputs: dict, next_ids: torch.Tensor) -> dict:
    """The next decode step (greedy generation): `next_ids` (B, 1) at the next position,
    the same cache (already updated in place by the step before)."""
    return {**inputs, "tokens": next_ids, "cache_position": inputs["cache_position"] + 1}
