"""`advisor tune`: one Optuna study per shape bucket, trials run in worker processes.

First, a worker captures the model at every bucket's bound and lays out its plan space
(`search.space`) and times the unfused model there: a model that fails is one clear error
before anything is written. Then per bucket (bound = each `--shapes` value, representative
length = that value):

1. the study is opened (created, or resumed: `load_if_exists`); trials a dead process left
   RUNNING are marked FAIL (`crash`) and their parameters re-enqueued; a new study is seeded
   with "nothing fused" and the analyzer's predicted-best plan;
2. `study.optimize` runs the trials (`--workers K`: K threads, each leasing its own worker
   process; trial numbers come from Optuna's storage, so they stay unique across processes
   and machines sharing it) until the study holds `--trials` finished trials or the bucket's
   share of `--time-budget` is spent (a trial running then gets a short grace): the seeds,
   then the fastest plan's untried neighbours — one family or flag switched, climbing
   from each win (`climb.ClimbSampler`) — then TPE's samples. A plan that was already
   measured is not built again: the trial repeats its outcome;
3. the top plans and the unfused model are re-timed together in one worker, alone (K
   workers on one GPU disturb each other's timings), and the bucket's plan is chosen with a
   deterministic tie-break: among plans within 1% of the fastest, the fewest fusions, then
   the lowest trial number. Same seed, same sampled plans (TPESampler(seed)).

Storage: a journal file next to the recipe (`<out>.journal`, JournalStorage) unless
`--storage` names an Optuna RDB URL (e.g. postgresql://...) or another journal file path.
Stale-trial recovery knows only this host's processes: another machine's RUNNING trials
are left to it.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import FrozenTrial, TrialState

from advisor.errors import AdvisorError, ModelFileError, RecipeError
from advisor.runtime.plan import UNFUSED, Plan
from advisor.runtime.recipe import Bucket, Recipe, save_recipe
from advisor.search.climb import ClimbSampler
from advisor.search.objective import TrialFailed, make_objective, plan_of
from advisor.search.space import BucketSpace, plan_params, seed_params, seeds_for_length
from advisor.search.worker import WorkerPool, WorkerSpec

TIE = 0.01          # plans within 1% of the fastest are ties
FINISHED = (TrialState.COMPLETE, TrialState.FAIL, TrialState.PRUNED)


@dataclass(frozen=True)
class TuneOptions:
    model: str
    shapes: tuple[int, ...]
    out: Path
    dtype: Any                          # torch.dtype
    device: str = "cpu"
    batch: int = 1
    trials: int | None = 20             # finished trials per bucket study (None: budget only)
    time_budget_s: float | None = None  # global wall budget for the search
    storage: str | None = None
    study: str | None = None
    workers: int = 1
    seed: int = 0
    trial_timeout_s: float = 300.0      # per stage of a trial (compile; verify + time)
    warmup_ms: float = 100.0
    rep_ms: float = 500.0
    retime_top: int = 3
    phase: str = "prefill"              # "decode": shapes are KV-cache context lengths
    # Recipes (or Plans) whose plans every bucket tries first (--seed-plan): the plan a
    # recipe routes the bucket's length to goes before its other buckets' plans.
    seed_plans: tuple[Any, ...] = ()


@dataclass(frozen=True)
class BucketResult:
    length: int
    study: str
    plan: Plan
    unfused_ms: float
    tuned_ms: float
    max_error: float
    trials: int
    failures: dict[str, int]
    best_trial: int | None
    ran: int = 0                        # trials this invocation ran (the rest were resumed)


@dataclass(frozen=True)
class TuneResult:
    recipe: Recipe
    buckets: tuple[BucketResult, ...]
    out: Path
    storage: str
    worker_restarts: int
    kernels_note: str = ""  # whether the recipe's kernels were recorded (`record_kernels`)


@dataclass(frozen=True)
class TrialEvent:
    number: int
    done: int
    state: str
    value: float | None
    failure: str | None
    best_ms: float | None


class Listener(Protocol):
    """What the progress display is told; rendering lives in advisor/report/progress.py."""

    def bucket_started(self, length: int, done: int, total: int | None, unfused_ms: float) -> None: ...
    def trial_finished(self, length: int, event: TrialEvent) -> None: ...
    def bucket_finished(self, result: BucketResult) -> None: ...


class NoListener:
    def bucket_started(self, length: int, done: int, total: int | None, unfused_ms: float) -> None:
        pass

    def trial_finished(self, length: int, event: TrialEvent) -> None:
        pass

    def bucket_finished(self, result: BucketResult) -> None:
        pass


# ---- storage and studies -------------------------------------------------------------


def is_rdb_url(storage: str) -> bool:
    """An Optuna RDB URL (postgresql://…), not a journal file path."""
    return "://" in storage


def open_storage(options: TuneOptions) -> tuple[Any, str]:
    """(Optuna storage, its description): an RDB URL, or a journal file (default next to out)."""
    if options.storage and is_rdb_url(options.storage):
        return optuna.storages.RDBStorage(options.storage), options.storage
    path = Path(options.storage or f"{options.out}.journal")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        from optuna.storages.journal import JournalFileBackend
    except ImportError:  # optuna < 4
        from optuna.storages import JournalFileStorage as JournalFileBackend
    return optuna.storages.JournalStorage(JournalFileBackend(str(path))), str(path)


def open_study(storage: Any, name: str, seed: int, space: BucketSpace | None = None) -> optuna.Study:
    """The bucket's study; with its space, new trials climb before TPE samples (`climb`)."""
    sampler: optuna.samplers.BaseSampler = optuna.samplers.TPESampler(seed=seed)
    if space is not None:
        sampler = ClimbSampler(sampler, space)
    return optuna.create_study(storage=storage, study_name=name, direction="minimize",
                               sampler=sampler, load_if_exists=True)


# A trial's objective names its owner first thing; one RUNNING without an owner is another
# run's trial in that instant (two runs on one journal: recovering it as dead failed a live
# trial, and its run then died telling it) unless it has been so for longer than this.
OWNERLESS_GRACE_S = 60.0


def _owner_dead(owner: Any, started: datetime.datetime | None = None) -> bool:
    """True when the process that ran a trial is gone (same host only). No owner: dead
    once the trial has run OWNERLESS_GRACE_S without one (or its start is unknown)."""
    if not isinstance(owner, str) or ":" not in owner:
        return started is None or (
            datetime.datetime.now() - started).total_seconds() > OWNERLESS_GRACE_S
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False  # another machine's trial: leave it to that machine
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def recover_stale(study: optuna.Study) -> list[int]:
    """Mark trials left RUNNING by a dead process FAIL ("crash") and re-enqueue their params."""
    storage, stale = study._storage, []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if not _owner_dead(t.user_attrs.get("owner"), t.datetime_start):
            continue
        storage.set_trial_user_attr(t._trial_id, "failure", "crash")
        storage.set_trial_user_attr(t._trial_id, "error", "left RUNNING by a process that died")
        storage.set_trial_state_values(t._trial_id, TrialState.FAIL)
        study.enqueue_trial(t.params, user_attrs={"retry_of": t.number})
        stale.append(t.number)
    return stale


def finished(study: optuna.Study) -> list[FrozenTrial]:
    return study.get_trials(deepcopy=False, states=FINISHED)


def failures(trials: list[FrozenTrial]) -> dict[str, int]:
    return dict(Counter(t.user_attrs.get("failure", "error") for t in trials
                        if t.state == TrialState.FAIL))


def best_ms(trials: list[FrozenTrial]) -> float | None:
    values = [t.value for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
    return min(values) if values else None


# ---- choosing the bucket's plan --------------------------------------------------------


@dataclass(frozen=True)
class Timed:
    ms: float
    plan: Plan
    number: int          # trial number (-1: the unfused baseline)
    max_error: float = 0.0


def choose(cands: list[Timed], tie: float = TIE, prefer: Plan | None = None) -> Timed:
    """Among candidates within `tie` of the fastest: `prefer` (the shorter bucket's plan:
    equal plans share one compiled graph when applied, runtime/apply._bucket_states, so
    a tie taken this way saves a trace, a rewrite and confirmations of cold start), then
    fewest fusions, then lowest number."""
    fastest = min(c.ms for c in cands)
    near = [c for c in cands if c.ms <= fastest * (1 + tie)]
    return min(near, key=lambda c: (c.plan != prefer, len(c.plan.fusions), c.number))


def _top(trials: list[FrozenTrial], k: int) -> list[Timed]:
    """The k fastest completed trials with distinct plans."""
    done = sorted((t for t in trials if t.state == TrialState.COMPLETE and t.value is not None),
                  key=lambda t: (t.value, t.number))
    out: list[Timed] = []
    for t in done:
        try:
            plan = plan_of(t.user_attrs["plan"])
        except RecipeError:  # a journal from before a kernel's grid changed: that trial's
            continue         # config no longer runs, the study's other trials stand
        if all(plan != c.plan for c in out):
            out.append(Timed(float(t.value), plan, t.number, t.user_attrs.get("max_error", 0.0)))
        if len(out) == k:
            break
    return out


def retime(top: list[Timed], pool: WorkerPool, space: BucketSpace, options: TuneOptions,
           unfused_ms: float) -> list[Timed]:
    """The unfused model and the top plans timed again together, in one worker; where that
    fails, the trial values stand. The unfused plan is timed once, as the baseline (a
    trial that tried "nothing fused" is that same plan: timing it twice would let noise
    report a speed-up for no change)."""
    top = [c for c in top if c.plan != UNFUSED]
    plans = [UNFUSED] + [c.plan for c in top]
    req = {"op": "measure", "plans": [p.to_json() for p in plans], "length": space.length,
           "seed": options.seed, "rounds": 3, "warmup_ms": options.warmup_ms,
           "rep_ms": options.rep_ms}
    with pool.lease() as worker:
        res = worker.request(req, options.trial_timeout_s)
    ms = res["ms"] if res.get("ok") else [None] * len(plans)
    base = Timed(ms[0] if ms[0] is not None else unfused_ms, UNFUSED, -1)
    again = [Timed(m, c.plan, c.number, c.max_error) for m, c in zip(ms[1:], top) if m is not None]
    return [base, *(again if res.get("ok") else top)]


# ---- one bucket, then all of them ----------------------------------------------------


def describe(pool: WorkerPool, options: TuneOptions, length: int, lower: int) -> tuple[BucketSpace, float]:
    """The bucket's plan space and unfused time; a forward that fails here is the user's
    model failing (one clear line, nothing written)."""
    req = {"op": "describe", "length": length, "lower": lower, "seed": options.seed,
           "warmup_ms": options.warmup_ms, "rep_ms": options.rep_ms}
    with pool.lease() as worker:
        res = worker.request(req, 2 * options.trial_timeout_s)
    if not res["ok"]:
        if res.get("user"):
            raise ModelFileError(res["message"])
        raise AdvisorError(f"{options.model}: the unfused model failed at length {length} "
                           f"({res['reason']}): {res.get('message', '')}")
    return BucketSpace.from_json(res["space"]), float(res["unfused_ms"])


@dataclass
class Budget:
    """--trials per bucket and the global --time-budget, shared out over the buckets."""

    trials: int | None
    deadline: float | None
    buckets_left: int
    total_s: float = 0.0
    # Seconds a bucket spends after its search (re-timing the best plans, each compiled
    # afresh): the most seen so far, kept back from every later bucket's share. Without it
    # the last bucket of a short budget got no trial at all (H200, 2026-12-02).
    finish_s: float = 0.0

    def hard_deadline(self, trial_timeout_s: float) -> float | None:
        """When a trial still running past the budget is killed: the budget stops new trials,
        and a running one gets a grace (a kill would FAIL a plan that may be fine)."""
        if self.deadline is None:
            return None
        return self.deadline + min(trial_timeout_s, max(10.0, 0.1 * self.total_s))

    def for_bucket(self, done: int) -> tuple[int | None, float | None, bool]:
        """(n_trials, timeout_s, run at all) for the next bucket. A bucket the clock has
        left nothing for, with no trial measured yet, still gets one (its first seed, e.g.
        the --seed-plan), past the budget: an unfused bucket because earlier buckets ran
        long would undo the recipe wherever that bucket routes (H200, 2026-12-03: decode
        from a 512 context runs in the 2048 bucket; left unfused, 10.1 ms/token)."""
        n = None if self.trials is None else max(0, self.trials - done)
        share = None
        if self.deadline is not None:
            share = (self.deadline - time.monotonic()) / max(1, self.buckets_left) - self.finish_s
        self.buckets_left -= 1
        if share is not None and share <= 0 and done == 0 and (n is None or n > 0):
            return 1, None, True
        return n, share, (n is None or n > 0) and (share is None or share > 0)


def tune_bucket(pool: WorkerPool, storage: Any, name: str, options: TuneOptions,
                space: BucketSpace, unfused_ms: float, budget: Budget,
                listener: Listener, prefer: Plan | None = None) -> BucketResult:
    run_id, length = uuid.uuid4().hex, space.length
    study = open_study(storage, name, options.seed + length, space)
    recover_stale(study)
    seeds = seeds_for_length(options.seed_plans, length)
    if not study.get_trials(deepcopy=False):
        for params in seed_params(space, seeds):
            study.enqueue_trial(params, skip_if_exists=True)
    else:  # a resumed study: its seeds ran; a --seed-plan given now still goes first
        for plan in seeds:
            study.enqueue_trial(plan_params(plan, space), skip_if_exists=True)
    n_trials, timeout, run = budget.for_bucket(len(finished(study)))
    listener.bucket_started(length, len(finished(study)), options.trials, unfused_ms)

    def progress(study: optuna.Study, t: FrozenTrial) -> None:
        done = finished(study)
        listener.trial_finished(length, TrialEvent(t.number, len(done), t.state.name, t.value,
                                                   t.user_attrs.get("failure"), best_ms(done)))

    if run:
        hard = budget.hard_deadline(options.trial_timeout_s)
        if timeout is None and hard is not None:  # the one trial past the budget
            hard = max(hard, time.monotonic() + options.trial_timeout_s)
        objective = make_objective(space, pool, options, hard, run_id)
        study.optimize(objective, n_trials=n_trials,
                       timeout=timeout, n_jobs=options.workers, catch=(TrialFailed,),
                       callbacks=[progress])
    started = time.monotonic()
    result = finish_bucket(study, name, space, pool, options, unfused_ms, prefer)
    budget.finish_s = max(budget.finish_s, time.monotonic() - started)
    result = replace(result, ran=sum(t.user_attrs.get("run") == run_id for t in finished(study)))
    listener.bucket_finished(result)
    return result


def finish_bucket(study: optuna.Study, name: str, space: BucketSpace, pool: WorkerPool,
                  options: TuneOptions, unfused_ms: float, prefer: Plan | None = None) -> BucketResult:
    trials = finished(study)
    top = _top(trials, options.retime_top)
    timed = retime(top, pool, space, options, unfused_ms)
    best = choose(timed, prefer=prefer)
    return BucketResult(length=space.length, study=name, plan=best.plan, unfused_ms=timed[0].ms,
                        tuned_ms=best.ms, max_error=best.max_error, trials=len(trials),
                        failures=failures(trials),
                        best_trial=best.number if best.number >= 0 else None)


def study_name(options: TuneOptions, fingerprint: str) -> str:
    """Base name: the model file, its parameter fingerprint, dtype, batch and device."""
    if options.study:
        return options.study
    dtype = str(options.dtype).replace("torch.", "")
    phase = "" if options.phase == "prefill" else f"-{options.phase}"
    return (f"{Path(options.model).stem}-{fingerprint[:8]}-{dtype}-b{options.batch}"
            f"-{options.device.split(':')[0]}{phase}")


def to_recipe(results: list[BucketResult], info: dict[str, Any], options: TuneOptions) -> Recipe:
    buckets = tuple(Bucket(r.length, r.plan, {
        "unfused_ms": r.unfused_ms, "tuned_ms": r.tuned_ms, "max_error": r.max_error,
        "trials": r.trials, "failures": r.failures, "best_trial": r.best_trial})
        for r in results)
    model = {"fingerprint": info["fingerprint"], "source": str(options.model),
             "dtype": str(options.dtype).replace("torch.", ""), "batch": options.batch,
             "phase": options.phase}
    return Recipe(buckets=buckets, model=model, environment=info["environment"])


def record_kernels(pool: WorkerPool, recipe: Recipe, options: TuneOptions) -> tuple[Recipe, str]:
    """The recipe with the kernels its buckets compile, recorded in a worker (so a cold
    `apply` compiles them in parallel: runtime/precompile.py), and a note saying so; where
    that fails, the recipe as it is (nothing lost: only the cold start is longer) and the
    note says why. Each recorded length (`record.bounds`) gets a trial's timeout."""
    from advisor.runtime.record import bounds

    if not str(options.device).startswith("cuda"):
        return recipe, "kernels not recorded: they are compiled for a CUDA device"
    req = {"op": "record", "recipe": recipe.to_json(), "seed": options.seed}
    with pool.lease() as worker:
        res = worker.request(req, options.trial_timeout_s * max(1, len(bounds(recipe))))
    if not res.get("ok"):
        return recipe, (f"kernels not recorded ({res.get('reason')}: {res.get('message')}); "
                        "a cold apply compiles them itself")
    kernels = res.get("kernels")
    if not kernels:
        return recipe, "no kernels to record"
    return replace(recipe, kernels=kernels), f"{len(kernels.get('entries', []))} kernels recorded"


def tune(options: TuneOptions, listener: Listener | None = None) -> TuneResult:
    """Search every bucket, write the recipe, return what was found. Example::

        from advisor.search import TuneOptions, tune
        r = tune(TuneOptions("examples/tiny_llama.py", (128, 512), Path("r.json"), torch.bfloat16,
                             device="cuda", trials=30))
    """
    listener = listener or NoListener()
    deadline = time.monotonic() + options.time_budget_s if options.time_budget_s else None
    pool = WorkerPool(WorkerSpec(str(options.model), options.device, options.dtype,
                                 options.batch, phase=options.phase), max(1, options.workers))
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(logging.ERROR)  # failed trials are reported by the progress
    try:
        info = pool.start()  # model-file problems surface here and in describe: nothing written
        bounds = sorted(options.shapes)
        spaces = [describe(pool, options, n, lo) for n, lo in zip(bounds, [0, *bounds[:-1]])]
        storage, where = open_storage(options)
        name = study_name(options, info["fingerprint"])
        budget = Budget(options.trials, deadline, len(spaces), options.time_budget_s or 0.0)
        results: list[BucketResult] = []
        for space, ms in spaces:  # a tie goes to the previous bucket's plan (past one token)
            prev = results[-1].plan if results and results[-1].length > 1 else None
            results.append(tune_bucket(pool, storage, f"{name}-len{space.length}", options, space,
                                       ms, budget, listener, prev))
        recipe, kernels_note = record_kernels(pool, to_recipe(results, info, options), options)
        save_recipe(recipe, options.out)
    finally:
        optuna.logging.set_verbosity(level)
        pool.close()
    return TuneResult(recipe, tuple(results), Path(options.out), where, pool.restarts, kernels_note)
