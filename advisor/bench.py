"""`advisor bench`: eager, torch.compile modes and a recipe, measured in one run.

For each shape: latency (median), speed-up over eager, kernels per forward (CUDA), peak
memory, and time of the first call (compile / apply cost). The recipe's outputs are
checked against eager first (`advisor.verify.judge`: the whole-model tolerance of the
dtype, or for bf16/fp16 at least as accurate as eager vs an fp32 copy): a mismatch is
reported, not timed as a win. A torch.compile mode that fails is a row with its error.

With `--phase decode --generate N`, every variant also generates N greedy tokens from
each context length (`advisor.generate`): per-token latency and tokens/s of the whole
loop, the tokens, and how they and each step's logits compare with eager's. The JSON
holds these rows under "generation", next to "rows".

With `--ablate`, each shape's plan is also timed with each of its fusions left out (and
without CUDA graphs): the measured saving per family (advisor/ablation.py), under
"ablation", which `advisor report` sets against the analyzer's prediction. With `--alone`,
each family of the plan is timed by itself on the unfused model instead (the analyzer's
own terms), under "alone".

Every row also carries `x_floor`: its latency as a multiple of the shape's floor
(`advisor/profile/floor.py`: weights + live KV cache ÷ copy bandwidth, or FLOPs ÷ matmul
FLOP/s, whichever is larger; generation rows against the read floor of one step); the
floors themselves are under "floors".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from advisor.ablation import ablation_rows, alone_rows
from advisor.env import source_revision
from advisor.errors import AdvisorError, ModelFileError
from advisor.generate import Generation, advancer, cache_capacity, check_capacity, compare, timed_greedy
from advisor.kernels.testing import rel_error
from advisor.loader import (
    Inputs,
    ModelFile,
    _one_line,
    build,
    call,
    checked_forward,
    first_tensor,
    inputs_for,
)
from advisor.profile.ceilings import load_or_measure
from advisor.profile.floor import Floor, floor
from advisor.runtime.apply import apply
from advisor.runtime.recipe import Bucket, Recipe
from advisor.state import Snapshot
from advisor.timing import kernels_per_call, median_ms, timed_call
from advisor.verify import apart_bound, fp32_copy, judge

SCHEMA_VERSION = 1


@dataclass
class BenchResult:
    rows: list[dict[str, Any]] = field(default_factory=list)
    applied: list[dict[str, Any]] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    generation: list[dict[str, Any]] = field(default_factory=list)  # phase decode, --generate N
    ablation: list[dict[str, Any]] = field(default_factory=list)    # --ablate (advisor/ablation.py)
    alone: list[dict[str, Any]] = field(default_factory=list)       # --alone (advisor/ablation.py)
    floors: list[dict[str, Any]] = field(default_factory=list)      # per shape (profile/floor.py)


def _peak_mb(fn: Any, device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _measure(name: str, fn: Any, device: torch.device, first_s: float, seq_len: int,
             reset: Any = None) -> dict[str, Any]:
    return {"shape": seq_len, "variant": name, "ms": median_ms(fn, device, reset=reset),
            "kernels": kernels_per_call(fn, device), "peak_mb": _peak_mb(fn, device),
            "first_call_s": round(first_s, 3)}


def fp32_truth(mf: ModelFile, model: torch.nn.Module, shapes: tuple[int, ...], batch: int,
               device: torch.device, phase: str) -> dict[int, torch.Tensor]:
    """Outputs of the same model in float32 (weights upcast, same inputs): the yardstick
    that says whether eager or the fused model is nearer the exact result when they differ
    in bf16/fp16."""
    ref32 = fp32_copy(model)
    out = {}
    with torch.no_grad():
        for t in shapes:
            out[t] = first_tensor(call(ref32, inputs_for(mf, t, batch, device, phase=phase,
                                                         dtype=torch.float32))).float()
    del ref32
    return out


def run_bench(mf: ModelFile, recipe: Recipe, shapes: tuple[int, ...], batch: int,
              device: torch.device, dtype: torch.dtype, compile_modes: tuple[str, ...],
              phase: str = "prefill", truth: bool = True, generate: int = 0,
              generate_reps: int = 3, ablate: bool = False, alone: bool = False,
              repeats: int = 1) -> BenchResult:
    """shapes are prompt lengths (prefill) or KV-cache context lengths (decode). Each
    shape's inputs are snapshot once; state they hold (a KV cache) is restored before
    every correctness check, so fused and eager see the same cache. With phase decode and
    generate=N, each variant also generates N greedy tokens per shape (`result.generation`).
    `repeats`: how many applies each --ablate / --alone row is timed over (advisor/ablation.py)."""
    from advisor.env import environment

    if generate and phase != "decode":
        raise AdvisorError("--generate needs --phase decode (it generates tokens from a filled KV cache)")
    model = build(mf, device, dtype)
    result = BenchResult(environment=environment(device),
                         meta={"model": str(mf.path), "dtype": str(dtype), "batch": batch, "phase": phase,
                               "shapes": list(shapes), "compile_modes": list(compile_modes),
                               "generate": generate})
    inputs = {t: inputs_for(mf, t, batch, device, phase=phase, dtype=dtype) for t in shapes}
    states = {t: Snapshot(inputs[t]) for t in shapes}
    refs = {t: first_tensor(checked_forward(mf, model, inputs[t])) for t in shapes}
    for s in states.values():
        s.restore()
    floors = _floors(model, inputs, states, device, dtype, phase)
    result.floors = _floor_rows(floors)
    exact = fp32_truth(mf, model, shapes, batch, device, phase) if truth and dtype != torch.float32 else {}
    # Decode calls are routed by context length, which the bench knows (reading it from
    # cache_position would cost a device sync per step).
    context = {"len": 0}
    length_of = (lambda args, kwargs: context["len"]) if phase == "decode" else None
    gen = _GenerationBench(mf, inputs, states, generate, device, dtype, context, recipe,
                           generate_reps) if generate else None
    # A decode step advances its cache: every timed run starts from the same state.
    reset = {t: states[t].restore if phase == "decode" else None for t in shapes}
    rows: list[dict[str, Any]] = []
    with torch.no_grad():
        for t in shapes:
            rows.append(_measure("eager", lambda t=t: call(model, inputs[t]), device, 0.0, t, reset[t]))
            states[t].restore()
            if t in exact:
                rows[-1]["rel_error_vs_fp32"] = rel_error(refs[t].float(), exact[t])
                if gen:
                    gen.eager_vs_fp32[t] = rows[-1]["rel_error_vs_fp32"]
        if gen:
            gen.run("eager", model)
        fast = apply(model, recipe, length_of=length_of)
        for t in shapes:
            context["len"] = t
            rows.append(_advisor_row(fast, inputs[t], states[t], refs[t], exact.get(t), device, dtype, t,
                                     reset[t]))
        if gen:
            gen.run("advisor", fast)
        result.applied = fast.summary()
        advisor_ms = {r["shape"]: r["ms"] for r in rows if r["variant"] == "advisor"}
        for t in shapes if ablate or alone else ():
            context["len"] = t
            bucket = recipe.bucket_for(t)
            if bucket is None:
                continue

            def time_plan(p: Any, t: int = t, bound: int = bucket.max_len) -> tuple[float, Any]:
                return _time_plan(model, Bucket(bound, p), inputs[t], states[t], device, length_of, reset[t])
            if ablate and advisor_ms.get(t) is not None:
                result.ablation += ablation_rows(t, bucket.plan, advisor_ms[t], time_plan,
                                                 fast.applied_sites(bucket.max_len), repeats)
            if alone:
                result.alone += alone_rows(t, bucket.plan, time_plan, repeats)
        for mode in compile_modes:
            torch._dynamo.reset()
            compiled = torch.compile(model, mode=None if mode == "default" else mode)
            for t in shapes:
                try:
                    _, first = timed_call(lambda t=t, c=compiled: call(c, inputs[t]), device)
                    rows.append(_measure(f"torch.compile[{mode}]", lambda t=t, c=compiled: call(c, inputs[t]),
                                         device, first, t, reset[t]))
                except Exception as exc:  # e.g. a mode that cannot trace this model's cache
                    rows.append({"shape": t, "variant": f"torch.compile[{mode}]", "ms": None,
                                 "error": _one_line(exc)})
                states[t].restore()
            if gen:
                gen.run(f"torch.compile[{mode}]", compiled)
        torch._dynamo.reset()
    result.rows = _with_floor(_with_speedups(rows, "ms"), "ms", _floor_ms(floors))
    result.generation = _with_floor(_with_speedups(gen.rows, "ms_per_token"), "ms_per_token",
                                    _floor_ms(floors, read_only=True)) if gen else []
    return result


def _floors(model: torch.nn.Module, inputs: dict[int, Inputs], states: dict[int, Snapshot],
            device: torch.device, dtype: torch.dtype, phase: str) -> dict[int, Floor | str]:
    """Each shape's floor (profile/floor.py), the state each pass moved restored; where a
    model's forward cannot be measured that way, the reason instead (the bench goes on)."""
    out: dict[int, Floor | str] = {}
    try:
        ceilings = load_or_measure(device)
    except Exception as exc:  # noqa: BLE001 - a report column, never the bench's failure
        return {t: f"ceilings: {_one_line(exc)}" for t in inputs}
    decode = phase == "decode"
    for t, x in inputs.items():
        try:
            out[t] = floor(model, x, ceilings, dtype, decode=decode, context_len=t if decode else 0,
                           capacity=cache_capacity(x) if decode else None)
        except Exception as exc:  # noqa: BLE001
            out[t] = _one_line(exc)
        states[t].restore()
    return out


def _floor_rows(floors: dict[int, Floor | str]) -> list[dict[str, Any]]:
    return [{"shape": t, **(f.to_json() if isinstance(f, Floor) else {"error": f})}
            for t, f in floors.items()]


def _floor_ms(floors: dict[int, Floor | str], read_only: bool = False) -> dict[int, float]:
    return {t: f.read_ms if read_only else f.ms for t, f in floors.items() if isinstance(f, Floor)}


def _with_floor(rows: list[dict[str, Any]], key: str, floor_ms: dict[int, float]) -> list[dict[str, Any]]:
    """Each row's `key` as a multiple of its shape's floor ("x_floor")."""
    for r in rows:
        f = floor_ms.get(r["shape"])
        r["x_floor"] = r[key] / f if r.get(key) and f else None
    return rows


def _advisor_row(fast: Any, x: Inputs, state: Snapshot, ref: torch.Tensor, exact: torch.Tensor | None,
                 device: torch.device, dtype: torch.dtype, t: int, reset: Any = None) -> dict[str, Any]:
    """The recipe's latency at one shape, its outputs checked against eager's first."""
    out, first = timed_call(lambda: call(fast, x), device)
    state.restore()
    row = _measure("advisor", lambda: call(fast, x), device, first, t, reset)
    state.restore()
    got = first_tensor(out)
    verdict = judge(got, ref, dtype, exact)
    row.update(max_error=verdict.max_error, rel_error=verdict.rel_error, matches_eager=verdict.ok,
               verdict=verdict.detail)
    if verdict.rel_error_vs_fp32 is not None:
        row["rel_error_vs_fp32"] = verdict.rel_error_vs_fp32
    return row


def _time_plan(model: torch.nn.Module, bucket: Bucket, x: Inputs, state: Snapshot, device: torch.device,
               length_of: Any, reset: Any) -> tuple[float, dict[str, list[str]]]:
    """Median ms of `model` with `bucket`'s plan applied as that bucket (traced as the
    recipe's own bucket is: a one-token bucket with static shapes), its first call
    compiling untimed; and the modules of its sites applied, per family."""
    try:
        fast = apply(model, Recipe(buckets=(bucket,)), length_of=length_of)
        timed_call(lambda: call(fast, x), device)
        state.restore()
        ms = median_ms(lambda: call(fast, x), device, reset=reset)
        return ms, fast.applied_sites(bucket.max_len)
    finally:
        state.restore()


def _with_speedups(rows: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """Rows sorted by shape, eager first, each with its speed-up over eager's `key`."""
    eager = {r["shape"]: r[key] for r in rows if r["variant"] == "eager"}
    for r in rows:
        r["speedup_vs_eager"] = eager[r["shape"]] / r[key] if r[key] else None
    return sorted(rows, key=lambda r: (r["shape"], r["variant"] != "eager"))


def _warmup_steps(recipe: Recipe, context_len: int, steps: int) -> list[int]:
    """The first few steps, plus the first step routed to each other bucket (so no
    bucket compiles inside a timed loop as the context grows)."""
    warm, seen = list(range(min(3, steps))), set()
    for i in range(steps):
        bucket = recipe.bucket_for(context_len + i)
        key = None if bucket is None else bucket.max_len
        if key not in seen:
            seen.add(key)
            warm += [] if i in warm else [i]
    return warm


class _GenerationBench:
    """Greedy generation of `steps` tokens from each shape's decode inputs, one variant at
    a time: eager's runs first and is the reference the others are compared with."""

    def __init__(self, mf: ModelFile, inputs: dict[int, Inputs], states: dict[int, Snapshot], steps: int,
                 device: torch.device, dtype: torch.dtype, context: dict[str, int], recipe: Recipe,
                 reps: int):
        for t, x in inputs.items():
            check_capacity(mf, x, t, steps)
        self.mf, self.inputs, self.states, self.steps = mf, inputs, states, steps
        self.device, self.dtype, self.context, self.recipe, self.reps = device, dtype, context, recipe, reps
        self.advance = {t: advancer(mf, x) for t, x in inputs.items()}
        self.refs: dict[int, Generation] = {}
        self.rows: list[dict[str, Any]] = []
        self.eager_vs_fp32: dict[int, float] = {}  # eager's one-step error vs fp32, per shape

    def _generate(self, model: Any, t: int) -> Generation:
        def on_step(i: int) -> None:
            self.context["len"] = t + i  # the context grows by one token per step

        return timed_greedy(model, self.inputs[t], self.steps, self.advance[t], self.device,
                            self.states[t].restore, on_step=on_step,
                            warmup=_warmup_steps(self.recipe, t, self.steps), reps=self.reps)

    def run(self, variant: str, model: Any) -> None:
        for t in self.inputs:
            try:
                gen = self._generate(model, t)
            except AdvisorError:
                raise
            except Exception as exc:
                if variant == "eager":
                    raise ModelFileError(f"{self.mf.path}: greedy generation from context {t} failed: "
                                         f"{_one_line(exc)}") from None
                # A torch.compile mode that cannot run this loop is a result, not a crash.
                self.states[t].restore()
                self.rows.append({"shape": t, "variant": variant, "new_tokens": self.steps,
                                  "ms_per_token": None, "tokens_per_s": None,
                                  "error": _one_line(exc), "matches_eager": False})
                continue
            assert gen.loop_ms is not None
            row: dict[str, Any] = {
                "shape": t, "variant": variant, "new_tokens": self.steps,
                "ms_per_token": gen.loop_ms / self.steps,
                "tokens_per_s": gen.tokens.shape[0] * self.steps * 1e3 / gen.loop_ms if gen.loop_ms else None}
            if variant == "eager":
                self.refs[t] = gen
            else:
                base = self.eager_vs_fp32.get(t)
                bound = None if base is None else apart_bound(base)
                row.update(compare(gen, self.refs[t], self.dtype, bound))
            row["tokens"] = gen.tokens.tolist()
            self.rows.append(row)


def to_json(r: BenchResult) -> dict[str, Any]:
    return {"schema_version": SCHEMA_VERSION, "kind": "advisor.bench", "environment": r.environment,
            "git_sha": source_revision(), "meta": r.meta, "rows": r.rows, "generation": r.generation,
            "applied": r.applied, "ablation": r.ablation, "alone": r.alone,
            "floors": r.floors}
