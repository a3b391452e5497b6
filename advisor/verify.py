"""Is a fused model's output right? One verdict for `advisor tune` and `advisor bench`.

Kernel tests compare element-wise against an fp32 reference (`kernels.testing`). A whole
model in bf16/fp16 cannot be judged that way against eager: eager itself is off the exact
result by rounding every intermediate, and any reordering (a fused norm that rounds once,
a merged GEMM with another cuBLAS algorithm) moves the logits by about as much. Measured
on the H200 (Llama-3-8B widths, 8 layers, random weights, bf16): eager vs an fp32 copy of
the same model ‖Δ‖/‖ref‖ = 1.6e-2 at 1 token, 2.9-3.2e-2 at 128-2048 tokens; element-wise
|Δ| up to 0.3 in logits for any fused plan vs eager.

So a plan's output `out` passes when either
  1. it is within the dtype's whole-model tolerance of eager element-wise, or
  2. an fp32 truth is given and `out` is at least about as accurate as eager:
     ‖out − truth‖ ≤ ACCURACY_MARGIN · ‖eager − truth‖ + ACCURACY_SLACK · ‖truth‖.
A NaN where eager has none always fails ("nan"); everything else fails as "mismatch".
A plan computing something else (a wrong op, a stale cache) is off by O(1) relative and
fails both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from advisor.kernels.testing import max_abs_error, max_violation, rel_error, tolerance

ACCURACY_MARGIN = 1.25  # fused may be this much further from fp32 than eager is
ACCURACY_SLACK = 1e-3   # ... plus this much relative (eager can be exact at tiny sizes)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    reason: str                  # "" when ok, else "nan" | "mismatch"
    detail: str                  # one line: why
    max_error: float             # max |out − eager|
    rel_error: float             # ‖out − eager‖ / ‖eager‖
    rel_error_vs_fp32: float | None = None        # ‖out − truth‖ / ‖truth‖
    eager_rel_error_vs_fp32: float | None = None  # ‖eager − truth‖ / ‖truth‖


def judge(out: torch.Tensor, eager: torch.Tensor, dtype: torch.dtype,
          truth: torch.Tensor | None = None) -> Verdict:
    """out, eager: the fused and unfused model's outputs (same inputs); truth: the same
    model in fp32 on the same inputs, or None (fp32 models, or no truth computed)."""
    max_err, rel = max_abs_error(out, eager), rel_error(out, eager)
    ours = base = None
    if truth is not None:
        ours, base = rel_error(out.float(), truth.float()), rel_error(eager.float(), truth.float())

    def verdict(ok: bool, reason: str, detail: str) -> Verdict:
        return Verdict(ok, reason, detail, max_err, rel, ours, base)

    if bool((torch.isnan(out) & ~torch.isnan(eager)).any()):
        return verdict(False, "nan", f"NaN in {int(torch.isnan(out).sum())} output elements")
    tol = tolerance(dtype, model=True)
    if max_violation(out, eager, tol) <= 0:
        return verdict(True, "", f"within atol {tol.atol} + rtol {tol.rtol}·|eager|")
    beyond = f"max |err| {max_err:.3g} beyond atol {tol.atol} + rtol {tol.rtol}·|eager|"
    if ours is None or base is None:
        return verdict(False, "mismatch", beyond)
    bound = accuracy_bound(base)
    vs = f"vs fp32 {ours:.3g} (eager {base:.3g}, bound {bound:.3g})"
    if ours <= bound:
        return verdict(True, "", f"{beyond}; as accurate as eager: {vs}")
    return verdict(False, "mismatch", f"{beyond}; less accurate than eager: {vs}")


def accuracy_bound(eager_vs_fp32: float) -> float:
    """Largest ‖out − fp32‖/‖fp32‖ accepted for a fused output, given eager's."""
    return ACCURACY_MARGIN * eager_vs_fp32 + ACCURACY_SLACK


def apart_bound(eager_vs_fp32: float) -> float:
    """Largest ‖out − eager‖/‖eager‖ accepted where no fp32 truth of its own is computed
    (the logits of every step of a greedy generation): outputs each within the margin of
    the truth are about twice that apart (triangle inequality)."""
    return 2 * ACCURACY_MARGIN * eager_vs_fp32 + ACCURACY_SLACK


def needs_truth(dtype: torch.dtype) -> bool:
    """fp32 models are judged element-wise alone; half-precision ones against fp32 too."""
    return dtype in (torch.float16, torch.bfloat16)


def fp32_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights upcast to float32 (a deep copy: the caller's model is untouched)."""
    return copy.deepcopy(model).float()
