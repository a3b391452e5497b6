"""Attention with `q_pos` on the GPU: prefill tiles (alone and with causal) and decode
splits, Llama-3-8B heads (32 q / 8 kv, D = 128), bf16, against `attention.reference`.
Session 10 run G on the H200: all four shapes within the bf16 tolerance.

    python benchmarks/check_attention_positions.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention as attn  # noqa: E402
from advisor.kernels.testing import max_violation, tolerance  # noqa: E402

# (batch, Hq, Hkv, Tq, Tk, causal): prefill, long causal prefill, batch-2 decode, 4-token decode
SHAPES = ((2, 32, 8, 300, 700, False), (1, 32, 8, 2048, 2048, True), (2, 32, 8, 1, 4096, False),
          (1, 32, 8, 4, 1024, False))


def main() -> None:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    for b, hq, hkv, tq, tk, causal in SHAPES:
        q = torch.randn(b, hq, tq, 128, device=dev, generator=g).bfloat16()
        k = torch.randn(b, hkv, tk, 128, device=dev, generator=g).bfloat16()
        v = torch.randn(b, hkv, tk, 128, device=dev, generator=g).bfloat16()
        # batch rows at different positions; the cache past them is dead
        start = torch.tensor([[tk // 2], [tk // 3]], device=dev)[:b]
        pos = (torch.arange(tq, device=dev)[None] + start).clamp(max=tk - 1)  # (B, Tq)
        out = attn.launch_attention(q, k, v, None, None, None, causal, None, False, pos)
        ref = attn.reference(q, k, v, causal=causal, q_pos=pos)
        excess = max_violation(out.float(), ref.float(), tolerance(torch.bfloat16))
        print(b, tq, tk, causal, "tolerance excess", excess,
              "max err", (out.float() - ref.float()).abs().max().item(), flush=True)
        assert excess <= 0
    print("positions on the GPU: ok")


if __name__ == "__main__":
    main()
