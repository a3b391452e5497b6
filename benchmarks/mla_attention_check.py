"""Attention with v's head dim != q's and k's (multi-head latent attention, DeepSeek-V3's
non-absorbed form: 128 heads of D 192, Dv 128; here 16 heads, batch 1, bf16) on the GPU:
ours against SDPA (its best backend for these dims) and the fp32 reference, prefill
(causal, Tq = Tk) and decode (one query over the keys, split), default configs.

    python benchmarks/mla_attention_check.py [--tokens 512,2048]   # JSON under $OUT
    # and other prefill configs (BLOCK_M x BLOCK_N, warps, stages, TMA) beside the default:
    python benchmarks/mla_attention_check.py --tokens 2048 --configs 64x64w4s3,128x64w8s2
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention as attn  # noqa: E402
from advisor.kernels.testing import max_violation, tolerance  # noqa: E402
from benchmarks.bench_kernels import _ms  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

HEADS, D, DV = 16, 192, 128


def parse_config(text: str) -> dict:
    """'128x64w8s2' (BLOCK_M x BLOCK_N, warps, stages; a trailing 't' for TMA loads)."""
    m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(t?)", text)
    if not m:
        raise SystemExit(f"config {text!r}: expected e.g. 128x64w8s2 or 128x128w8s1t")
    bm, bn, w, s, tma = m.groups()
    return {"BLOCK_M": int(bm), "BLOCK_N": int(bn), "num_warps": int(w), "num_stages": int(s),
            "SPLITS": 1, "TMA": int(bool(tma))}


def check(tq: int, tk: int, dev: torch.device, gen: torch.Generator,
          configs: list[dict] = ()) -> dict:
    q, k = (torch.randn(1, HEADS, t, D, device=dev, generator=gen).bfloat16() for t in (tq, tk))
    v = torch.randn(1, HEADS, tk, DV, device=dev, generator=gen).bfloat16()
    causal = tq == tk
    ref = attn.reference(q.float(), k.float(), v.float(), causal=causal).bfloat16()
    ours = attn.launch_attention(q, k, v, causal=causal)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    tol = tolerance(torch.bfloat16)
    others = []
    for cfg in configs:  # each timed and checked as the default is; keep's verdict beside
        out = attn.launch_attention(q, k, v, causal=causal, config=cfg)
        # a config keep refuses runs the default (SPACE.resolve): "ran" says which ran
        others.append({"config": cfg, "ran": attn.SPACE.resolve(cfg, attn.problem(q, k, v, causal=causal)),
                       "ok": max_violation(out, ref, tol) <= 0,
                       "ms": _ms(lambda c=cfg: attn.launch_attention(q, k, v, causal=causal, config=c))})
    return {"others": others, "tq": tq, "tk": tk, "causal": causal,
            "config": attn.SPACE.resolve(None, attn.problem(q, k, v, causal=causal)),
            "ours_ok": max_violation(ours, ref, tol) <= 0, "sdpa_ok": max_violation(sdpa, ref, tol) <= 0,
            "ours_max_err": (ours.float() - ref.float()).abs().max().item(),
            "ours_ms": _ms(lambda: attn.launch_attention(q, k, v, causal=causal)),
            "sdpa_ms": _ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--configs", default="", help="prefill configs to time, e.g. 64x64w4s3,128x64w8s2")
    args = parser.parse_args()
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    dev = torch.device("cuda")
    gen = torch.Generator(dev).manual_seed(0)
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        for tq in (t, 1):
            rows.append(check(tq, t, dev, gen, configs if tq == t else ()))
            print({k: v for k, v in rows[-1].items() if k != "config"}, flush=True)
    payload = header(dev, dtype="bfloat16", shapes=f"batch 1, {HEADS} heads, D {D}, Dv {DV}")
    payload["rows"] = rows
    print(write("mla-attention-check.json", payload))


if __name__ == "__main__":
    main()
