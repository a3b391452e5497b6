"""Apply a recipe to any model: per-bucket rewritten graphs, dispatched by input length.

`apply(model, recipe)` returns an `AdvisedModel` wrapping the user's module. Each call is
routed to the bucket whose bound is the smallest >= the input's sequence length (beyond
the largest bucket: the recipe's `beyond_largest`, "largest" by default, or unfused).
Each bucket is one `torch.compile(..., dynamic=True)` whose backend rewrites the aten graph
with that bucket's plan and runs it as-is — so lengths inside a bucket reuse one graph and
do not recompile (counted in `compiles`); buckets whose plans are equal share that graph
(one trace for all their lengths: cold start). A bucket of one token (routed by tokens, the
default) holds one length, so it is traced with static shapes first (`dynamic=None`): the
symbolic trace was about half of a first call (8 layers, CPU: 12.0 s against 6.6 s), and
only another batch size or a growing cache would recompile it, once, dynamic. Calls run
under `torch.no_grad()`: this is an inference tool.

Nothing global is patched: the wrapper holds the original module (`.original`, or
`.remove()`); the only change to the module is that merged weights are laid out back to
back (same values).
"""

from __future__ import annotations

import itertools
import os
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from advisor.errors import RecipeError
from advisor.graph.capture import aten_backend
from advisor.kernels._triton import programmatic_launch, warm_start, warm_wait
from advisor.runtime import precompile
from advisor.runtime.cudagraph import GraphCache
from advisor.runtime.outside_graph import entered
from advisor.runtime.plan import UNFUSED, Plan
from advisor.runtime.recipe import Bucket, Recipe, fingerprint
from advisor.runtime.rewrite import RewriteReport, rewrite
from advisor.runtime.weights import arrange


@dataclass
class BucketState:
    """What one bucket compiled and how it went."""

    plan: Plan
    fn: Callable[..., Any] | None = None
    compiles: int = 0
    reports: list[RewriteReport] = field(default_factory=list)
    graphs: GraphCache | None = None
    first_call_s: float = 0.0  # the bucket's first call: trace, rewrite, warm-ups, capture
    trace_s: float = 0.0  # of which before the first rewrite: dynamo's trace and AOTAutograd
    started: float | None = None  # perf_counter at the first call's start, while it runs
    untraceable: str = ""  # why dynamo could not trace the model: the bucket runs it unfused


def sequence_length(args: tuple, kwargs: dict) -> int:
    """Tokens per sequence: dim 1 of the first tensor argument with >= 2 dims
    (input_ids (B, T), hidden states (B, T, D)); else dim 0."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            return int(value.shape[1] if value.dim() >= 2 else value.shape[0])
    raise TypeError("advisor: cannot find a tensor input to read the sequence length from")


RECOMPILE_LIMIT = 64  # compiles of one apply's entry (`_entry`) before dynamo runs it eager
_ENTRIES = itertools.count()
_applies = 0  # entries made in this process (`_entry`)
PER_APPLY = 16  # compiles one apply may add to a frame past a graph break (buckets x shapes)


def _trace_config() -> Any:
    """Dynamo settings for our traces, scoped to our calls: keep Python floats (eps,
    scales) as constants so patterns see them, instead of lifting them to graph inputs;
    and, each bucket being its own compile of the same forward, allow them all (and a few
    specialisations each) before dynamo falls back to eager. Costs ~25 µs, so it wraps
    only calls that may trace — never CUDA-graph replays.

    The limits grow with the applies made (PER_APPLY each): frames past a graph break
    inside the model are its class's own code, not the entry's, so every apply of that
    class adds its compiles to one count there (each apply's backend is another, which
    dynamo counts as a recompile); with a fixed limit, the applies past it ran those frames
    eager, unfused. They grow with the backends dynamo holds (until torch._dynamo.reset(),
    which the tuner calls between trials), so a recompile storm within one apply stops near
    RECOMPILE_LIMIT in a fresh state, and later by PER_APPLY per backend still held."""
    cfg = torch._dynamo.config
    settings: dict[str, Any] = {k: True for k in ("specialize_float",) if hasattr(cfg, k)}
    held = getattr(torch._dynamo.eval_frame, "cached_backends", None)
    limit = RECOMPILE_LIMIT + PER_APPLY * (len(held) if isinstance(held, dict) else _applies)
    settings.update({k: limit for k in ("recompile_limit", "cache_size_limit") if hasattr(cfg, k)})
    settings.update({k: max(limit, getattr(cfg, k)) for k in ("accumulated_recompile_limit",
                                                              "accumulated_cache_size_limit")
                     if hasattr(cfg, k)})
    return cfg.patch(**settings)


def _entry(model: torch.nn.Module) -> Callable[..., Any]:
    """`model(...)` behind a code object of its own, which dynamo's cache and recompile
    count are per: compiling the module itself shares its class's `forward` code across
    every bucket of every model of that class applied in the process, and past
    `recompile_limit` dynamo runs the frame eager, unfused, with no error (seen with many
    applies of one class). The module's own frames are inlined into this one's trace."""
    def call_model(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    # a new code object, the same code, and a name of its own: dynamo also keeps state per
    # (file, line, name) — automatic dynamic shapes — which one name would share across
    # applies (one apply's sizes deciding another's trace)
    global _applies
    _applies += 1
    name = f"advised_call_{next(_ENTRIES)}"
    code = call_model.__code__
    names = {"co_name": name, **({"co_qualname": name} if hasattr(code, "co_qualname") else {})}  # 3.11+
    call_model.__code__ = code.replace(**names)
    return call_model


def _traced(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a torch.compile'd module) called under `_trace_config`."""
    def call(*args: Any, **kwargs: Any) -> Any:
        with _trace_config():
            return fn(*args, **kwargs)

    return call


def _model_mismatch(recorded: dict[str, Any], model: torch.nn.Module) -> str:
    """Why `model` is not the one the recipe was tuned on ("" where it is, or the recipe
    does not say: a plan file): its parameters' names and shapes differ. Dtypes count
    only where a cast to the tuned dtype would not make them equal."""
    want = recorded.get("fingerprint")
    if not want or fingerprint(model) == want:
        return ""
    dtype = getattr(torch, str(recorded.get("dtype", "")), None)
    if isinstance(dtype, torch.dtype) and fingerprint(model, dtype) == want:
        return ""
    return (f"recipe may have been tuned for another model ({recorded.get('source', '?')}: "
            "parameter names, shapes or dtypes differ)")


def _env_mismatch(recorded: dict[str, Any]) -> list[str]:
    if not recorded:
        return []
    from advisor.env import environment

    device = "cuda" if torch.cuda.is_available() else "cpu"
    here = environment(torch.device(device))
    keys = ("device_name", "capability", "torch", "triton", "advisor")
    return [f"{k}: recipe {recorded.get(k)!r} != here {here.get(k)!r}"
            for k in keys if k in recorded and recorded.get(k) != here.get(k)]


class AdvisedModel(torch.nn.Module):
    """The user's model with a recipe's plans applied per length bucket."""

    def __init__(self, model: torch.nn.Module, recipe: Recipe, *,
                 length_of: Callable[..., int] | None = None,
                 precompiling: precompile.Precompile | None = None, strict: bool = False):
        super().__init__()
        self.original = model
        self.strict = strict  # a model dynamo cannot trace raises instead of running unfused
        self.recipe = recipe
        self.length_of = length_of or sequence_length
        self.buckets = _bucket_states(recipe)
        self._unfused = BucketState(UNFUSED)
        self._confirmed: dict[tuple, Any] = {}  # site confirmations shared across buckets
        self.precompiling = precompiling  # the recipe's kernels, compiling in other processes

    def _state(self, bucket: Bucket | None) -> BucketState:
        return self._unfused if bucket is None else self.buckets[bucket.max_len]

    def _compile(self, state: BucketState, bound: int | None) -> Callable[..., Any]:
        one_length = bound == 1 and self.length_of is sequence_length
        # dynamo keeps every backend it was given until torch._dynamo.reset(): through
        # strong references the backend would keep this wrapper, the user's model and its
        # weights alive after the user drops them
        owner, state_ref = weakref.ref(self), weakref.ref(state)

        def on_graph(gm: fx.GraphModule, params: dict[str, str], example: list[Any]) -> Callable[..., Any]:
            me, st = owner(), state_ref()
            if me is None or st is None:  # only reached through the wrapper, which holds both
                raise RuntimeError("advisor: a trace of an advised model that was freed")
            st.compiles += 1
            if st.started is not None and not st.trace_s:
                st.trace_s = time.perf_counter() - st.started
            warm_wait()  # Triton's setup, started by `apply`, done before the first compile
            if me.precompiling is not None and bound is not None:
                me.precompiling.wait(bound)  # this bucket's kernels: cache reads from here
            report = rewrite(gm, params, st.plan, me._confirmed)
            for group in report.merged_weights:
                arrange(me.original, group)
            st.reports.append(report)
            return entered(gm.forward)  # counted in captures (outside_graph.Deferred.sound)

        return torch.compile(_entry(self.original), backend=aten_backend(self.original, on_graph),
                             dynamic=None if one_length else True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        bucket = self.recipe.bucket_for(self.length_of(args, kwargs))
        state = self._state(bucket)
        if not state.plan.fusions and not state.plan.cuda_graph:
            with torch.no_grad():
                return self.original(*args, **kwargs)
        first = state.fn is None
        if first:
            state.fn = _traced(self._compile(state, bucket.max_len if bucket else None))
            if state.plan.cuda_graph and torch.cuda.is_available():
                state.graphs = GraphCache(state.fn)  # replays never enter dynamo
        start = time.perf_counter()
        state.started = start if first else None
        compiled_before = state.compiles
        with torch.no_grad(), programmatic_launch(state.plan.pdl):
            try:
                if state.graphs is not None:  # captures launch (and record) PDL; replays launch nothing
                    out = state.graphs(*args, **kwargs)
                else:
                    out = state.fn(*args, **kwargs)
            except Exception as exc:
                if not first:
                    raise
                state.fn = state.graphs = None  # the next call starts anew: a first call again
                # a graph before a graph break already ran (in-place writes made): running the
                # model again would make them twice
                if self.strict or not _untraceable(exc) or state.compiles > compiled_before:
                    raise
                out = self._run_unfused(state, bucket, exc, args, kwargs)
        if first:  # to the first result: the device's work included
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            state.first_call_s = time.perf_counter() - start
            state.started = None
        return out

    def _run_unfused(self, state: BucketState, bucket: Bucket | None, exc: Exception,
                     args: tuple, kwargs: dict) -> Any:
        """Dynamo could not trace the model (FALLBACK), before any graph of it ran: the
        bucket runs the original from now on, with one warning. An input the model itself
        refuses raises from here, as it would without advisor (and the next call tries the
        trace again). Python side effects of the failed trace before the failure (a
        counter bumped in forward) are not undone."""
        out = self.original(*args, **kwargs)
        reason = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), type(exc).__name__)
        state.untraceable = f"{type(exc).__name__}: {reason}"[:300]
        state.fn, state.graphs, state.reports = self.original, None, []
        where = f"the bucket up to {bucket.max_len} tokens" if bucket else "lengths past every bucket"
        warnings.warn(f"advisor: torch.compile cannot trace this model ({state.untraceable}); "
                      f"{where} runs unfused", stacklevel=3)
        return out

    def remove(self) -> torch.nn.Module:
        """The original module (apply is reversible: nothing global was patched)."""
        return self.original

    def applied_sites(self, bound: int) -> dict[str, list[str]]:
        """family -> the modules of its sites applied in the bucket of this bound."""
        state = self.buckets[bound]
        out: dict[str, list[str]] = {fam: [] for fam in state.plan.fusions}
        for s in (s for r in state.reports for s in r.sites if s.applied):
            out.setdefault(s.family, []).append(s.module)
        return out

    def summary(self) -> list[dict[str, Any]]:
        """Per bucket and family: sites applied / left unfused (with reasons), launches
        per forward before/after, compiles."""
        rows = []
        for bound, state in self.buckets.items():
            for fam in state.plan.fusions:
                sites = [s for r in state.reports for s in r.sites if s.family == fam]
                rows.append({
                    "bucket": bound, "family": fam,
                    "applied": sum(s.applied for s in sites),
                    "unfused": sorted({f"{s.module}: {s.reason}" for s in sites if not s.applied}),
                    "notes": sorted({f"{s.module}: {s.note}" for s in sites if s.note}),
                })
            rows.append({
                "bucket": bound, "family": "(all)", "compiles": state.compiles,
                # buckets with this one's plan run its graph (`_bucket_states`): the counts
                # and times of this row are theirs too
                "graph_shared_with": [b for b, other in self.buckets.items()
                                      if other is state and b != bound],
                "launches_before": sum(r.launches_before for r in state.reports),
                "launches_after": sum(r.launches_after for r in state.reports),
                "in_place_writes": sum(r.in_place_writes for r in state.reports),
                "repeats_merged": sum(r.repeats_merged for r in state.reports),
                "identity_copies_dropped": sum(r.identity_copies_dropped for r in state.reports),
                "increments_batched": sum(r.increments_batched for r in state.reports),
                "shape_only_memoized": sum(r.shape_only_memoized for r in state.reports),
                "causal_sdpa": sum(r.causal_sdpa for r in state.reports),
                "outputs_outside_graph": sum(r.outputs_outside_graph for r in state.reports),
                # softmaxes no attention pattern read, by module (attention fusion on)
                "softmax_left": sorted({m for r in state.reports for m in r.softmax_left}),
                # the bucket's first call (cold start); the rewrites' and confirmations'
                # host time, summed over every compile of the bucket (a later length's
                # recompile too); the first call less its trace and rewrite is warm-ups,
                # capture and the first run
                "first_call_s": round(state.first_call_s, 3),
                "trace_s": round(state.trace_s, 3),
                "rewrite_s": round(sum(r.seconds for r in state.reports), 3),
                "confirm_s": round(sum(r.confirm_seconds for r in state.reports), 3),
                "cuda_graphs": len(state.graphs.graphs) if state.graphs else None,
                # per live graph, the outputs its capture kept outside (0 after a recapture
                # that found a placeholder read: outside_graph.Deferred.sound)
                "outside_per_graph": ([len(g.deferred.cuts) for g in state.graphs.graphs.values()]
                                      if state.graphs else None),
                "cuda_graph_failures": state.graphs.failures if state.graphs else None,
                **({"untraceable": state.untraceable} if state.untraceable else {}),
                # the recipe's kernels compiled in other processes (precompile.py), and how
                # long the first call waited for them
                **({"precompiled": self.precompiling.counts(bound),
                    "precompile_wait_s": round(self.precompiling.waited_s.get(bound, 0.0), 3)}
                   if self.precompiling is not None else {}),
            })
        return rows


def _untraceable(exc: Exception) -> bool:
    """An error of dynamo's trace (fake tensors, an unsupported construct), not of our
    rewrite (BackendCompilerFailed: our backend's own errors surface) nor of the model's
    eager code."""
    from torch._dynamo import exc as dynamo_exc

    return (isinstance(exc, dynamo_exc.TorchDynamoException)
            and not isinstance(exc, dynamo_exc.BackendCompilerFailed))


def _bucket_states(recipe: Recipe) -> dict[int, BucketState]:
    """One state per bucket bound; buckets past one token whose plans are equal share one
    (one symbolic trace, rewrite and set of confirmations serves all their lengths, as it
    serves every length inside one bucket): a tuned recipe often gives 128, 512 and 2048
    tokens the same plan, and each compile is seconds of cold start. The one-token bucket
    keeps its own: it is traced with static shapes."""
    states: dict[int, BucketState] = {}
    for b in recipe.buckets:
        same = [s for bound, s in states.items() if bound != 1 and b.max_len != 1 and s.plan == b.plan]
        states[b.max_len] = same[0] if same else BucketState(b.plan)
    return states


def apply(model: torch.nn.Module, recipe: Recipe | Plan, *, strict: bool = False,
          length_of: Callable[..., int] | None = None) -> AdvisedModel:
    """Apply a recipe (or a single plan, for every length) to `model`. Example::

        fast = advisor.apply(model, advisor.load_recipe("recipe.json"))
        logits = fast(input_ids)

    Where the recipe was tuned in another environment, or torch.compile cannot trace the
    model, it runs unfused with a warning; `strict=True` raises instead.
    """
    if isinstance(recipe, Plan):
        recipe = Recipe.from_plan(recipe)
    other = _model_mismatch(recipe.model, model)
    if other:  # a warning even when strict: a wrapper module's parameter names, or dtypes
        # kept mixed, differ from the tuned model's without it being another model; and
        # every site is matched and checked anew on this one (item 20)
        warnings.warn(f"advisor: {other}; its sites are matched anew on this model, its kernel "
                      "configs and timings were tuned for that one", stacklevel=2)
    problems = _env_mismatch(recipe.environment)
    if problems:
        msg = "recipe was tuned in another environment (" + "; ".join(problems) + ")"
        if strict:
            raise RecipeError(msg)
        warnings.warn(f"advisor: {msg}; running unfused", stacklevel=2)
        recipe = Recipe(buckets=tuple(Bucket(b.max_len, UNFUSED, b.measured) for b in recipe.buckets),
                        model=recipe.model, environment=recipe.environment,
                        beyond_largest=recipe.beyond_largest)
    precompiling = None
    if any(p.is_cuda for p in model.parameters()):
        if recipe.kernels:  # fork the compile workers before this process starts threads
            precompiling = precompile.start(recipe.kernels)
            if precompiling is None and os.environ.get("ADVISOR_PRECOMPILE", "1") != "0":
                reason = precompile.unusable(recipe.kernels) or "the workers could not start"
                warnings.warn(f"advisor: the recipe's kernels compile on the first call ({reason})",
                              stacklevel=2)
        warm_start()  # Triton's per-process setup, while the first call traces
    return AdvisedModel(model, recipe, length_of=length_of, precompiling=precompiling, strict=strict)
