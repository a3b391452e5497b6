"""GEMMs over a weight stored (K, N) (GPT-2's Conv1D, `x @ W`), read as the (N, K) view
t(W) with strides (1, N), as `graph/linear_forms.py` rewrites them: correct on the GPU, and
how fast, beside the same kernel over an (N, K)-contiguous copy and cuBLAS + the separate
epilogue as the model runs it (`addmm(b, x, W)` then the activation or the residual add).

Shapes (K, N): GPT-2 XL's c_fc (1600, 6400) and c_proj (6400, 1600), Llama-3-8B's o_proj
(4096, 4096); rows 1, 16, 128, 512; bf16; default configs.

    python benchmarks/check_kn_weights.py     # writes kn-weights-check.json under $OUT
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.kernels import gemm  # noqa: E402
from advisor.kernels.testing import max_violation, tolerance  # noqa: E402
from benchmarks.bench_kernels import _ms  # noqa: E402
from benchmarks.common import header, write  # noqa: E402

# site: (K, N, epilogue)
SHAPES = {"c_fc gelu": (1600, 6400, "gelu_tanh"), "c_proj residual": (6400, 1600, "residual"),
          "o_proj residual": (4096, 4096, "residual")}
ROWS = (1, 16, 128, 512)


def _row(site: str, k: int, n: int, epilogue: str, m: int, dev, gen) -> dict:
    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=dev) * scale).bfloat16()

    x, w_kn, b = r(m, k), r(k, n, scale=k ** -0.5), r(n, scale=0.1)
    res = r(m, n) if epilogue == "residual" else None
    act = "none" if res is not None else epilogue
    w_view, w_nk = w_kn.t(), w_kn.t().contiguous()  # (N, K): strides (1, N), and (K, 1)

    def ours(w):
        return lambda: gemm.launch_gemm_epilogue(x, w, b, res, act)

    def cublas():  # what the model runs: addmm over the (K, N) weight, then the epilogue op
        y = torch.addmm(b, x, w_kn)
        return y + res if res is not None else F.gelu(y, approximate="tanh")

    ref = gemm.reference(x.float(), w_nk.float(), b.float(), None if res is None else res.float(), act)
    tol = tolerance(torch.bfloat16)
    return {"site": site, "K": k, "N": n, "M": m,
            "ok_view": max_violation(ours(w_view)(), ref, tol) <= 0,
            "ok_contiguous": max_violation(ours(w_nk)(), ref, tol) <= 0,
            "cublas_ok": max_violation(cublas(), ref, tol) <= 0,
            "ours_view_ms": _ms(ours(w_view)), "ours_contiguous_ms": _ms(ours(w_nk)),
            "cublas_ms": _ms(cublas)}


def main() -> None:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for site, (k, n, epilogue) in SHAPES.items():
        for m in ROWS:
            rows.append(_row(site, k, n, epilogue, m, dev, gen))
            print(rows[-1], flush=True)
    payload = header(dev, dtype="bfloat16", shapes=f"(K, N) {list(SHAPES.values())}, rows {ROWS}")
    payload["rows"] = rows
    print(write("kn-weights-check.json", payload))


if __name__ == "__main__":
    main()
