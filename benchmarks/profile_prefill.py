"""Where a prefill forward's time goes: kernels per forward for advisor's recipe and for
torch.compile (reduce-overhead), at each length, in one run.

Each variant is warmed (compiles, captures), timed by wall clock over `--calls` forwards
(synchronised), then run `--calls` times under torch.profiler; device kernels are grouped
by name (count and µs per forward, largest first), so a gap between variants can be put on
kernels (GPU-bound) or on the host (wall > GPU time).

    python benchmarks/profile_prefill.py --recipe recipes/llama_hf-h200.json \
        --tokens 128,512,2048 --json profile-prefill.json   # written under $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.loader import build, call, inputs_for, load_model_file  # noqa: E402
from advisor.runtime.apply import apply  # noqa: E402
from advisor.runtime.recipe import load_recipe  # noqa: E402
from benchmarks.common import header, write  # noqa: E402
from benchmarks.profile_decode import failed, kernel_table, record  # noqa: E402


def profile_variant(model: Any, x: Any, calls: int) -> dict[str, Any]:
    with torch.no_grad():
        for _ in range(3):  # compile, capture, settle
            call(model, x)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            call(model, x)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3 / calls
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(calls):
                call(model, x)
            torch.cuda.synchronize()
    kernels, gpu_us, launches = kernel_table(prof, calls, top=40)
    return {"wall_ms": wall_ms, "gpu_us": gpu_us, "kernels": launches, "top_kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="examples/llama_hf.py")
    p.add_argument("--recipe", required=True)
    p.add_argument("--tokens", default="128,512,2048")
    p.add_argument("--calls", type=int, default=10)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                   help="also torch.compile reduce-overhead")
    p.add_argument("--compile-first", action="store_true",
                   help="profile torch.compile before advisor at each length (order effects: clocks, L2)")
    p.add_argument("--json", default="profile-prefill.json", help="file name under $OUT")
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    mf = load_model_file(a.model)
    model = build(mf, dev, dtype)
    tokens = [int(t) for t in a.tokens.split(",")]
    out: dict[str, Any] = {**header(dev, tokens=a.tokens, calls=a.calls, recipe=a.recipe),
                           "model": a.model, "dtype": str(dtype), "results": []}
    variants: list[tuple[str, Any]] = [(f"advisor[{Path(a.recipe).name}]", apply(model, load_recipe(a.recipe)))]
    if a.compile:
        variants.append(("torch.compile[reduce-overhead]", torch.compile(model, mode="reduce-overhead")))
    if a.compile_first:
        variants.reverse()
    for t in tokens:
        x = inputs_for(mf, t, 1, dev, dtype=dtype)
        for name, fn in variants:
            try:
                r = profile_variant(fn, x, a.calls)
            except Exception as exc:  # noqa: BLE001 (one variant's failure must not end the run)
                r = failed(exc)
            record(out, {"tokens": t}, name, r, 14)
            write(a.json, out)


if __name__ == "__main__":
    main()
