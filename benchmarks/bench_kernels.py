"""Every registered kernel at Llama-3-8B sizes, on the GPU, in one run.

For tokens in 1, 128, 512, 2048, 8192: correctness of the Triton kernel against its
reference (on the GPU, fresh random inputs, NaN-free), then the median time (CUDA events,
L2 flushed: triton.testing.do_bench) of (a) the unfused eager ops (the reference), (b)
torch.compile of the reference, (c) the kernel with its default config and (d) the best
config of a sweep of its space. Achieved GB/s = minimal bytes moved ÷ time, against the
copy bandwidth measured in the same run and against a copy of the same bytes. Output: kernels.json under $OUT.

    python benchmarks/bench_kernels.py [--tokens 1,128,512,2048,8192] [--kernels a,b] [--sweep 12]
        [--where LAYOUT=2,EVICT=1] [--dims K=14336] [--over "TMA=1;TMA=2"] [--json kernels.json]

`--where` narrows each kernel's sweep to the configs of its space with those axis values
(axes a space does not have are ignored for it), e.g. gated_act's flat configs only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels.registry import all_kernels  # noqa: E402
from advisor.kernels.space import decode, encode  # noqa: E402
from advisor.kernels.testing import max_abs_error, max_violation, tolerance  # noqa: E402
from advisor.profile.ceilings import measure_ceilings  # noqa: E402
from benchmarks.common import header, write  # noqa: E402


def _flat(out):
    return out if isinstance(out, (tuple, list)) else (out,)


def _check(spec, inputs, config) -> float:
    want = _flat(spec.reference(*inputs))
    got = _flat(spec.launch(*inputs, config=config))
    worst = 0.0
    for w, g in zip(want, got):
        if max_violation(g, w, tolerance(w.dtype)) > 0:
            raise AssertionError(f"{spec.name} {encode(config)}: max err {max_abs_error(g, w):.3g}")
        worst = max(worst, max_abs_error(g, w))
    return worst


def _ms(fn) -> float:
    """Device time of one call. Replayed from a CUDA graph where the call can be captured:
    a plain do_bench loop of ~10 µs kernels measures the Python launcher's host time
    instead (seen on the H200, 2026-12-02); fall back to do_bench otherwise."""
    try:
        return float(do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception:
        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


# Registry entries that only adapt another kernel to a model's separate weights (or are
# cuBLAS): timing them would time the same kernel twice.
ADAPTERS = {"merged_linear", "linear_swiglu", "rmsnorm_linear"}
L2_BYTES = 60 << 20  # H200's L2 as torch reports it (60 MB); rotate inputs past 2x this


def _rotating(fn_of, input_sets):
    """One call per input set (so data is not L2-resident between calls); time / n."""
    n = len(input_sets)
    return lambda: [fn_of(inp) for inp in input_sets], n


def _matches(cfg: dict, where: dict) -> bool:
    """cfg has every value of `where` on the axes it has (others are not its business)."""
    return all(cfg[k] == v for k, v in where.items() if k in cfg)


def bench_kernel(spec, tokens: int, dtype: torch.dtype, sweep: int, compiled, configs=None,
                 where=None, dims=None, overrides=()) -> dict:
    """One row: correctness, eager / compile / default / best-of-sweep times. `configs`: time
    these (well-formed and kept for the problem) instead of a sweep of the space; `where`:
    sweep only the space's configs with these axis values (see `_matches`); `dims`: bench
    dimensions replacing the spec's (down_proj's K = 14336); `overrides`: configs timed as
    the default with these axis values changed (TMA=2,num_stages=3)."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(tokens)
    shape = {**spec.bench_dims(tokens), **(dims or {})}
    inputs = spec.make_inputs(shape, dtype, dev, gen)
    copies = max(1, min(16, -(-2 * L2_BYTES // max(1, spec.bytes_moved(*inputs)))))
    sets = [inputs] + [spec.make_inputs(shape, dtype, dev, gen) for _ in range(copies - 1)]

    def timed(call) -> float:
        fn, n = _rotating(call, sets)
        return _ms(fn) / n

    problem = spec.problem(*inputs)
    default = spec.default_config(*inputs)
    row = {"kernel": spec.name, "tokens": tokens, "dims": shape,
           "bytes": spec.bytes_moved(*inputs), "default_config": encode(default),
           "max_error": _check(spec, inputs, default)}
    row["input_sets"] = copies
    eager = spec.unfused_ops()  # the eager ops a model runs (the reference where not given)
    row["eager_ms"] = timed(lambda inp: eager(*inp))
    row["compile_ms"] = timed(lambda inp: compiled(*inp))
    row["default_ms"] = timed(lambda inp: spec.launch(*inp, config=default))
    best_cfg, best_ms, tried = default, row["default_ms"], 0
    if overrides:
        configs = [{**default, **o} for o in overrides]
    if configs is None:
        every = [c for c in spec.space.configs(problem) if _matches(c, where or {})]
        configs = every[::max(1, len(every) // sweep)] if sweep else []
    else:  # a launch would run the default in place of a config `keep` refuses: say so
        refused = [c for c in configs if not spec.space.keep(c, problem)]
        row["failed_configs"] = [f"{encode(c)}: not kept for this problem" for c in refused]
        configs = [c for c in configs if c not in refused]
    for cfg in configs:
        try:
            _check(spec, inputs, cfg)
            ms = timed(lambda inp, cfg=cfg: spec.launch(*inp, config=cfg))
        except Exception as exc:  # a config that does not compile/fit: recorded, skipped
            row.setdefault("failed_configs", []).append(f"{encode(cfg)}: {type(exc).__name__}")
            continue
        tried += 1
        row.setdefault("config_ms", {})[encode(cfg)] = ms
        if ms < best_ms:
            best_cfg, best_ms = cfg, ms
    row.update(best_config=encode(best_cfg), best_ms=best_ms, configs_tried=tried)
    if spec.spills is not None:
        try:
            row["spills"] = spec.spills(*inputs, config=best_cfg)
        except Exception as exc:
            row["spills"] = f"{type(exc).__name__}"
    for key in ("eager", "compile", "default", "best"):
        row[f"{key}_gbps"] = row["bytes"] / (row[f"{key}_ms"] * 1e-3) / 1e9
        if spec.flops is not None:
            row[f"{key}_tflops"] = spec.flops(*inputs) / (row[f"{key}_ms"] * 1e-3) / 1e12
    # The same bytes as a plain copy (half read, half written), rotated the same way: at
    # ~10 µs, launch ramp and tail cap any kernel below the large-copy bandwidth, and this
    # says by how much at this size.
    half = max(1, row["bytes"] // 2)
    bufs = [(torch.empty(half, dtype=torch.uint8, device=dev), torch.empty(half, dtype=torch.uint8, device=dev))
            for _ in sets]
    copy_all, n = _rotating(lambda b: b[1].copy_(b[0]), bufs)
    row["copy_ms"] = _ms(copy_all) / n
    row["frac_of_same_size_copy"] = row["copy_ms"] / best_ms
    row["speedup_vs_eager"] = row["eager_ms"] / best_ms
    row["speedup_vs_compile"] = row["compile_ms"] / best_ms
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,128,512,2048,8192")
    ap.add_argument("--kernels", default="")
    ap.add_argument("--sweep", type=int, default=12, help="configs timed per shape (0: default only)")
    ap.add_argument("--where", default="", help="sweep only configs with these axis values: K=V,...")
    ap.add_argument("--dims", default="", help="bench dimensions to replace: K=14336,N=4096")
    ap.add_argument("--over", default="", help="instead of a sweep: the default with these axis "
                    "values, ';' between configs: TMA=1;TMA=2,num_stages=3 (a config the space does "
                    "not keep for the problem is listed as such: e.g. TMA=0 past 128 16-bit rows)")
    ap.add_argument("--json", default="kernels.json", help="file name under $OUT")
    args = ap.parse_args()
    where, dims = decode(args.where), decode(args.dims)
    overrides = [decode(o) for o in args.over.split(";") if o]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    ceilings = measure_ceilings(dev)
    tokens = [int(t) for t in args.tokens.split(",")]
    specs = {k: v for k, v in all_kernels().items() if k not in ADAPTERS}
    if args.kernels:
        specs = {k: specs[k] for k in args.kernels.split(",")}
    rows, failures = [], []

    def save() -> Path:  # after every row: a run cut by its time limit keeps what it measured
        payload = header(dev, dtype="bfloat16", tokens=tokens, where=args.where, dims=args.dims,
                         over=args.over,
                         timing="do_bench_cudagraph median (device time; do_bench median where capture fails)")
        payload.update(ceilings={"copy_gbps": ceilings.copy_gbps, "matmul_tflops": ceilings.matmul_tflops,
                                 "launch_us": ceilings.launch_us, "graph_launch_us": ceilings.graph_launch_us},
                       rows=rows, failures=failures)
        return write(args.json, payload)

    for name, spec in specs.items():
        compiled = torch.compile(spec.unfused_ops(), dynamic=False)
        for t in tokens:
            try:
                row = bench_kernel(spec, t, dtype, args.sweep, compiled, where=where, dims=dims,
                                   overrides=overrides)
                row["frac_of_copy_bw"] = row["best_gbps"] / ceilings.copy_gbps
                rows.append(row)
                print(f"{name:16s} {t:5d} tok  eager {row['eager_ms']*1e3:8.1f}us  compile "
                      f"{row['compile_ms']*1e3:8.1f}us  ours {row['best_ms']*1e3:8.1f}us "
                      f"({row['best_gbps']:6.0f} GB/s, {100*row['frac_of_copy_bw']:3.0f}% of copy, "
                      f"{100*row['frac_of_same_size_copy']:3.0f}% of a same-size copy) "
                      f"best {row['best_config']} of {row['configs_tried']}", flush=True)
                if overrides:  # each variant against the default, so the log alone answers
                    print(f"{'':22s} default {row['default_ms']*1e3:8.1f}us " + "  ".join(
                        f"{c}: {ms*1e3:.1f}us" for c, ms in row.get("config_ms", {}).items()),
                        row.get("failed_configs", ""), flush=True)
            except Exception as exc:
                failures.append({"kernel": name, "tokens": t, "error": f"{type(exc).__name__}: {exc}"[:500]})
                print(f"{name:16s} {t:5d} FAILED {failures[-1]['error']}", flush=True)
            save()
        torch._dynamo.reset()
    print("wrote", save())


if __name__ == "__main__":
    main()
