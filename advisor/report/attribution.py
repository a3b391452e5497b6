"""Each fusion family's measured saving, estimated from one bucket's tuning trials (pure).

Model, over the COMPLETE trials of one bucket (all timed at its representative length)::

    latency_ms ≈ base − Σ_f s_f · on_f − g · cuda_graph

`on_f` is 1 when the trial's `<family>` parameter is True; the `cuda_graph` term is there
only when that parameter varies among the trials. The fit is ordinary least squares
(`numpy.linalg.lstsq`); `s_f` is the family's marginal saving in ms (positive: the family
makes the forward faster), directly comparable with the analyzer's `predicted_saving_ms`.

Identifiability: `s_f` is estimated only when the family's on/off column varies and is not
a linear combination of the other columns (intercept, other families, cuda_graph), i.e.
removing the column lowers the rank of the design matrix. Otherwise it is None with a
reason: always on, always off, or collinear (e.g. two families always toggled together:
only their sum is measured).

Paired estimate: two trials whose parameters differ in this family alone (every other
family, every config, cuda_graph equal) measure it directly: off − on. The median over all
such pairs is reported too and preferred (`method="paired"`): it does not rest on the
additive model. A paired estimate implies an identifiable column. It is robust to
interactions but not to noise: one pair carries two trials' timing noise, where the fit
averages over all of them; `lstsq_ms ± stderr_ms` is reported alongside for that reason.

Limits:

- additive: interactions between families are ignored. Two fusions that rewrite the same
  ops, or one that pays off only under CUDA graphs, get an average effect over the other
  families' on/off mix that the sampler happened to draw; `residual_ms` says how well the
  additive model fits (None when no degrees of freedom are left).
- configs are ignored except through on/off: `s_f` averages over the configs drawn for f.
  The paired estimate holds the other families' configs equal, not f's own.
- tuning is not a designed experiment: the sampler favours good plans, so a family may be
  on in nearly every trial and its estimate then rests on the few trials with it off
  (`trials_on`, `trials_off`, `stderr_ms`). Each trial is one median timing: its noise
  goes into the estimate in full when trials barely outnumber the parameters.
- a repeat of an already measured plan copies that trial's value (`repeat_of`) and is
  dropped, as is a trial whose plan applied no fusion at any site (`applied` 0): its "on"
  families did nothing.

Input: `Trial(params, value)` (see `trials_from_history` for the report's history rows).
Output: `Attribution`, plain frozen dataclasses (`to_json()` for a dict).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

import numpy as np

from advisor.runtime.plan import CUDA_GRAPH, PLAN_FLAGS

CONFIG_SUFFIX = ".config"
PAIRED, LSTSQ = "paired", "least squares"


@dataclass(frozen=True)
class Trial:
    params: Mapping[str, Any]   # {"<family>": bool, "<family>.config": str, "cuda_graph": bool}
    value: float                # latency in ms


@dataclass(frozen=True)
class FamilySaving:
    family: str
    saving_ms: float | None     # the preferred estimate: paired when there is a pair, else lstsq
    method: str | None          # PAIRED | LSTSQ | None (not identifiable)
    lstsq_ms: float | None
    stderr_ms: float | None     # standard error of lstsq_ms (None: no residual degrees of freedom)
    paired_ms: float | None     # median of off − on over the pairs
    pairs: int
    trials_on: int
    trials_off: int
    reason: str | None = None   # why saving_ms is None


@dataclass(frozen=True)
class Attribution:
    trials: int                 # trials used
    dof: int                    # residual degrees of freedom of the fit (trials − rank)
    base_ms: float | None       # fitted latency with the varying families and cuda_graph off
    cuda_graph_ms: float | None  # fitted saving of cuda_graph (None: constant or not identifiable)
    residual_ms: float | None   # RMS residual of the fit (None when dof == 0)
    families: tuple[FamilySaving, ...]

    def get(self, family: str) -> FamilySaving | None:
        return next((f for f in self.families if f.family == family), None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def trials_from_history(rows: Iterable[Mapping[str, Any]], bucket: Any) -> list[Trial]:
    """The report's history rows (advisor/report/history.py) of one bucket -> Trials: COMPLETE,
    with a finite value and parameters, not a repeat of an earlier plan, and (where `applied`
    is recorded) with some fusion applied when the plan had any on."""
    out = []
    for r in rows:
        params, value = r.get("params"), r.get("value")
        if (r.get("bucket", r.get("length")) != bucket or r.get("state") != "COMPLETE"
                or not isinstance(params, Mapping) or isinstance(value, bool)
                or not isinstance(value, (int, float)) or not math.isfinite(value)
                or r.get("repeat_of") is not None):
            continue
        any_on = any(v is True for k, v in params.items() if k not in PLAN_FLAGS)
        if any_on and r.get("applied") == 0:
            continue
        out.append(Trial(dict(params), float(value)))
    return out


def families_of(trials: Iterable[Trial]) -> list[str]:
    """Boolean parameters other than the plan flags (cuda_graph, pdl), in first-seen order."""
    seen: dict[str, None] = {}
    for t in trials:
        for k, v in t.params.items():
            if isinstance(v, bool) and k not in PLAN_FLAGS:
                seen.setdefault(k, None)
    return list(seen)


def _normal(params: Mapping[str, Any], families: Sequence[str]) -> dict[str, Any]:
    """Every family as a bool (absent: off); a config only for a family that is on."""
    out = {k: v for k, v in params.items()
           if k not in families and not (k.endswith(CONFIG_SUFFIX) and k[:-len(CONFIG_SUFFIX)] in families)}
    out[CUDA_GRAPH] = bool(params.get(CUDA_GRAPH, False))
    for f in families:
        out[f] = bool(params.get(f, False))
        if out[f]:
            out[f + CONFIG_SUFFIX] = str(params.get(f + CONFIG_SUFFIX, ""))
    return out


def _paired(rows: list[dict[str, Any]], values: list[float], family: str) -> list[float]:
    """off − on for every two trials that differ in `family` alone."""
    groups: dict[tuple, tuple[list[float], list[float]]] = {}
    for p, v in zip(rows, values):
        rest = tuple(sorted((k, repr(x)) for k, x in p.items() if k not in (family, family + CONFIG_SUFFIX)))
        groups.setdefault(rest, ([], []))[0 if p[family] else 1].append(v)
    return [off - on for ons, offs in groups.values() for on in ons for off in offs]


def _rank(x: np.ndarray) -> int:
    return int(np.linalg.matrix_rank(x)) if x.size else 0


def attribute(trials: Sequence[Trial], families: Sequence[str] | None = None) -> Attribution:
    """Per-family saving estimates from one bucket's COMPLETE trials (module docstring).
    `families`: which to report (default: every boolean parameter but cuda_graph)."""
    fams = list(families) if families is not None else families_of(trials)
    tuned = {k for t in trials for k in t.params}
    rows = [_normal(t.params, fams) for t in trials]
    y = np.array([t.value for t in trials], dtype=float)
    n = len(rows)
    on = {f: np.array([r[f] for r in rows], dtype=float) for f in fams}
    graph = np.array([r[CUDA_GRAPH] for r in rows], dtype=float)

    varying = [f for f in fams if n and 0 < on[f].sum() < n]
    names = ["(base)", *varying] + ([CUDA_GRAPH] if n and 0 < graph.sum() < n else [])
    x = np.column_stack([np.ones(n)] + [on[f] for f in varying]
                        + ([graph] if names[-1] == CUDA_GRAPH else [])) if n else np.zeros((0, 1))
    rank = _rank(x)
    dof = n - rank
    beta = np.linalg.lstsq(x, y, rcond=None)[0] if n else np.zeros(len(names))
    fitted = x @ beta if n else y
    sigma = math.sqrt(float(((y - fitted) ** 2).sum()) / dof) if n and dof > 0 else None
    pinv = np.linalg.pinv(x.T @ x) if n else None

    def estimable(j: int) -> bool:
        return _rank(np.delete(x, j, axis=1)) < rank

    def stderr(j: int) -> float | None:
        return None if sigma is None or pinv is None else sigma * math.sqrt(max(float(pinv[j, j]), 0.0))

    out = []
    for f in fams:
        k_on = int(on[f].sum()) if n else 0
        base = dict(family=f, trials_on=k_on, trials_off=n - k_on)
        if n == 0:
            out.append(FamilySaving(**base, saving_ms=None, method=None, lstsq_ms=None, stderr_ms=None,
                                    paired_ms=None, pairs=0, reason="no completed trials"))
            continue
        if f not in varying:
            why = ("not a tuning parameter at this length" if f not in tuned else
                   f"always {'on' if k_on else 'off'} in the {n} trials")
            out.append(FamilySaving(**base, saving_ms=None, method=None, lstsq_ms=None, stderr_ms=None,
                                    paired_ms=None, pairs=0, reason=why))
            continue
        j = names.index(f)
        if not estimable(j):
            twins = [g for g in varying if g != f and (np.array_equal(on[g], on[f])
                                                       or np.array_equal(on[g], 1 - on[f]))]
            twins += [CUDA_GRAPH] if CUDA_GRAPH in names and (np.array_equal(graph, on[f])
                                                              or np.array_equal(graph, 1 - on[f])) else []
            why = ("collinear with " + ", ".join(twins) + " (toggled together: only their sum is measured)"
                   if twins else "collinear with a combination of other parameters")
            # no pair either: two trials differing in f alone would make its column estimable
            out.append(FamilySaving(**base, saving_ms=None, method=None, lstsq_ms=None, stderr_ms=None,
                                    paired_ms=None, pairs=0, reason=why))
            continue
        diffs = _paired(rows, list(y), f)
        paired = float(median(diffs)) if diffs else None
        lstsq = -float(beta[j])
        out.append(FamilySaving(**base, saving_ms=paired if diffs else lstsq,
                                method=PAIRED if diffs else LSTSQ, lstsq_ms=lstsq, stderr_ms=stderr(j),
                                paired_ms=paired, pairs=len(diffs)))
    g = names.index(CUDA_GRAPH) if CUDA_GRAPH in names else None
    return Attribution(
        trials=n, dof=dof,
        base_ms=float(beta[0]) if n and estimable(0) else None,
        cuda_graph_ms=-float(beta[g]) if g is not None and estimable(g) else None,
        residual_ms=sigma, families=tuple(out))
