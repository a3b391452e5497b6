"""Attention written out (transformers' eager form, which Gemma 2 must run: SDPA has no
softcap) against our kernel, which `find_fusable` now puts in its place (session 28).

Shapes (batch 1, bf16, a materialised causal mask as transformers passes it):
  gemma2   Gemma-2-9B: 16 q / 8 kv heads, head dim 256, scale 256^-0.5, softcap 50
  llama    Llama-3-8B with attn_implementation="eager": 32 / 8 heads, head dim 128
Variants: `eager` (repeat_kv, matmul, scale, [cap], + mask, softmax in fp32, cast, matmul),
`compiled` (torch.compile of the same function, default mode), `ours_mask` (the kernel
reading the mask), `ours_causal` (the kernel told causal: what runs once the model's mask is
memoised and marked causal). Each checked against `attention.reference` in fp32 (rel error
beside eager's own); device time from triton.testing.do_bench (median, L2 flushed).

    python benchmarks/explicit_attention_probe.py [--tokens 512,2048]   # JSON under $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention  # noqa: E402
from advisor.kernels.testing import rel_error  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

SHAPES = {"gemma2": dict(hq=16, hkv=8, d=256, softcap=50.0),
          "llama": dict(hq=32, hkv=8, d=128, softcap=0.0)}


def eager(q, k, v, mask, scale: float, softcap: float):
    """transformers' eager_attention_forward (Gemma 2's with softcap)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
    s = torch.matmul(q, k.transpose(2, 3)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s + mask
    p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(p, v)


def row(name: str, t: int) -> dict:
    dims, dev = SHAPES[name], torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(t)
    q, k, v = (torch.randn(1, t, h, dims["d"], device=dev, generator=gen, dtype=torch.bfloat16)
               .transpose(1, 2) for h in (dims["hq"], dims["hkv"], dims["hkv"]))
    q = q * 4  # scores of tens: Gemma's cap at 50 bends the largest
    mask = torch.zeros(1, 1, t, t, device=dev, dtype=torch.bfloat16).masked_fill(
        torch.ones(t, t, dtype=torch.bool, device=dev).triu(1), torch.finfo(torch.bfloat16).min)
    scale, cap = dims["d"] ** -0.5, dims["softcap"]
    compiled = torch.compile(eager)
    runs = {
        "eager": lambda: eager(q, k, v, mask, scale, cap),
        "compiled": lambda: compiled(q, k, v, mask, scale, cap),
        "ours_mask": lambda: attention.launch_attention(q, k, v, None, None, mask, False, scale,
                                                        softcap=cap),
        "ours_causal": lambda: attention.launch_attention(q, k, v, None, None, None, True, scale,
                                                          softcap=cap),
    }
    truth = attention.reference(q.float(), k.float(), v.float(), causal=True, scale=scale, softcap=cap)
    out = {"shape": name, "tokens": t, **dims, "scale": scale}
    for key, fn in runs.items():
        try:
            got = fn()
            out[f"{key}_rel_err"] = rel_error(got.float(), truth)
            out[f"{key}_ms"] = do_bench(fn, warmup=25, rep=100, return_mode="median")
        except Exception as exc:  # one variant's failure is a result
            out[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if "eager_ms" in out:
        for key in ("compiled", "ours_mask", "ours_causal"):
            if f"{key}_ms" in out:
                out[f"{key}_speedup"] = out["eager_ms"] / out[f"{key}_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048")
    args = ap.parse_args()
    tokens = [int(x) for x in args.tokens.split(",")]
    rows = []
    for name in SHAPES:
        for t in tokens:
            rows.append(row(name, t))
            print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()}, flush=True)
    payload = header(torch.device("cuda"), dtype="bfloat16", batch=1, tokens=tokens, mask="causal, materialised")
    payload["rows"] = rows
    write("explicit-attention-probe.json", payload)


if __name__ == "__main__":
    main()
