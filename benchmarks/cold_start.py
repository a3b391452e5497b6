"""Where a cold start goes: one fresh process, from its start to the first fast forward.

Issue 7 asks for the first tuned forward in under half of torch.compile's time. The bench
records only the first call's total (`first_call_s`) and, for a recipe, the rewrite's host
time; this script splits the whole start of one process into phases and profiles the
first call, so the next change can cut what actually costs:

    import     torch + advisor (+ transformers via the model file)
    build      the model (random weights) and one shape's inputs
    prepare    load_recipe + apply (recipe) | torch.compile(model, mode) (compile)
    first      the first call (trace, rewrite and confirmation, kernel compiles, capture)
    second     the second call (CUDA-graph capture happens on a plan's first repeats)
    fast       median of 20 later calls: the first call counts only once this is reached

Run one variant per process, twice with the same cache folders to see cold vs warm
caches (Triton's and Inductor's on-disk caches)::

    export TRITON_CACHE_DIR=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d)
    python3 benchmarks/cold_start.py --recipe recipes/llama_hf-h200.json --tokens 1 --json a.json
    python3 benchmarks/cold_start.py --recipe recipes/llama_hf-h200.json --tokens 1 --json b.json

Writes a JSON with the phase seconds and, with --profile, the profile's top functions
(cumulative and own time) of the first call. cProfile slows Python-heavy work (tracing) and
dynamo's frame hooks hide part of the first call from it: time without it, profile apart.
"""

from __future__ import annotations

import time

START = time.perf_counter()  # before any heavy import: the process's start, near enough

import argparse  # noqa: E402
import cProfile  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pstats  # noqa: E402
import statistics  # noqa: E402
from pathlib import Path  # noqa: E402


def _top(profile: cProfile.Profile, key: str, n: int, under: str = "") -> list[dict]:
    """The n functions with the most `key` time ("cumulative" or "tottime"), only those
    whose file path contains `under` if given."""
    stats = pstats.Stats(profile, stream=io.StringIO())
    rows = []
    for (file, line, name), (_, calls, own, cum, _) in stats.stats.items():
        if under not in file:
            continue
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls": calls,
                     "own_s": round(own, 4), "cumulative_s": round(cum, 4)})
    field = "cumulative_s" if key == "cumulative" else "own_s"
    return sorted(rows, key=lambda r: -r[field])[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/llama_hf.py")
    ap.add_argument("--recipe", help="a recipe or plan file (the advisor variant)")
    ap.add_argument("--compile", choices=("default", "reduce-overhead"),
                    help="torch.compile mode (the baseline variant) instead of --recipe")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true",
                    help="cProfile the first call (slows Python-heavy work; dynamo hides part of it)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if bool(args.recipe) == bool(args.compile):
        ap.error("give exactly one of --recipe and --compile")

    phases: dict[str, float] = {}
    mark = START

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        phases[name] = round(now - mark, 3)
        mark = now

    import torch

    import advisor
    from advisor.loader import build, call, inputs_for, load_model_file, parse_dtype

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    mf = load_model_file(args.model)
    lap("import")
    dtype = parse_dtype(args.dtype)
    model = build(mf, device, dtype)
    x = inputs_for(mf, args.tokens, 1, device, dtype=dtype)
    sync()
    lap("build")

    if args.recipe:
        fast = advisor.load_recipe(args.recipe).apply(model)
        variant = f"advisor:{Path(args.recipe).name}"
    else:
        fast = torch.compile(model, mode=None if args.compile == "default" else args.compile)
        variant = f"torch.compile[{args.compile}]"
    lap("prepare")

    profile = cProfile.Profile() if args.profile else None
    with torch.no_grad():
        if profile:
            profile.enable()
        call(fast, x)
        sync()
        if profile:
            profile.disable()
        lap("first")
        call(fast, x)
        sync()
        lap("second")
        times = []
        for _ in range(20):
            t = time.perf_counter()
            call(fast, x)
            sync()
            times.append(time.perf_counter() - t)
    fast_ms = statistics.median(times) * 1e3
    to_first = round(sum(phases[p] for p in ("import", "build", "prepare", "first")), 3)
    result = {
        "variant": variant, "tokens": args.tokens, "dtype": args.dtype,
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "git_sha": os.environ.get("ADVISOR_GIT_SHA"),
        "caches": {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")},
        "phases_s": phases, "to_first_forward_s": to_first,
        "prepare_plus_first_s": round(phases["prepare"] + phases["first"], 3),
        "fast_ms": round(fast_ms, 3),
        "summary": fast.summary() if hasattr(fast, "summary") else None,
    }
    if profile:
        result.update(
            first_call_top_cumulative=_top(profile, "cumulative", args.top),
            first_call_top_own=_top(profile, "tottime", args.top),
            first_call_top_advisor=_top(profile, "cumulative", args.top, under=f"advisor{os.sep}"),
            first_call_top_triton=_top(profile, "cumulative", 15, under=f"triton{os.sep}"))
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"{variant} @ {args.tokens} tok: {phases}  to first forward {to_first} s, "
          f"then {fast_ms:.3f} ms per call")
    for r in result.get("first_call_top_advisor", [])[:20]:
        print(f"  {r['cumulative_s']:8.3f} cum {r['own_s']:8.3f} own {r['calls']:7d}  {r['function']}")


if __name__ == "__main__":
    main()
