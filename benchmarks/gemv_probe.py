"""The one-token GEMV path (gemm.py `_gemv_kernel`) at every Llama-3-8B projection.

A decode step (or a one-token prefill) reads every weight once: each projection is a
GEMV bound by W's bytes. For each site below, `bench_kernels.bench_kernel` checks the
kernel against its reference on the GPU and times, in this run, the eager ops (cuBLAS
GEMV + the separate epilogue/prologue ops), torch.compile of them, our default config and
the best of a sweep, with weights rotated past L2; GB/s is reported against the measured
copy bandwidth (issue 6: the decode GEMV path should read weights at >= 85% of it).

    python benchmarks/gemv_probe.py [--tokens 1,4] [--sweep 14] [--configs "A;B"] [--pdl]

--configs times those configs (`;`-separated, each `name=int,...`) instead of a sweep;
--pdl launches our kernels with programmatic dependent launch (back-to-back calls then
overlap one's tail with the next one's start, as in a decode step's CUDA graph).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels._triton import programmatic_launch  # noqa: E402
from advisor.kernels.registry import get  # noqa: E402
from advisor.kernels.space import decode  # noqa: E402
from advisor.profile.ceilings import measure_ceilings  # noqa: E402
from benchmarks.bench_kernels import bench_kernel  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

# site -> (registry kernel, dims beyond M): Llama-3-8B, hidden 4096, 32 q / 8 kv heads of 128
SITES = {
    "o_proj+residual": ("gemm_epilogue", {"K": 4096, "N": 4096, "residual": 1}),
    "down_proj+residual": ("gemm_epilogue", {"K": 14336, "N": 4096, "residual": 1}),
    "k_proj": ("gemm_epilogue", {"K": 4096, "N": 1024}),
    "lm_head": ("gemm_epilogue", {"K": 4096, "N": 128256}),
    "gate_up+swiglu": ("gemm_swiglu", {"K": 4096, "N": 14336}),
    "norm+qkv": ("gemm_rmsnorm", {"K": 4096, "N": 6144}),
    "norm+gate_up": ("gemm_rmsnorm", {"K": 4096, "N": 28672}),  # merged [gate; up], act after
    "norm+lm_head": ("gemm_rmsnorm", {"K": 4096, "N": 128256}),
    "norm+gate_up+swiglu": ("rmsnorm_swiglu", {"K": 4096, "N": 14336}),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1")
    ap.add_argument("--sites", default=",".join(SITES))
    ap.add_argument("--sweep", type=int, default=14)
    ap.add_argument("--configs", default="", help="';'-separated configs to time instead of a sweep")
    ap.add_argument("--pdl", action="store_true", help="launch our kernels with PDL")
    args = ap.parse_args()
    configs = [decode(c) for c in args.configs.split(";") if c] or None
    dev, dtype = torch.device("cuda"), torch.bfloat16
    ceilings = measure_ceilings(dev)
    rows, failures = [], []
    for site in args.sites.split(","):
        name, dims = SITES[site]
        spec = replace(get(name), bench_dims=lambda tokens, dims=dims: {"M": tokens, **dims})
        compiled = torch.compile(spec.unfused_ops(), dynamic=False)
        for t in (int(x) for x in args.tokens.split(",")):
            try:
                with programmatic_launch(args.pdl):
                    row = {"site": site, **bench_kernel(spec, t, dtype, args.sweep, compiled, configs)}
            except Exception as exc:
                failures.append({"site": site, "tokens": t, "error": f"{type(exc).__name__}: {exc}"[:500]})
                print(f"{site:20s} {t} FAILED {failures[-1]['error']}", flush=True)
                continue
            for key in ("eager", "compile", "default", "best"):
                row[f"{key}_frac_of_copy"] = row[f"{key}_gbps"] / ceilings.copy_gbps
            rows.append(row)
            for cfg_text, ms in row.get("config_ms", {}).items():
                print(f"    {ms*1e3:7.1f}us  {cfg_text}", flush=True)
            print(f"{site:20s} M={t}  eager(cuBLAS+ops) {row['eager_ms']*1e3:7.1f}us "
                  f"({100*row['eager_frac_of_copy']:3.0f}%)  compile {row['compile_ms']*1e3:7.1f}us  "
                  f"ours default {row['default_ms']*1e3:7.1f}us  best {row['best_ms']*1e3:7.1f}us "
                  f"({100*row['best_frac_of_copy']:3.0f}% of copy) {row['best_config']}", flush=True)
        torch._dynamo.reset()
    payload = header(dev, dtype="bfloat16", tokens=args.tokens, sweep=args.sweep, pdl=args.pdl,
                     configs=args.configs,
                     timing="do_bench_cudagraph median, weights rotated past L2")
    payload.update(ceilings={"copy_gbps": ceilings.copy_gbps}, rows=rows, failures=failures)
    print("wrote", write("gemv-probe.json", payload))


if __name__ == "__main__":
    main()
