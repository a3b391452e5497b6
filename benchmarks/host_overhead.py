"""Host time of one forward of a recipe-applied model, against what `advisor bench` reports.

`bench` times a forward with triton's do_bench: the L2 flush, a start event, the forward,
an end event. Host work before the forward's first kernel (dynamo's guards, transformers'
Python around the compiled region, the CUDA-graph lookup and input copies) shows up in
that window whenever it outlasts the flush; a loop of forwards hides it behind the
previous call's GPU work. Per length this prints and records:

    bench_ms      do_bench median (what `advisor bench` reports)
    pipelined_ms  wall time per call of CALLS calls back to back, one sync at the end
    host_ms       median host time of one call after a sync (no sync after: enqueue only)
    profile       cProfile of CALLS unsynchronised calls: the top functions by own time

    python benchmarks/host_overhead.py --recipe recipes/llama_hf-h100.json --tokens 1,128,512 \
        [--compile-tokens 512] [--json host-overhead.json]   # written under $OUT
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.loader import build, call, inputs_for, load_model_file  # noqa: E402
from advisor.runtime.apply import apply  # noqa: E402
from advisor.runtime.recipe import load_recipe  # noqa: E402
from advisor.timing import median_ms  # noqa: E402
from benchmarks.common import header, write  # noqa: E402


def measure(fn: Any, x: Any, calls: int, dev: torch.device) -> dict[str, Any]:
    with torch.no_grad():
        for _ in range(3):  # trace, capture, settle
            call(fn, x)
        torch.cuda.synchronize()
        bench = median_ms(lambda: call(fn, x), dev)
        t0 = time.perf_counter()
        for _ in range(calls):
            call(fn, x)
        torch.cuda.synchronize()
        pipelined = (time.perf_counter() - t0) * 1e3 / calls
        host = []
        for _ in range(calls):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            call(fn, x)
            host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            call(fn, x)
        prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    return {"bench_ms": bench, "pipelined_ms": pipelined, "host_ms": statistics.median(host),
            "host_ms_min": min(host), "profile": text.getvalue()[-6000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="examples/llama_hf.py")
    p.add_argument("--recipe", required=True)
    p.add_argument("--tokens", default="1,128,512")
    p.add_argument("--compile-tokens", default="", help="lengths to measure reduce-overhead at too")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--json", default="host-overhead.json", help="file name under $OUT")
    a = p.parse_args()
    dev, dtype = torch.device("cuda"), torch.bfloat16
    mf = load_model_file(a.model)
    model = build(mf, dev, dtype)
    out: dict[str, Any] = {**header(dev, tokens=a.tokens, calls=a.calls, recipe=a.recipe),
                           "model": a.model, "dtype": str(dtype), "results": []}
    ours = apply(model, load_recipe(a.recipe))
    compiled = torch.compile(model, mode="reduce-overhead") if a.compile_tokens else None
    for t in [int(v) for v in a.tokens.split(",")]:
        x = inputs_for(mf, t, 1, dev, dtype=dtype)
        variants = [("advisor", ours)]
        if compiled is not None and str(t) in a.compile_tokens.split(","):
            variants.append(("torch.compile[reduce-overhead]", compiled))
        for name, fn in variants:
            r = measure(fn, x, a.calls, dev)
            print(f"{t:5d} {name:32s} bench {r['bench_ms']:.3f} ms  pipelined {r['pipelined_ms']:.3f}"
                  f"  host {r['host_ms']:.3f} (min {r['host_ms_min']:.3f})", flush=True)
            print(r["profile"], flush=True)
            out["results"].append({"tokens": t, "variant": name, **r})
            write(a.json, out)


if __name__ == "__main__":
    main()
