"""Where a decode step's time goes: kernels per step for advisor's plan and reduce-overhead.

Greedy generation (the loop `advisor bench --phase decode --generate` times) runs under
torch.profiler for each variant; kernels are grouped by name and reported per step (count,
µs), with the wall time per step, so a gap between variants can be pinned on kernels
(GPU-bound) or on the host (wall > GPU time).

    python benchmarks/profile_decode.py --plan recipes/all-fusions-cudagraph.plan.json \
        --contexts 512,2048 --steps 16 --json profile-decode.json   # written under $OUT
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.generate import advancer, greedy  # noqa: E402
from advisor.loader import inputs_for  # noqa: E402
from advisor.runtime.apply import apply  # noqa: E402
from advisor.runtime.recipe import load_recipe  # noqa: E402
from advisor.state import Snapshot  # noqa: E402
from benchmarks.common import header, model_on, write  # noqa: E402


def kernel_table(prof: Any, steps: int, top: int = 25) -> tuple[list[dict[str, Any]], float, float]:
    """Device kernels grouped by name: count and µs per step, largest first; and over all
    kernels, µs per step and kernels per step."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time_total > 0:
            a = agg[e.name]
            a[0] += 1
            a[1] += e.device_time_total
    rows = [{"kernel": k[:120], "per_step": n / steps, "us_per_step": us / steps}
            for k, (n, us) in agg.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top], sum(r["us_per_step"] for r in rows), sum(r["per_step"] for r in rows)


def record(out: dict[str, Any], where: dict[str, int], name: str, r: dict[str, Any], top: int) -> None:
    """Append one variant's result at one length to `out["results"]` and print it with its
    `top` heaviest kernels."""
    out["results"].append({**where, "variant": name, **r})
    print(*where.values(), name, {k: v for k, v in r.items() if k != "top_kernels"}, flush=True)
    for row in r.get("top_kernels", [])[:top]:
        print(f"    {row['us_per_step']:8.1f} us  x{row['per_step']:5.1f}  {row['kernel'][:90]}", flush=True)


def failed(exc: Exception) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def profile_variant(model: Any, x: Any, state: Snapshot, steps: int, advance: Any,
                    on_step: Any) -> dict[str, Any]:
    with torch.no_grad():
        for _ in range(2):  # compile / capture every route first
            greedy(model, x, steps, advance, on_step=on_step)
            state.restore()
        _sync()
        t0 = time.perf_counter()
        greedy(model, x, steps, advance, on_step=on_step)
        _sync()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        state.restore()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                torch.profiler.ProfilerActivity.CPU]) as prof:
            greedy(model, x, steps, advance, on_step=on_step)
            _sync()
        state.restore()
    kernels, gpu_us, launches = kernel_table(prof, steps)
    return {"wall_ms_per_step": wall_ms, "gpu_us_per_step": gpu_us, "kernels_per_step": launches,
            "top_kernels": kernels}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="examples/llama_hf.py")
    p.add_argument("--plan", action="append", required=True, help="plan/recipe JSON (repeatable)")
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--device", default="cuda")
    p.add_argument("--reduce-overhead", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--json", default="profile-decode.json", help="file name under $OUT")
    a = p.parse_args()
    mf, model, dev, dtype = model_on(a.model, a.device)
    contexts = [int(c) for c in a.contexts.split(",")]
    context = {"len": 0}
    out: dict[str, Any] = {**header(dev, contexts=a.contexts, steps=a.steps), "model": a.model, "dtype": str(dtype), "steps": a.steps,
                           "contexts": contexts, "results": []}
    variants: list[tuple[str, Any]] = [
        (f"advisor[{Path(plan).name}]", apply(model, load_recipe(plan), length_of=lambda *_: context["len"]))
        for plan in a.plan]
    if a.reduce_overhead:
        variants.append(("torch.compile[reduce-overhead]", torch.compile(model, mode="reduce-overhead")))
    for t in contexts:
        x = inputs_for(mf, t, 1, dev, phase="decode", dtype=dtype)
        state, advance = Snapshot(x), advancer(mf, x)

        def on_step(i: int, t: int = t) -> None:
            context["len"] = t + i

        for name, fn in variants:
            try:
                r = profile_variant(fn, x, state, a.steps, advance, on_step)
            except Exception as exc:
                state.restore()
                r = failed(exc)
            record(out, {"context": t}, name, r, 12)
        write(a.json, out)


if __name__ == "__main__":
    main()
