"""Where does prefill attention+RoPE lose to SDPA? One question, four timings per length.

At Llama-3-8B shapes (32 q / 8 kv heads, head dim 128, causal, bf16), for each length:
  sdpa          F.scaled_dot_product_attention (best backend, enable_gqa) on rotated q, k
  ours_norope   our kernel on rotated q, k (no RoPE inside)
  ours_rope     our kernel with RoPE on load (q and every k tile)
  rope_then_ours  rope_qk (one launch) then ours_norope: K rotated once
Device time from CUDA-graph replays (triton.testing.do_bench_cudagraph, median).
Prints one line per length and writes attention_probe.json under $OUT (or the cwd).

    python benchmarks/attention_probe.py [--tokens 512,2048,8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention, rope  # noqa: E402
from benchmarks.common import header, write  # noqa: E402


def probe(tokens: int) -> dict:
    dims = {"batch": 1, "hq": 32, "hkv": 8, "d": 128, "tq": tokens, "tk": tokens, "causal": 1, "rope": 1}
    q, k, v, cos, sin, _, _, scale, _ = attention.make_inputs(
        dims, torch.bfloat16, torch.device("cuda"), torch.Generator().manual_seed(tokens))
    qr, kr = rope.launch_rope_qk(q, k, cos, sin)
    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(qr, kr, v, is_causal=True, scale=scale,
                                                       enable_gqa=True),
        "ours_norope": lambda: attention.launch_attention(qr, kr, v, None, None, None, True, scale),
        "ours_rope": lambda: attention.launch_attention(q, k, v, cos, sin, None, True, scale),
        "rope_then_ours": lambda: attention.launch_attention(
            *rope.launch_rope_qk(q, k, cos, sin), v, None, None, None, True, scale),
    }
    want = attention.reference(q, k, v, cos, sin, causal=True, scale=scale)
    row = {"tokens": tokens, "flops": attention.flops(q, k, causal=True)}
    for name, fn in calls.items():
        err = (fn().float() - want.float()).abs().max().item()
        ms = float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
        row[name] = {"us": ms * 1e3, "tflops": row["flops"] / (ms * 1e-3) / 1e12, "max_error": err}
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048,8192")
    args = ap.parse_args()
    rows = []
    for t in (int(x) for x in args.tokens.split(",")):
        row = probe(t)
        rows.append(row)
        print(f"{t:5d} tok " + "  ".join(f"{n} {row[n]['us']:8.1f}us {row[n]['tflops']:4.0f}TF/s"
                                         for n in ("sdpa", "ours_norope", "ours_rope", "rope_then_ours")),
              flush=True)
    payload = header(torch.device("cuda"), dtype="bfloat16", timing="do_bench_cudagraph median")
    payload["rows"] = rows
    print("wrote", write("attention_probe.json", payload))


if __name__ == "__main__":
    main()
