"""`advisor analyze`: latency budget and priced fusion candidates per requested shape.

Pure orchestration returning data (`Analysis`); the CLI renders it and `to_json` gives the
documented, versioned JSON (schema "advisor.analysis", version 1):

    {"schema_version": 1, "kind": "advisor.analysis", "model": str, "device": str,
     "dtype": str, "batch": int, "phase": "prefill" | "decode" (seq_len = context length),
     "environment": {...}, "git_sha": str | null (env.source_revision), "ceilings": {...},
     "shapes": [{"seq_len": int, "verdict": str, "gpu_busy_fraction": float,
                 "budget": {"wall_ms": float, "plain_wall_ms": float, "profiled_wall_ms": float,
                            "profiled_categories": {...} (as traced, before calibration),
                            "categories": {"launch_host"|"memory"|"compute"|"idle_sync": ms},
                            "ops": [{op, module, calls, kernels, device_ms, launch_host_ms,
                                     idle_sync_ms, memory_ms, compute_ms, flops, bytes,
                                     intensity, roofline, achieved_gbps, achieved_tflops}]},
                 "candidates": [{family, kernel, applicable, sites, count, launches_removed,
                                 bytes_avoided, predicted_saving_ms,
                                 device_saving_ms (measured on the analysis device, per
                                 forward; null where not measured), probe_note (why not),
                                 site_savings_ms, device_saving_warm_ms, device_saving_pdl_ms,
                                 site_sliced (the probe's variants, graph/candidates.py)}],
                 "probe_configs": {family: config} (analyze --recipe: the configs probed;
                                  {}: each kernel's default; null: the recipe runs
                                  unfused at this length, defaults probed)}]}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from advisor.env import source_revision
from advisor.graph.candidates import Candidate, Costs, candidates, matches_of
from advisor.graph.capture import capture
from advisor.loader import ModelFile, build, checked_forward, inputs_for
from advisor.profile import Budget, Ceilings, gpu_busy_fraction, profile_model, verdict
from advisor.profile.merge_probe import MERGE_KERNEL, merge_shape, probe_merges
from advisor.runtime.recipe import Recipe
from advisor.runtime.site_probe import probe_sites

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class ShapeAnalysis:
    seq_len: int
    budget: Budget
    verdict: str
    gpu_busy_fraction: float
    candidates: tuple[Candidate, ...]
    # family -> config probed; None: analyze --recipe, whose plan runs unfused at this length
    probe_configs: dict[str, str] | None = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Analysis:
    model: str
    device: str
    dtype: str
    batch: int
    environment: dict[str, Any]
    ceilings: Ceilings
    shapes: tuple[ShapeAnalysis, ...]
    phase: str = "prefill"


def costs_from(ceilings: Ceilings) -> Costs:
    return Costs(launch_us=ceilings.launch_us, copy_gbps=ceilings.copy_gbps)


def find_candidates(model: torch.nn.Module, inputs: Any, ceilings: Ceilings,
                    device: torch.device | None = None,
                    configs: dict[str, str] | None = None) -> tuple[Candidate, ...]:
    """Candidates priced by the ceilings; with `device`, each site's device-time saving
    measured there: merges as cuBLAS calls (profile/merge_probe.py), the other families'
    sites fused vs captured (runtime/site_probe.py, CUDA only)."""
    matches = matches_of(capture(model, inputs))
    if device is None:
        return tuple(candidates(matches, costs_from(ceilings)))
    merges = probe_merges(matches, device)
    sites = probe_sites(matches, device, configs)

    def measured(m: Any) -> float | None:
        if m.kernel == MERGE_KERNEL:
            t = merges.get(merge_shape(m))  # type: ignore[arg-type]
            return None if t is None else t.saving_ms
        return sites.saving_ms(m)

    def unmeasured(m: Any) -> str:
        if m.kernel == MERGE_KERNEL:
            return "merge shape unknown"
        return sites.reason(m)
    def warm(m: Any) -> float | None:
        return None if m.kernel == MERGE_KERNEL else sites.warm_saving_ms(m)
    def sliced(m: Any) -> Any:
        return None if m.kernel == MERGE_KERNEL else sites.sliced(m)
    def pdl(m: Any) -> float | None:
        return None if m.kernel == MERGE_KERNEL else sites.pdl_saving_ms(m)
    return tuple(candidates(matches, costs_from(ceilings), measured, unmeasured, warm, sliced, pdl))


def analyze_shape(mf: ModelFile, model: torch.nn.Module, seq_len: int, batch: int,
                  device: torch.device, dtype: torch.dtype, ceilings: Ceilings, *,
                  iters: int = 5, trace_path: Path | None = None,
                  phase: str = "prefill", probe: bool = True,
                  configs: dict[str, str] | None = None, recipe_unfused: bool = False) -> ShapeAnalysis:
    """seq_len is the prompt length (prefill) or the KV-cache context length (decode);
    `configs`: family -> kernel config the site probe runs (default: each kernel's own);
    `recipe_unfused`: a recipe was given, but runs unfused at this length (recorded)."""
    inputs = inputs_for(mf, seq_len, batch, device, phase=phase, dtype=dtype)
    checked_forward(mf, model, inputs)  # a raising forward is one clear error, first
    budget = profile_model(model, inputs, device, dtype, ceilings=ceilings, iters=iters,
                           trace_path=trace_path)
    configs = dict(configs or {}) if probe else {}
    return ShapeAnalysis(seq_len, budget, verdict(budget), gpu_busy_fraction(budget),
                         find_candidates(model, inputs, ceilings, device if probe else None, configs),
                         None if recipe_unfused else configs)


def analyze(mf: ModelFile, shapes: tuple[int, ...], batch: int, device: torch.device,
            dtype: torch.dtype, ceilings: Ceilings, *, iters: int = 5,
            trace_dir: Path | None = None, phase: str = "prefill", probe: bool = True,
            recipe: Recipe | None = None) -> Analysis:
    """`recipe`: the site probe runs each family's kernel in the config of the recipe's
    bucket for the length (what that tuned plan runs), so its savings are that plan's."""
    from advisor.env import environment

    model = build(mf, device, dtype)
    results = []
    for seq_len in shapes:
        trace = trace_dir / f"trace-{seq_len}.json" if trace_dir else None
        bucket = recipe.bucket_for(seq_len) if recipe else None
        results.append(analyze_shape(mf, model, seq_len, batch, device, dtype, ceilings,
                                     iters=iters, trace_path=trace, phase=phase, probe=probe,
                                     configs=dict(bucket.plan.configs) if bucket else None,
                                     recipe_unfused=recipe is not None and bucket is None))
    return Analysis(str(mf.path), str(device), str(dtype).replace("torch.", ""), batch,
                    environment(device), ceilings, tuple(results), phase)


def _plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def to_json(a: Analysis) -> dict[str, Any]:
    shapes = []
    for s in a.shapes:
        cands = [{**_plain(c), "applicable": c.applicable} for c in s.candidates]
        shapes.append({"seq_len": s.seq_len, "verdict": s.verdict,
                       "gpu_busy_fraction": s.gpu_busy_fraction,
                       "budget": _plain(s.budget), "candidates": cands,
                       "probe_configs": None if s.probe_configs is None else dict(s.probe_configs)})
    return {"schema_version": SCHEMA_VERSION, "kind": "advisor.analysis", "model": a.model,
            "device": a.device, "dtype": a.dtype, "batch": a.batch, "phase": a.phase,
            "environment": a.environment, "git_sha": source_revision(),
            "ceilings": _plain(a.ceilings), "shapes": shapes}
