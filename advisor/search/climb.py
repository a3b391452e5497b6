"""The search climbs before it samples: a sampler that hands a new trial the best plan's
next untried neighbour, and TPE's sample only once every neighbour has been tried.

Why: a bucket gets ~10 trials in a tune of a few minutes. After the seeds, TPE's first
samples are random (its startup), and on the H100 (session 27 run D) none of them tried the
best seed plan with one GEMM family added at 128 / 512 tokens: the plan an engineer would
try next. Here every trial that is not an enqueued one (a seed, a retry) asks the climb
first: the fastest completed plan's neighbours (`space.neighbour_params`: one family on or
off, one flag flipped, none that would leave what runs as it was), in order, skipping any
plan already tried; each win is climbed from at once. Nothing is enqueued: a run that ends
leaves no trial waiting for the next one.

"Tried" compares plans, not parameter spellings (`space.canonical_config`): a journal
from before an axis existed stores its configs without it. A trial counts as tried when it
completed, when it failed in a way the same plan would fail again (`objective.REPEATABLE`),
while it is running or waiting with known parameters, or when this run handed it out or
finished it already (a timeout is retried by the next run, not this one).
"""

from __future__ import annotations

import threading
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from advisor.search.objective import REPEATABLE  # failures the same plan meets again
from advisor.search.space import BucketSpace, neighbour_params, plan_key

CLIMB_ATTR = "climb_params"  # system attr: the parameters a climb trial was handed


class ClimbSampler(optuna.samplers.BaseSampler):
    """`base` (TPE) for everything but the parameters of a climb trial."""

    def __init__(self, base: optuna.samplers.BaseSampler, space: BucketSpace):
        self._base = base
        self._space = space
        self._lock = threading.Lock()            # --workers K: K threads ask at once
        self._climbing: dict[int, dict[str, Any]] = {}  # trial number -> its parameters
        self._given: set[str] = set()             # plan keys handed out or finished by this run

    # -- the climb ----------------------------------------------------------------------

    def _tried(self, trials: list[FrozenTrial]) -> set[str]:
        keys = set(self._given)
        for t in trials:
            if t.state == TrialState.FAIL and t.user_attrs.get("failure") not in REPEATABLE:
                continue
            if t.state in (TrialState.COMPLETE, TrialState.FAIL):
                params = t.params
            else:  # running or waiting: the parameters it was given; a sampled trial's are
                # not known until it has suggested them all (the asking trial has none yet)
                params = t.system_attrs.get("fixed_params") or t.system_attrs.get(CLIMB_ATTR)
                if params is None:
                    continue
            keys.add(plan_key(params, self._space))
        return keys

    def next_climb(self, trials: list[FrozenTrial]) -> tuple[int, dict[str, Any]] | None:
        """(the best trial's number, the parameters of its first untried neighbour), or None
        when nothing has completed yet or every neighbour has been tried."""
        done = [t for t in trials if t.state == TrialState.COMPLETE and t.value is not None]
        if not done:
            return None
        best = min(done, key=lambda t: (t.value, t.number))
        tried = self._tried(trials)
        for params in neighbour_params(self._space, best.params, best.user_attrs.get("applied_families")):
            if plan_key(params, self._space) not in tried:
                return best.number, params
        return None

    # -- the sampler interface --------------------------------------------------------------

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._base.before_trial(study, trial)
        if "fixed_params" in trial.system_attrs:  # enqueued (a seed, a retry): as given
            return
        with self._lock:
            step = self.next_climb(study.get_trials(deepcopy=False))
            if step is None:
                return
            of, params = step
            self._climbing[trial.number] = params
            self._given.add(plan_key(params, self._space))
        study._storage.set_trial_user_attr(trial._trial_id, "climb_of", of)
        # another process on the same journal sees what this running trial will measure
        study._storage.set_trial_system_attr(trial._trial_id, CLIMB_ATTR, params)

    def infer_relative_search_space(self, study: optuna.Study,
                                    trial: FrozenTrial) -> dict[str, BaseDistribution]:
        return self._base.infer_relative_search_space(study, trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        if trial.number in self._climbing:
            return {}
        return self._base.sample_relative(study, trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        params = self._climbing.get(trial.number)
        if params is not None and param_name in params:
            return params[param_name]
        return self._base.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Any) -> None:
        self._climbing.pop(trial.number, None)
        with self._lock:  # whoever proposed it (a seed, TPE), this run does not try it again
            self._given.add(plan_key(trial.params, self._space))
        self._base.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self._base.reseed_rng()
