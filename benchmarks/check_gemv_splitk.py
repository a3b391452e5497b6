"""GPU check of the GEMV split-K path (gemm.py: K-slice partials, then a fixed-order sum
and the epilogue): repeats and CUDA-graph replays must be bit-exact. Written for an
in-kernel fix-up (the last split of a column tile sums the partials), which passed this
check on the H200 but made split GEMVs slower (down_proj 29.7 -> 36.9 µs) and was reverted;
it still guards the two-kernel path.

For Llama-3-8B projections and every split in the menu, each op (epilogue + residual,
SwiGLU, RMSNorm, RMSNorm + SwiGLU) is launched many times back to back, then captured in a
CUDA graph and replayed, with fresh inputs copied in before each replay; every result must
equal the first (bit-exact: the sums run in a fixed order) and match the fp32 reference.

    python benchmarks/check_gemv_splitk.py     # writes gemv-splitk-check.json under $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import gemm  # noqa: E402
from advisor.kernels.testing import max_violation, tolerance  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

SHAPES = {"o_proj": (4096, 4096), "down_proj": (14336, 4096), "gate_up": (4096, 14336)}  # (K, N)


def _ops(k: int, n: int, dev, dtype, gen):
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).to(dtype)

    x, res, g = r(1, k), r(1, n), r(k, scale=0.5) + 1
    w, w_gu = r(n, k, scale=k ** -0.5), r(2 * n, k, scale=k ** -0.5)
    return {
        "epilogue+residual": (x, lambda c: gemm.launch_gemm_epilogue(x, w, None, res, "none", c),
                              lambda: gemm.reference(x, w, None, res, "none")),
        "swiglu": (x, lambda c: gemm.launch_gemm_swiglu(x, w_gu, "silu", c),
                   lambda: gemm.reference_swiglu(x, w_gu, "silu")),
        "rmsnorm": (x, lambda c: gemm.launch_gemm_rmsnorm(x, g, w, 1e-5, 0.0, c),
                    lambda: gemm.reference_rmsnorm(x, g, w, 1e-5, 0.0)),
        "rmsnorm+swiglu": (x, lambda c: gemm.launch_gemm_rmsnorm_swiglu(x, g, w_gu, 1e-5, 0.0, "silu", c),
                           lambda: gemm.reference_rmsnorm_swiglu(x, g, w_gu, 1e-5, 0.0, "silu")),
    }


def main() -> None:
    dev, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    rows, bad = [], 0
    for site, (k, n) in SHAPES.items():
        for op, (x, run, ref) in _ops(k, n, dev, dtype, gen).items():
            problem = {"M": 1, "N": n, "K": k, "dtype": str(dtype), "gated": int("swiglu" in op)}
            splits = sorted({c["SPLIT_K"] for c in gemm.SPACE.configs(problem)} - {1})
            for split in splits:
                cfg = next(c for c in gemm.SPACE.configs(problem) if c["SPLIT_K"] == split)
                first = run(cfg).clone()
                eager_same = all(torch.equal(run(cfg), first) for _ in range(50))
                # CUDA graph: replay with new x each time (copied into the captured input)
                x0 = x.clone()
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    run(cfg)
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = run(cfg)
                worst = 0.0
                for i in range(20):
                    x.copy_(x0 * (1 + 0.01 * i))
                    graph.replay()
                    worst = max(worst, max_violation(out.float(), ref().float(), tolerance(dtype)))
                x.copy_(x0)
                graph.replay()
                graph_same = torch.equal(out, first)
                ok = eager_same and graph_same and worst <= 0 and max_violation(
                    first.float(), ref().float(), tolerance(dtype)) <= 0
                bad += not ok
                rows.append({"site": site, "op": op, "split": split, "config": cfg,
                             "repeat_bit_exact": eager_same, "graph_bit_exact": graph_same,
                             "graph_max_violation": worst, "ok": ok})
                print(f"{site:10s} {op:18s} SPLIT_K={split:2d} eager-repeat {eager_same} "
                      f"graph-repeat {graph_same} excess {worst:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    write("gemv-splitk-check.json", {**header(dev, shapes=SHAPES, dtype=str(dtype)), "rows": rows,
                                     "failures": bad})
    print(f"{bad} failures of {len(rows)}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
