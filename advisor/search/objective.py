"""One trial: build the plan → verify it against the unfused model → time it.

Worker side (runs in a worker process, advisor/search/worker.py): `run_trial` applies the
plan with `advisor.runtime.apply.apply`, runs it at the bucket's representative length
(this compiles it), checks it against the unfused model there and at a second, fresh
length inside the bucket (`advisor.verify.judge`: within the whole-model tolerance of
eager, or for bf16/fp16 at least as accurate as eager against an fp32 copy of the model;
a NaN the reference does not have fails as `nan`), then times it (`advisor.timing.median_ms`).
A failure is returned as a classified reason (`FAILURES`), never as an infinite time: Optuna takes ±inf as a
COMPLETE value (RELIABILITY.md), so the parent raises `TrialFailed` and the trial is FAIL.

A plan whose fusions all stayed unfused at every site (each site is confirmed before use,
advisor/runtime/rewrite.py) is not a failure: it is a slower spelling of the baseline, kept
with the user attr `note`.

Fault injection (**test-only**): `ADVISOR_FAULT="family:kind[,family:kind]"` makes a worker
misbehave in trials whose plan applied `family` at some site. kind: compile | resources |
oom | raise (the forward raises), wrong (values off), nan (part of the output left NaN),
exit (the worker dies with os._exit), hang (never returns).
"""

from __future__ import annotations

import gc
import os
import random
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import optuna
import torch
from optuna.trial import FrozenTrial, TrialState

from advisor.kernels._triton import pdl_supported
from advisor.loader import (
    ModelFile,
    build,
    call,
    checked_forward,
    first_tensor,
    inputs_for,
    load_model_file,
)
from advisor.runtime.plan import Plan
from advisor.runtime.recipe import plan_from_json
from advisor.search.space import BucketSpace, canonical_plan_json, suggest
from advisor.state import Snapshot
from advisor.verify import fp32_copy, judge, needs_truth

if TYPE_CHECKING:
    from advisor.search.study import TuneOptions
    from advisor.search.worker import WorkerPool

OWNER = f"{socket.gethostname()}:{os.getpid()}"  # who runs a trial (stale-trial recovery)

FAILURES = ("compile_error", "out_of_resources", "mismatch", "nan", "crash", "timeout", "oom",
            "error")
Stage = Callable[[str], None]


class TrialFailed(Exception):
    """A trial failed for a classified reason (one of FAILURES)."""

    def __init__(self, reason: str, message: str = ""):
        super().__init__(f"{reason}: {message}" if message else reason)
        self.reason, self.message = reason, message


# ---- classification ----------------------------------------------------------------

# Exception class names (anywhere in the cause chain) and message fragments -> reason.
_BY_NAME = (("OutOfMemoryError", "oom"), ("OutOfResources", "out_of_resources"),
            ("CompilationError", "compile_error"), ("PTXASError", "compile_error"),
            ("CompileTimeAssertionFailure", "compile_error"))
# Sticky CUDA errors poison the process: "crash", and the worker is replaced (item 7).
_BY_TEXT = (("out of memory", "oom"), ("out of resource", "out_of_resources"),
            ("illegal memory access", "crash"), ("device-side assert", "crash"),
            ("unspecified launch failure", "crash"), ("misaligned address", "crash"),
            ("an illegal instruction", "crash"))
FATAL = {"crash"}


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    todo: list[BaseException | None] = [exc]
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        todo += [e.__cause__, e.__context__, getattr(e, "inner_exception", None)]
    return seen


def classify(exc: BaseException) -> str:
    """The failure reason of an exception raised while building or running a plan."""
    chain = _chain(exc)
    for e in chain:
        if isinstance(e, TrialFailed):
            return e.reason
    for e in chain:
        names = {c.__name__ for c in type(e).__mro__}
        for name, reason in _BY_NAME:
            if name in names:
                return reason
    text = " ".join(str(e) for e in chain).lower()
    return next((r for frag, r in _BY_TEXT if frag in text), "error")


def one_line(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"[:300]


# ---- worker context ----------------------------------------------------------------


@dataclass
class Context:
    """What a worker loads once: the model file, the unfused model, where it runs."""

    mf: ModelFile
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    batch: int
    faults: dict[str, str]
    phase: str = "prefill"
    fp32: torch.nn.Module | None = None  # the model upcast, built on first need (verify.py)


def parse_faults(text: str) -> dict[str, str]:
    """`"gated_act:wrong,rms_norm:nan"` -> {"gated_act": "wrong", "rms_norm": "nan"}."""
    pairs = (part.split(":", 1) for part in text.split(",") if ":" in part)
    return {fam.strip(): kind.strip() for fam, kind in pairs}


def load_context(path: str, device: str, dtype: torch.dtype, batch: int,
                 phase: str = "prefill") -> Context:
    mf = load_model_file(path)
    dev = torch.device(device)
    model = build(mf, dev, dtype)
    return Context(mf, model, dev, dtype, batch, parse_faults(os.environ.get("ADVISOR_FAULT", "")),
                   phase)


def verify_length(lower: int, length: int, number: int, seed: int) -> int:
    """A second length inside the bucket (lower, length] for the fresh-input check: not the
    bound itself where the bucket allows, and >= 2 (dynamo specialises lengths 0 and 1)."""
    lo, hi = max(lower + 1, 2), length - 1
    if hi < lo:
        return length
    return random.Random(seed * 1_000_003 + number).randint(lo, hi)


def _inputs(ctx: Context, length: int, seed: int, dtype: torch.dtype | None = None) -> Any:
    torch.manual_seed(seed)  # model files that draw from the global generator get fresh values
    # Fresh inputs every time (for decode: a fresh KV cache), so a step's in-place cache
    # writes never leak into another check (item 13).
    return inputs_for(ctx.mf, length, ctx.batch, ctx.device, phase=ctx.phase, dtype=dtype or ctx.dtype)


def _reset(ctx: Context, inputs: Any) -> Callable[[], Any] | None:
    """For decode: puts the step's inputs (its KV cache) back before each timed run, so
    repeated steps neither run off the end of the cache nor time different work."""
    return Snapshot(inputs).restore if ctx.phase == "decode" else None


def _forward(model: Any, inputs: Any) -> torch.Tensor:
    with torch.no_grad():  # not inference_mode: state (a KV cache) must stay usable by traces
        return first_tensor(call(model, inputs))


def _truth(ctx: Context, length: int, seed: int) -> torch.Tensor | None:
    """The fp32 model's output on the same inputs (half-precision models only)."""
    if not needs_truth(ctx.dtype):
        return None
    if ctx.fp32 is None:
        ctx.fp32 = fp32_copy(ctx.model)
    return _forward(ctx.fp32, _inputs(ctx, length, seed, torch.float32)).float()


def _verify(out: torch.Tensor, ref: torch.Tensor, ctx: Context, length: int, seed: int) -> float:
    """max |out − ref| when `out` passes (advisor/verify.py), else TrialFailed."""
    verdict = judge(out, ref, ctx.dtype, _truth(ctx, length, seed))
    if not verdict.ok:
        raise TrialFailed(verdict.reason, verdict.detail)
    return verdict.max_error


def _applied(summary: list[dict[str, Any]]) -> tuple[dict[str, int], list[str]]:
    rows = [r for r in summary if r["family"] != "(all)"]
    return {r["family"]: r["applied"] for r in rows}, sorted({u for r in rows for u in r["unfused"]})


def _fault(faults: dict[str, str], applied: dict[str, int]) -> Callable[[torch.Tensor], torch.Tensor]:
    """Test-only fault hook (module docstring): identity unless a faulty family applied."""
    kind = next((k for fam, k in faults.items() if applied.get(fam)), None)
    # Named like the real exceptions (triton's, torch's): classify() reads class names.
    raising = {"compile": "CompilationError", "resources": "OutOfResources",
               "oom": "OutOfMemoryError", "raise": "InjectedFault"}

    def hook(out: torch.Tensor) -> torch.Tensor:
        if kind in raising:
            raise type(raising[kind], (RuntimeError,), {})(f"injected fault ({kind})")
        if kind == "exit":
            os._exit(3)
        if kind == "hang":
            time.sleep(10**6)
        if kind == "wrong":
            return out * 1.5 + 0.1
        if kind == "nan":
            out = out.clone(memory_format=torch.contiguous_format)
            out.view(-1)[out.numel() // 2:] = float("nan")  # an unwritten tail
        return out

    return hook


def release(device: torch.device) -> None:
    """Drop compiled graphs and cached memory between trials (item 10: flat peak memory)."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def plan_of(obj: dict[str, Any]) -> Plan:
    """A trial's plan from its JSON (`Plan.to_json`), every plan option included."""
    return plan_from_json(obj, "$.plan")


def run_trial(ctx: Context, req: dict[str, Any], stage: Stage) -> dict[str, Any]:
    """Build → verify → time one plan; the answer the worker sends back."""
    from advisor.runtime.apply import apply
    from advisor.timing import median_ms

    release(ctx.device)
    # Each side gets its own copy of the inputs: a forward that writes into them (in place)
    # cannot leak into the other side's check (item 13).
    length, seed = req["length"], req["seed"]
    ref = _forward(ctx.model, _inputs(ctx, length, seed))
    fast = apply(ctx.model, plan_of(req["plan"]))
    out = _forward(fast, _inputs(ctx, length, seed))  # compiles the bucket's graph
    stage("compiled")
    applied, unfused = _applied(fast.summary())
    hook = _fault(ctx.faults, applied)
    err = _verify(hook(out), ref, ctx, length, seed)
    length, seed = req["verify_len"], req["verify_seed"]  # fresh values, another length
    ref = _forward(ctx.model, _inputs(ctx, length, seed))
    err = max(err, _verify(hook(_forward(fast, _inputs(ctx, length, seed))), ref, ctx, length, seed))
    stage("verified")
    main = _inputs(ctx, req["length"], req["seed"])
    with torch.no_grad():
        ms = median_ms(lambda: call(fast, main), ctx.device, warmup_ms=req["warmup_ms"],
                       rep_ms=req["rep_ms"], reset=_reset(ctx, main))
    return {"ok": True, "ms": ms, "max_error": err, "applied": sum(applied.values()),
            "applied_families": {f: n for f, n in applied.items() if n},
            "unfused": unfused[:20]}


def measure(ctx: Context, req: dict[str, Any], stage: Stage) -> dict[str, Any]:
    """Re-time several plans in one run, interleaved over `rounds` (the unfused baseline
    is one of them): median per plan, None where a plan failed."""
    from advisor.runtime.apply import apply
    from advisor.timing import median_ms

    release(ctx.device)
    main = _inputs(ctx, req["length"], req["seed"])
    reset = _reset(ctx, main)
    models: list[Any] = []
    for obj in req["plans"]:
        try:
            fast = apply(ctx.model, plan_of(obj))
            _forward(fast, main)
            models.append(fast)
        except Exception:
            models.append(None)
        stage("compiled")
    times: list[list[float]] = [[] for _ in models]
    for _ in range(req["rounds"]):
        for i, fast in enumerate(models):
            if fast is not None:
                with torch.no_grad():
                    times[i].append(median_ms(lambda f=fast: call(f, main), ctx.device,
                                              warmup_ms=req["warmup_ms"], rep_ms=req["rep_ms"],
                                              reset=reset))
    return {"ok": True, "ms": [sorted(t)[len(t) // 2] if t else None for t in times]}


def describe(ctx: Context, req: dict[str, Any], stage: Stage) -> dict[str, Any]:
    """The bucket's plan space (captured at its bound) and the unfused time there."""
    from advisor.analyze import costs_from
    from advisor.profile import load_or_measure
    from advisor.search.space import describe_bucket
    from advisor.timing import median_ms

    release(ctx.device)
    inputs = _inputs(ctx, req["length"], req["seed"])
    checked_forward(ctx.mf, ctx.model, inputs)  # a raising forward: one clear line (ERR)
    costs = costs_from(load_or_measure(ctx.device))
    space = describe_bucket(ctx.model, inputs, costs, req["length"], req["lower"],
                            ctx.device.type == "cuda", pdl_supported(ctx.device))
    release(ctx.device)
    with torch.no_grad():
        ms = median_ms(lambda: call(ctx.model, inputs), ctx.device, warmup_ms=req["warmup_ms"],
                       rep_ms=req["rep_ms"], reset=_reset(ctx, inputs))
    return {"ok": True, "space": space.to_json(), "unfused_ms": ms}


def record(ctx: Context, req: dict[str, Any], stage: Stage) -> dict[str, Any]:
    """The kernels each bucket of the tuned recipe compiles (its `kernels` field:
    runtime/record.py), recorded in this worker at `record.bounds`' lengths."""
    from advisor.runtime.recipe import recipe_from_json
    from advisor.runtime.record import bounds, record_model_file

    if ctx.device.type != "cuda":
        return {"ok": True, "kernels": None}
    recipe = recipe_from_json(req["recipe"])
    release(ctx.device)
    torch.manual_seed(req["seed"])
    done = record_model_file(ctx.mf, ctx.model, recipe, bounds(recipe), batch=ctx.batch,
                             device=ctx.device, dtype=ctx.dtype, phase=ctx.phase)
    release(ctx.device)
    return {"ok": True, "kernels": done.kernels}


HANDLERS: dict[str, Callable[[Context, dict[str, Any], Stage], dict[str, Any]]] = {
    "trial": run_trial, "measure": measure, "describe": describe, "record": record,
}


# ---- parent side: an Optuna objective that hands the plan to a worker ----------------

# Failures that the same plan would meet again; crash, timeout, oom and error may not.
REPEATABLE = {"compile_error", "out_of_resources", "mismatch", "nan"}


def _same_plan(study: optuna.Study, plan: Plan) -> FrozenTrial | None:
    """An earlier trial of exactly this plan whose outcome stands (sampling repeats itself
    in small spaces; a build + verify + time is not free)."""
    want = canonical_plan_json(plan.to_json())  # a journal's older config spellings match
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.FAIL)):
        stored = t.user_attrs.get("plan")
        if isinstance(stored, dict) and canonical_plan_json(stored) == want and (
                t.state == TrialState.COMPLETE or t.user_attrs.get("failure") in REPEATABLE):
            return t
    return None


def _repeat(trial: optuna.Trial, same: FrozenTrial) -> float:
    trial.set_user_attr("repeat_of", same.number)
    for key in ("max_error", "applied", "applied_families", "unfused", "failure", "error", "note"):
        if key in same.user_attrs:
            trial.set_user_attr(key, same.user_attrs[key])
    if same.state == TrialState.FAIL:
        raise TrialFailed(same.user_attrs["failure"], f"same plan as trial {same.number}")
    return float(same.value)


def make_objective(space: BucketSpace, pool: WorkerPool, options: TuneOptions,
                   deadline: float | None, run_id: str) -> Callable[[optuna.Trial], float]:
    """Trial -> plan -> a worker builds, verifies and times it -> ms, or TrialFailed."""
    def objective(trial: optuna.Trial) -> float:
        trial.set_user_attr("owner", OWNER)
        trial.set_user_attr("run", run_id)
        plan = suggest(trial, space)
        trial.set_user_attr("plan", plan.to_json())
        same = _same_plan(trial.study, plan)
        if same is not None:
            return _repeat(trial, same)
        req = {"op": "trial", "plan": plan.to_json(), "length": space.length,
               "verify_len": verify_length(space.lower, space.length, trial.number, options.seed),
               "seed": options.seed, "verify_seed": options.seed + 1 + trial.number,
               "warmup_ms": options.warmup_ms, "rep_ms": options.rep_ms}
        with pool.lease() as worker:
            trial.set_user_attr("worker", worker.index)
            res = worker.request(req, options.trial_timeout_s, deadline)
        if not res["ok"]:
            trial.set_user_attr("failure", res["reason"])
            trial.set_user_attr("error", res.get("message", ""))
            raise TrialFailed(res["reason"], res.get("message", ""))
        for key in ("max_error", "applied", "unfused", "applied_families"):
            if key in res:
                trial.set_user_attr(key, res[key])
        if plan.fusions and res["applied"] == 0:
            trial.set_user_attr("note", "no fusion applied at any site: the graph-wide passes alone")
        return float(res["ms"])

    return objective
