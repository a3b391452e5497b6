"""One GPU session, one process: the measurements behind issues 2, 3 and 4.

Stages (each writes its JSON under $OUT as soon as it is done, so a time-out keeps what
finished; a failing stage is recorded and the next one runs):
  analysis.json  advisor analyze on the 8-layer Llama-3-8B-shaped transformers model at
                 1 and 2048 tokens: budget categories vs plain wall time, verdicts.
  apply.json     "all fusions" plan applied (eager runtime and CUDA graphs) at 1, 128,
                 512, 2048 tokens vs eager and torch.compile (default, reduce-overhead),
                 measured in this run: latency, kernels per forward, errors vs eager.
  kernels.json   every registered kernel vs eager and torch.compile of its reference.

    python benchmarks/gpu_session.py [--stages analysis,apply,kernels] [--deadline 560]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.analyze import Analysis, analyze_shape, to_json  # noqa: E402
from advisor.bench import fp32_truth  # noqa: E402
from advisor.env import environment  # noqa: E402
from advisor.kernels.testing import max_abs_error, rel_error  # noqa: E402
from advisor.loader import build, call, first_tensor, inputs_for, load_model_file  # noqa: E402
from advisor.profile import measure_ceilings  # noqa: E402
from advisor.runtime.apply import apply  # noqa: E402
from advisor.runtime.recipe import load_recipe  # noqa: E402
from advisor.timing import kernels_per_call, median_ms, timed_call  # noqa: E402
from benchmarks.bench_kernels import ADAPTERS  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

T0 = time.time()
MODEL = "examples/llama_hf.py"


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def stage_analysis(mf, model, dev, ceilings, out: dict) -> None:
    shapes = []
    for t in (1, 2048):
        s = analyze_shape(mf, model, t, 1, dev, torch.bfloat16, ceilings, iters=5)
        b = s.budget
        log(f"analyze {t}: wall {b.wall_ms:.3f} (plain {b.plain_wall_ms:.3f}) {b.categories} -> {s.verdict}")
        shapes.append(s)
    a = Analysis(MODEL, str(dev), "bfloat16", 1, environment(dev), ceilings, tuple(shapes))
    out.update(to_json(a))
    out["checks"] = [{"seq_len": s.seq_len, "sum_categories_ms": sum(s.budget.categories.values()),
                      "plain_wall_ms": s.budget.plain_wall_ms,
                      "profiled_wall_ms": s.budget.profiled_wall_ms,
                      "sum_vs_plain": sum(s.budget.categories.values()) / s.budget.plain_wall_ms,
                      "verdict": s.verdict} for s in shapes]


PLANS = ("recipes/all-fusions.plan.json", "recipes/all-fusions-cudagraph.plan.json",
         "recipes/deep-fusions-cudagraph.plan.json")


def stage_apply(mf, model, dev, out: dict, lengths=(1, 128, 512, 2048),
                compile_modes: tuple[str, ...] = ("default", "reduce-overhead"),
                plans: tuple[str, ...] = PLANS) -> None:
    inputs = {t: inputs_for(mf, t, 1, dev) for t in lengths}
    with torch.no_grad():
        refs = {t: first_tensor(call(model, inputs[t])) for t in lengths}
    exact = fp32_truth(mf, model, lengths, 1, dev, "prefill")  # is eager or fused nearer fp32?
    out["eager_rel_error_vs_fp32"] = {t: rel_error(refs[t].float(), exact[t]) for t in lengths}
    rows = out.setdefault("rows", [])

    def measure(name, fn, t, first_s):
        row = {"shape": t, "variant": name, "ms": median_ms(fn, dev), "first_call_s": first_s,
               "kernels": kernels_per_call(fn, dev)}
        rows.append(row)
        log(f"{name:28s} {t:5d}: {row['ms']:.3f} ms, {row['kernels']} kernels")
        return row

    with torch.no_grad():
        for t in lengths:
            measure("eager", lambda t=t: call(model, inputs[t]), t, 0.0)
        for plan in plans:
            fast = apply(model, load_recipe(plan))
            name = "advisor:" + Path(plan).name.replace(".plan.json", "")
            for t in lengths:
                o, first = timed_call(lambda t=t, f=fast: call(f, inputs[t]), dev)
                row = measure(name, lambda t=t, f=fast: call(f, inputs[t]), t, round(first, 2))
                got = first_tensor(o)
                row.update(max_error=max_abs_error(got, refs[t]), rel_error=rel_error(got, refs[t]),
                           rel_error_vs_fp32=rel_error(got.float(), exact[t]))
                log(f"   errors vs eager: max {row['max_error']:.3g} rel {row['rel_error']:.3g}")
            out.setdefault("applied", {})[name] = fast.summary()
            write("apply.json", out)
        for mode in compile_modes:
            torch._dynamo.reset()
            comp = torch.compile(model, mode=None if mode == "default" else mode)
            for t in lengths:
                _, first = timed_call(lambda t=t, c=comp: call(c, inputs[t]), dev)
                measure(f"torch.compile[{mode}]", lambda t=t, c=comp: call(c, inputs[t]), t, round(first, 2))
            write("apply.json", out)
        torch._dynamo.reset()
    eager = {r["shape"]: r["ms"] for r in rows if r["variant"] == "eager"}
    for r in rows:
        r["speedup_vs_eager"] = eager[r["shape"]] / r["ms"]


def stage_kernels(dev, ceilings, out: dict, tokens=(1, 128, 512, 2048, 8192), names=(),
                  deadline: float = float("inf"), sweep: int = 6) -> None:
    """names: kernels in the order to run (default: every registered one); a kernel not
    started before `deadline` (seconds since start) is listed under `skipped`."""
    from advisor.kernels.registry import all_kernels
    from benchmarks.bench_kernels import bench_kernel

    rows, failures = out.setdefault("rows", []), out.setdefault("failures", [])
    specs = all_kernels()
    for name in names or [n for n in specs if n not in ADAPTERS]:
        spec = specs[name]
        if time.time() - T0 > deadline:
            out.setdefault("skipped", []).append(name)
            continue
        compiled = torch.compile(spec.unfused_ops(), dynamic=False)
        for t in tokens:
            try:
                row = bench_kernel(spec, t, torch.bfloat16, sweep, compiled)
                row["frac_of_copy_bw"] = row["best_gbps"] / ceilings.copy_gbps
                if "best_tflops" in row:
                    row["frac_of_matmul"] = row["best_tflops"] / ceilings.matmul_tflops["bfloat16"]
                rows.append(row)
                log(f"{name:16s} {t:5d}: eager {row['eager_ms']*1e3:7.1f}us compile {row['compile_ms']*1e3:7.1f}us "
                    f"ours {row['best_ms']*1e3:7.1f}us {row['best_gbps']:5.0f} GB/s ({100*row['frac_of_copy_bw']:.0f}% copy)"
                    + (f" {row['best_tflops']:.0f} TFLOP/s ({100 * row['frac_of_matmul']:.0f}% mm)"
                       if "best_tflops" in row else ""))
            except Exception as exc:
                failures.append({"kernel": name, "tokens": t, "error": f"{type(exc).__name__}: {exc}"[:400]})
                log(f"{name} {t} FAILED {failures[-1]['error']}")
        torch._dynamo.reset()
        write("kernels.json", out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", default="analysis,apply,kernels")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds; later stages are skipped")
    ap.add_argument("--compile", default="default,reduce-overhead", help="torch.compile modes in apply")
    ap.add_argument("--kernel-tokens", default="1,128,512,2048,8192")
    ap.add_argument("--kernels", default="", help="kernels to bench, in order (default: all)")
    ap.add_argument("--sweep", type=int, default=6, help="configs timed per kernel and shape")
    ap.add_argument("--plans", default=",".join(PLANS), help="plan files for the apply stage")
    args = ap.parse_args()
    dev = torch.device("cuda")
    ceilings = measure_ceilings(dev)
    log(f"ceilings: copy {ceilings.copy_gbps:.0f} GB/s, bf16 {ceilings.matmul_tflops.get('bfloat16', 0):.0f} "
        f"TFLOP/s, launch {ceilings.launch_us:.2f} us, graph {ceilings.graph_launch_us}")
    os.environ.setdefault("ADVISOR_EXAMPLE_SIZE", "full")
    mf = load_model_file(MODEL)
    stages = args.stages.split(",")
    model = build(mf, dev, torch.bfloat16) if {"analysis", "apply"} & set(stages) else None
    base = header(dev, model=MODEL, dtype="bfloat16", batch=1, timing="do_bench median (CUDA events, L2 flush)")
    base["ceilings"] = {"copy_gbps": ceilings.copy_gbps, "matmul_tflops": ceilings.matmul_tflops,
                        "launch_us": ceilings.launch_us, "graph_launch_us": ceilings.graph_launch_us}
    for stage in stages:
        if time.time() - T0 > args.deadline:
            log(f"skipping {stage}: past the deadline")
            continue
        out = dict(base)
        try:
            if stage == "analysis":
                stage_analysis(mf, model, dev, ceilings, out)
            elif stage == "apply":
                stage_apply(mf, model, dev, out,
                            compile_modes=tuple(m for m in args.compile.split(",") if m),
                            plans=tuple(p for p in args.plans.split(",") if p))
            elif stage == "kernels":
                stage_kernels(dev, ceilings, out, tuple(int(t) for t in args.kernel_tokens.split(",")),
                              tuple(k for k in args.kernels.split(",") if k), args.deadline, args.sweep)
        except Exception as exc:
            out["error"] = traceback.format_exc()[-3000:]
            log(f"stage {stage} failed: {type(exc).__name__}: {exc}")
        write(f"{stage}.json", out)
    log("done")


if __name__ == "__main__":
    main()
