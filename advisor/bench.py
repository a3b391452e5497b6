"""`advisor bench`: eager, torch.compile modes and a recipe, measured in one run.

For each shape: latency (median), speed-up over eager, kernels per forward (CUDA), peak
memory, and time of the first call (compile / apply cost). The recipe's outputs are
checked against eager first (the whole-model tolerance of the dtype): a mismatch is
reported, not timed as a win.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from advisor.kernels.testing import max_abs_error, max_violation, rel_error, tolerance
from advisor.loader import ModelFile, build, call, checked_forward, first_tensor, inputs_for
from advisor.runtime.apply import apply
from advisor.runtime.recipe import Recipe
from advisor.state import Snapshot
from advisor.timing import kernels_per_call, median_ms, timed_call

SCHEMA_VERSION = 1


@dataclass
class BenchResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    applied: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)


def _peak_mb(fn: Any, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _measure(name: str, fn: Any, device: torch.device, first_s: float, seq_len: int) -> dict[str, Any]:
    return {"shape": seq_len, "variant": name, "ms": median_ms(fn, device),
            "kernels": kernels_per_call(fn, device), "peak_mb": _peak_mb(fn, device),
            "first_call_s": round(first_s, 3)}


def fp32_truth(mf: ModelFile, model: torch.nn.Module, shapes: tuple[int, ...], batch: int,
               device: torch.device, phase: str) -> dict[int, torch.Tensor]:
    """Outputs of the same model in float32 (weights upcast, same inputs): the yardstick
    that says whether eager or the fused model is nearer the exact result when they differ
    in bf16/fp16."""
    import copy

    ref32 = copy.deepcopy(model).float()
    out = {}
    with torch.no_grad():
        for t in shapes:
            out[t] = first_tensor(call(ref32, inputs_for(mf, t, batch, device, phase=phase,
                                                         dtype=torch.float32))).float()
    del ref32
    return out


def run_bench(mf: ModelFile, recipe: Recipe, shapes: tuple[int, ...], batch: int,
              device: torch.device, dtype: torch.dtype, compile_modes: tuple[str, ...],
              phase: str = "prefill", truth: bool = True) -> BenchResult:
    """shapes are prompt lengths (prefill) or KV-cache context lengths (decode). Each
    shape's inputs are snapshot once; state they hold (a KV cache) is restored before
    every correctness check, so fused and eager see the same cache."""
    from advisor.env import environment

    model = build(mf, device, dtype)
    result = BenchResult(environment=environment(device),
                         meta={"model": str(mf.path), "dtype": str(dtype), "batch": batch, "phase": phase,
                               "shapes": list(shapes), "compile_modes": list(compile_modes)})
    inputs = {t: inputs_for(mf, t, batch, device, phase=phase, dtype=dtype) for t in shapes}
    states = {t: Snapshot(inputs[t]) for t in shapes}
    refs = {t: first_tensor(checked_forward(mf, model, inputs[t])) for t in shapes}
    for s in states.values():
        s.restore()
    exact = fp32_truth(mf, model, shapes, batch, device, phase) if truth and dtype != torch.float32 else {}
    rows: list[dict[str, Any]] = []
    # Decode calls are routed by context length, which the bench knows (reading it from
    # cache_position would cost a device sync per step).
    context = {"len": 0}
    length_of = (lambda args, kwargs: context["len"]) if phase == "decode" else None
    with torch.no_grad():
        for t in shapes:
            rows.append(_measure("eager", lambda t=t: call(model, inputs[t]), device, 0.0, t))
            states[t].restore()
            if t in exact:
                rows[-1]["rel_error_vs_fp32"] = rel_error(refs[t].float(), exact[t])
        fast = apply(model, recipe, length_of=length_of)
        for t in shapes:
            context["len"] = t
            out, first = timed_call(lambda t=t: call(fast, inputs[t]), device)
            states[t].restore()
            row = _measure("advisor", lambda t=t: call(fast, inputs[t]), device, first, t)
            states[t].restore()
            got = first_tensor(out)
            row["max_error"] = max_abs_error(got, refs[t])
            row["rel_error"] = rel_error(got, refs[t])
            row["matches_eager"] = max_violation(got, refs[t], tolerance(dtype, model=True)) <= 0
            if t in exact:
                row["rel_error_vs_fp32"] = rel_error(got.float(), exact[t])
            rows.append(row)
        result.applied = fast.summary()
        for mode in compile_modes:
            torch._dynamo.reset()
            compiled = torch.compile(model, mode=None if mode == "default" else mode)
            for t in shapes:
                _, first = timed_call(lambda t=t, c=compiled: call(c, inputs[t]), device)
                rows.append(_measure(f"torch.compile[{mode}]", lambda t=t, c=compiled: call(c, inputs[t]),
                                     device, first, t))
        torch._dynamo.reset()
    eager = {r["shape"]: r["ms"] for r in rows if r["variant"] == "eager"}
    for r in rows:
        r["speedup_vs_eager"] = eager[r["shape"]] / r["ms"] if r["ms"] else None
    result.rows = sorted(rows, key=lambda r: (r["shape"], r["variant"] != "eager"))
    return result


def to_json(r: BenchResult) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "kind": "advisor.bench", "environment": r.environment,
            "meta": r.meta, "rows": r.rows, "applied": r.applied}
