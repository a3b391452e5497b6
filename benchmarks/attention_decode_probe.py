"""Decode attention against a static KV cache: where the unwritten slots cost.

A `transformers` StaticCache holds max_cache_len slots; a decode step attends over all of
them with an additive mask that is -inf past the current position (in our decode
benchmark the cache holds 2x the context, so half the keys are dead). Skipping the dead
keys by reading the mask was tried twice and lost on the H200 (a per-block skip inside
the key loop stops Triton's pipelining; a per-split live-range pass costs a dependent mask
read: +3.7 µs per layer, NOTES sessions 6–7). Given the position instead (`q_pos`, what
the runtime passes when the mask is the static cache's causal one), the splits share out
the live keys only. This probe times, per context, one layer's decode attention
(Llama-3-8B: 32 q / 8 kv heads, D = 128, batch 1, bf16): SDPA over the whole cache with
the mask (GQA without repeat_kv, as reduce-overhead runs it at best), ours over the whole
cache with the mask per config, ours with the position instead of the mask, and ours over
the live slots only (no mask). Output checked against the reference each time.

    python benchmarks/attention_decode_probe.py --contexts 512,2048   # JSON under $OUT
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention as attn  # noqa: E402
from advisor.kernels.space import encode  # noqa: E402
from advisor.kernels.testing import max_violation, tolerance  # noqa: E402
from benchmarks.bench_kernels import _ms  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

CONFIGS = [{"BLOCK_M": 16, "BLOCK_N": bn, "num_warps": 4, "num_stages": st, "SPLITS": sp}
           for bn in (64, 128) for sp in (8, 16, 32) for st in (1, 2)]


def probe(ctx: int, dev: torch.device, dtype: torch.dtype, gen: torch.Generator) -> dict:
    slots = 2 * ctx
    q = torch.randn(1, 32, 1, 128, device=dev, generator=gen).to(dtype)
    k = torch.randn(1, 8, slots, 128, device=dev, generator=gen).to(dtype)
    v = torch.randn(1, 8, slots, 128, device=dev, generator=gen).to(dtype)
    mask = torch.full((1, 1, 1, slots), float("-inf"), device=dev)
    mask[..., : ctx + 1] = 0.0
    ref = attn.reference(q, k, v, mask=mask)
    live_k, live_v = k[:, :, : ctx + 1], v[:, :, : ctx + 1]
    row = {"context": ctx, "slots": slots, "kv_bytes_live": 2 * live_k.numel() * 2,
           "sdpa_ms": _ms(lambda: F.scaled_dot_product_attention(
               q, k, v, attn_mask=mask.to(dtype), enable_gqa=True)),
           "default_config": attn.SPACE.resolve(None, attn.problem(q, k, v, mask=mask)),
           "ours_ms": {}, "ours_pos_ms": {}, "ours_live_only_ms": {}}
    pos = torch.tensor([ctx], device=dev)
    prob = attn.problem(q, k, v, mask=mask)
    for cfg in [None, *CONFIGS]:
        if cfg is not None and not attn.SPACE.keep(cfg, prob):  # would run the default
            continue
        name = "default" if cfg is None else encode(cfg)
        for key, m, p in (("ours_ms", mask, None), ("ours_pos_ms", None, pos)):
            out = attn.launch_attention(q, k, v, None, None, m, False, None, False, p, config=cfg)
            if max_violation(out.float(), ref.float(), tolerance(dtype)) > 0:
                row[key][name] = "MISMATCH"
                continue
            row[key][name] = _ms(lambda cfg=cfg, m=m, p=p: attn.launch_attention(
                q, k, v, None, None, m, False, None, False, p, config=cfg))
        row["ours_live_only_ms"][name] = _ms(lambda cfg=cfg: attn.launch_attention(
            q, live_k, live_v, None, None, None, False, None, False, config=cfg))
    best = min((t, n) for n, t in row["ours_ms"].items() if isinstance(t, float))
    row["best"] = {"config": best[1], "ms": best[0]}
    print(f"ctx {ctx}: sdpa {row['sdpa_ms'] * 1e3:.1f} us, ours default "
          f"{row['ours_ms']['default'] * 1e3:.1f} us, best {best[0] * 1e3:.1f} us ({best[1]}), "
          f"position default {row['ours_pos_ms']['default'] * 1e3:.1f} us, "
          f"live-only default {row['ours_live_only_ms']['default'] * 1e3:.1f} us", flush=True)
    pos_best = min((t, n) for n, t in row["ours_pos_ms"].items() if isinstance(t, float))
    row["best_pos"] = {"config": pos_best[1], "ms": pos_best[0]}
    print(f"ctx {ctx}: position best {pos_best[0] * 1e3:.1f} us ({pos_best[1]})", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--contexts", default="512,2048")
    args = ap.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = [probe(int(c), dev, dtype, gen) for c in args.contexts.split(",")]
    path = write("attention-decode-probe.json", {**header(dev, contexts=args.contexts, dtype=str(dtype)),
                                                 "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
