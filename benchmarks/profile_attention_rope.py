"""Which kernels attention + RoPE runs, and how long each takes (a prefill of T tokens).

The probe (attention_probe.py) times the whole launch: on an H100 at 2048 tokens ours + RoPE
took 107.7 µs where ours on pre-rotated q, k took 88.0 — 20 µs for a k-only rope launch
(8 MB moved) and q rotated on load. This lists each CUDA kernel of one launch with and
without RoPE (torch.profiler, device time, mean of --reps calls) so the gap has names.

    python benchmarks/profile_attention_rope.py [--tokens 2048] [--reps 20]

Writes profile_attention_rope.json under $OUT (benchmarks/common.write).
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import attention, rope  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

DEVICE = torch.device("cuda")
HEADS = {"batch": 1, "hq": 32, "hkv": 8, "d": 128}  # Llama-3-8B


def kernels(fn, reps: int) -> dict[str, float]:
    """Mean device µs per call of each kernel name `fn` launches."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            total[e.name[:90]] += e.device_time_total / reps
    return dict(sorted(total.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    t = args.tokens
    dims = {**HEADS, "tq": t, "tk": t, "causal": 1, "rope": 1}
    q, k, v, cos, sin, _, _, scale, _, _ = attention.make_inputs(
        dims, torch.bfloat16, DEVICE, torch.Generator().manual_seed(t))
    qr, kr = rope.launch_rope_qk(q, k, cos, sin)
    cases = {
        "ours_rope": lambda: attention.launch_attention(q, k, v, cos, sin, None, True, scale),
        "ours_prerotated": lambda: attention.launch_attention(qr, kr, v, None, None, None, True, scale),
        "rope_k_alone": lambda: rope.launch_rope_k(k, cos, sin),
        "rope_qk": lambda: rope.launch_rope_qk(q, k, cos, sin),
    }
    rows = {name: kernels(fn, args.reps) for name, fn in cases.items()}
    for name, ks in rows.items():
        print(f"{name}: {sum(ks.values()):.1f} us")
        for kname, us in ks.items():
            print(f"   {us:8.1f} us  {kname}")
    print("tables:", tuple(cos.shape), cos.dtype, cos.stride(), "q", tuple(q.shape), q.stride())
    payload = header(DEVICE, dtype="bfloat16", tokens=t, reps=args.reps,
                     timing="torch.profiler device time, mean per call")
    payload["kernels_us"] = rows
    print("wrote", write("profile_attention_rope.json", payload))


if __name__ == "__main__":
    main()
