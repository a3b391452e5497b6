"""Why are our GEMM families refused in fp32 on the GPU? (sessions 26 H200, 27 H100)

`check_spellings.py` in fp32: every GEMM-family site (rms_norm_linear, linear_residual,
gate_up_swiglu, linear_bias_act, …) fails confirmation with max |err| 3e-5 … 1.2e-3 beyond
atol 1e-5 + rtol 1e-5, and is less accurate than the captured subgraph against float64;
on the CPU (interpreter) the same sites pass. TF32-sized errors, yet the launcher asks
`tl.dot` for "ieee" in fp32.

This probe runs every matrix kernel of the registry in fp32 at its CPU test dims and at
a few decode / prefill row counts, with its default config and each config of its space
(a handful), and reports per run the error against its eager ops (`unfused`) in float64,
next to those eager ops' own error in fp32: which path (GEMV, pointer tl.dot, TMA) and
which config loses precision. Run on the GPU::

    python3 benchmarks/fp32_probe.py --json $OUT/fp32-probe.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from advisor.env import environment
from advisor.kernels.registry import all_kernels
from advisor.kernels.space import encode
from advisor.loader import first_tensor

KERNELS = ("gemm_epilogue", "gemm_swiglu", "gemm_rmsnorm", "gated_linear", "rmsnorm_swiglu")
ROWS = (2, 10, 22, 64, 300)  # GEMV (<= 4), small tensor-core tiles, pointer / TMA tiles


def _as64(t):
    if isinstance(t, (tuple, list)):  # e.g. a merged projection's weights
        return type(t)(_as64(v) for v in t)
    return t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t


def _err(out: torch.Tensor, truth: torch.Tensor) -> float:
    return float((out.double() - truth).abs().max() / truth.abs().max().clamp_min(1e-30))


def probe(name: str, dims: dict, configs_per_kernel: int, device: torch.device) -> list[dict]:
    spec = all_kernels()[name]
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = spec.make_inputs(dims, torch.float32, device, gen)
    as64 = [_as64(t) for t in inputs]
    # `unfused` computes in its inputs' dtype (what eager runs); `reference` upcasts to fp32
    eagerly = spec.unfused or spec.reference
    truth = first_tensor(eagerly(*as64)).double()
    eager = _err(first_tensor(eagerly(*inputs)), truth)
    problem = spec.problem(*inputs)
    rows = []
    configs = [None, *spec.space.configs(problem)[:configs_per_kernel]]
    for cfg in configs:
        try:
            out = first_tensor(spec.launch(*inputs, config=cfg))
            if device.type == "cuda":
                torch.cuda.synchronize()
            rows.append({"kernel": name, "dims": dims, "config": encode(cfg) if cfg else "default",
                         "resolved": encode(spec.space.resolve(cfg, problem)),
                         "rel_err": _err(out, truth), "eager_rel_err": eager})
        except Exception as exc:  # a config this shape cannot take: say so, go on
            rows.append({"kernel": name, "dims": dims, "config": encode(cfg) if cfg else "default",
                         "error": f"{type(exc).__name__}: {exc}"[:200]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", type=int, default=6, help="configs of each space tried")
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1)")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts at K = N = 512")
    args = ap.parse_args()
    device = torch.device(args.device)
    rows = []
    for name in KERNELS:
        spec = all_kernels()[name]
        shapes = [dict(d) for d in spec.test_dims]
        shapes += [{**dict(spec.test_dims[0]), "M": int(m), "K": 512, "N": 512}
                   for m in args.rows.split(",") if m]
        for dims in shapes:
            for r in probe(name, dims, args.configs, device):
                rows.append(r)
                flag = "" if "error" in r else ("  <-- beyond 4x eager" if r["rel_err"] > 4 * r["eager_rel_err"] + 1e-6 else "")
                print(json.dumps(r) + flag)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(device), "git_sha": os.environ.get("ADVISOR_GIT_SHA"),
                       "dtype": "float32", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
