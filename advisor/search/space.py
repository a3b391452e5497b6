"""The plan space of one shape bucket, as data, and how a trial samples it.

Design choice: the kernel config is searched **directly by Optuna** (one categorical
parameter per enabled family) and measured end to end, rather than pre-selected by a
kernel micro-benchmark. The choices come from the kernel's own `SPACE.configs(problem)`
(STYLE.md practice 3: the space is declared once), with `problem` taken from the real
operand shapes of every site of that family at the bucket's representative length; only
configs valid at *every* site are offered, plus `""` = each site's heuristic default.

Parameters of a trial (names are stable: resumed studies must see the same space)::

    <family>          True/False    one per applicable candidate family found at that length
    <family>.config   "" | "BLOCK_N=128,num_warps=1,..."   only when the family is on
    cuda_graph        True/False    CUDA only
    pdl               True/False    CUDA sm_90+ (programmatic dependent launch)

`describe_bucket` runs in a worker process (it captures the model); everything else here is
plain data and runs anywhere.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from advisor.runtime.plan import FAMILIES, PLAN_FLAGS, UNTUNED_KERNELS, Plan

DEFAULT_CONFIG = ""  # the kernel's heuristic default at each site


@dataclass(frozen=True)
class FamilySpace:
    family: str
    kernel: str
    sites: int
    predicted_saving_ms: float
    configs: tuple[str, ...] = (DEFAULT_CONFIG,)   # encoded configs; "" first


@dataclass(frozen=True)
class BucketSpace:
    """What can be tuned at one bucket: bound (= representative length) and lower bound."""

    length: int
    lower: int                          # previous bucket's bound (0 for the first)
    families: tuple[FamilySpace, ...]
    cuda_graph: bool = False
    pdl: bool = False
    # Every kernel site in the order the rewrite's rounds take them, each as (family, the
    # earlier sites holding one of its nodes): what lets the climb tell a switch that
    # changes what runs from one that does not (`blocked_by`). () = not recorded.
    sites: tuple[tuple[str, tuple[int, ...]], ...] = ()

    def flags(self) -> tuple[str, ...]:
        """The plan-wide on/off parameters this space offers."""
        return tuple(name for name in PLAN_FLAGS if getattr(self, name))

    def to_json(self) -> dict[str, Any]:
        return {"length": self.length, "lower": self.lower, "cuda_graph": self.cuda_graph,
                "pdl": self.pdl,
                "families": [{**asdict(f), "configs": list(f.configs)} for f in self.families],
                "sites": [[fam, list(earlier)] for fam, earlier in self.sites]}

    @staticmethod
    def from_json(obj: dict[str, Any]) -> BucketSpace:
        fams = tuple(FamilySpace(**{**f, "configs": tuple(f["configs"])}) for f in obj["families"])
        sites = tuple((fam, tuple(earlier)) for fam, earlier in obj.get("sites", ()))
        return BucketSpace(obj["length"], obj["lower"], fams, obj["cuda_graph"], obj.get("pdl", False),
                           sites)


def config_param(family: str) -> str:
    return f"{family}.config"


def suggest(trial: Any, space: BucketSpace) -> Plan:
    """Sample a plan with an Optuna trial (conditional: a config only for an enabled family)."""
    params: dict[str, Any] = {}
    for f in space.families:
        params[f.family] = trial.suggest_categorical(f.family, [True, False])
        if params[f.family] and len(f.configs) > 1:
            params[config_param(f.family)] = trial.suggest_categorical(
                config_param(f.family), list(f.configs))
    for flag in space.flags():
        params[flag] = trial.suggest_categorical(flag, [True, False])
    return plan_from_params(params, space)


def plan_from_params(params: dict[str, Any], space: BucketSpace) -> Plan:
    """Trial parameters -> Plan (families in FAMILIES order, default configs omitted)."""
    order = {fam: i for i, fam in enumerate(FAMILIES)}
    on = sorted((f.family for f in space.families if params.get(f.family)), key=order.__getitem__)
    configs = {fam: params[config_param(fam)] for fam in on
               if params.get(config_param(fam), DEFAULT_CONFIG) != DEFAULT_CONFIG}
    return Plan(fusions=tuple(on), configs=configs, **{f: bool(params.get(f)) for f in PLAN_FLAGS})


def canonical_config(family: str, text: str) -> str:
    """`text` in the form the space lists configs: the kernel's axes added since it was
    stored filled in (`ConfigSpace.fill`), keys sorted. A recipe tuned before the GEMMs'
    TMA axis stores "BLOCK_K=512,…,num_warps=4"; the space lists "…,TMA=0,…" — without this,
    seeding with that recipe silently ran default configs in its place (H100, session 27:
    1.656 against the recipe's own 1.579 ms at 1 token). Text that is not a well-formed
    config of the family's kernel is returned as it is."""
    from advisor.kernels.registry import get
    from advisor.kernels.space import decode, encode

    kernel = FAMILIES.get(family)
    if not text or kernel is None or kernel in UNTUNED_KERNELS:
        return text
    try:
        return encode(get(kernel).space.well_formed(decode(text)))
    except (KeyError, ValueError):
        return text


def canonical_plan_json(plan: dict[str, Any]) -> dict[str, Any]:
    """A plan's JSON with every config in canonical form: two spellings of one plan (a
    journal's configs stored before an axis existed, and today's) compare equal."""
    configs = plan.get("configs") or {}
    return {**plan, "configs": {f: canonical_config(f, c) for f, c in configs.items()}}


def plan_key(params: dict[str, Any], space: BucketSpace) -> str:
    """Trial parameters as one string per plan (configs canonical), to tell plans apart."""
    return json.dumps(canonical_plan_json(plan_from_params(params, space).to_json()),
                      sort_keys=True)


def plan_params(plan: Plan, space: BucketSpace) -> dict[str, Any]:
    """A plan (e.g. hand-written) as trial parameters of this space: its families that the
    space offers, each with the plan's config where the space lists it (else the default)."""
    params: dict[str, Any] = {f.family: f.family in plan.fusions for f in space.families}
    for f in space.families:
        if params[f.family] and len(f.configs) > 1:
            mine = canonical_config(f.family, plan.config_for(f.family))
            params[config_param(f.family)] = mine if mine in f.configs else DEFAULT_CONFIG
    for flag in space.flags():
        params[flag] = getattr(plan, flag)
    return params


def first_round(space: BucketSpace, on: Collection[str]) -> list[str | None]:
    """What each recorded site does in the rewrite's first round with the families `on`:
    "takes" it, "waits" (a node of it held by an earlier site that takes or waits:
    `rewrite._round_sites`), or None (its family is off)."""
    state: list[str | None] = []
    for fam, earlier in space.sites:
        if fam not in on:
            state.append(None)
        else:
            state.append("waits" if any(state[j] is not None for j in earlier) else "takes")
    return state


def blocked_by(space: BucketSpace, family: str, on: Collection[str],
               partial: Collection[str] = ()) -> set[str]:
    """The families of `on` whose sites take every site of `family` first, so that turning
    `family` on beside them changes nothing: its pattern is gone when the next round
    matches the graph they left. Empty when some site of `family` would be its own, when
    one only waits behind a site that itself waits (the next round may give it back), when
    a holder is among `partial` (it applied at fewer sites than recorded: a refused site
    takes nothing, and the ones behind it are tried in the same round), or when the space
    recorded no sites."""
    state = first_round(space, {*on, family})
    mine = [i for i, (fam, _) in enumerate(space.sites) if fam == family]
    holders: set[str] = set()
    for i in mine:
        taking = {space.sites[j][0] for j in space.sites[i][1] if state[j] == "takes"}
        if state[i] == "takes" or not taking or taking & set(partial):
            return set()
        holders |= taking
    return holders & set(on)


def neighbour_params(space: BucketSpace, params: dict[str, Any],
                     applied: Mapping[str, int] | None = None) -> list[dict[str, Any]]:
    """Trial parameters one switch away from `params` (a measured plan's; `applied`: its
    sites per family where the trial recorded them): each family the plan lacks turned on
    with its default config, largest predicted saving first; then each family it has turned
    off, smallest predicted saving first; then each plan-wide flag flipped. The study
    measures these after its seeds (`search.climb.ClimbSampler`): with a budget of ~10
    trials a bucket, TPE's random start had not once tried the best seed plus one GEMM
    family at 512 tokens (H100, session 27 run D).

    A switch that changes nothing is not offered: a family that applied at no site is not
    turned off, and a family whose every site another family of the plan takes first is
    turned on with those turned off instead. On the H100 (session 28 run B) the light plan
    + linear_residual was the light plan: add_rms_norm takes the residual add first."""
    plan = plan_from_params(params, space)
    live = set(plan.fusions) if applied is None else {f for f in plan.fusions if applied.get(f, 0)}
    recorded = Counter(fam for fam, _ in space.sites)
    partial = set() if applied is None else {f for f in live if applied.get(f, 0) < recorded[f]}
    by_saving = sorted(space.families, key=lambda f: -f.predicted_saving_ms)

    def without(p: Plan, off: Collection[str]) -> Plan:
        return replace(p, fusions=tuple(x for x in p.fusions if x not in off),
                       configs={k: v for k, v in p.configs.items() if k not in off})

    plans = [without(replace(plan, fusions=(*plan.fusions, f.family)),
                     blocked_by(space, f.family, live, partial))
             for f in by_saving if f.family not in plan.fusions]
    plans += [without(plan, {f.family}) for f in reversed(by_saving) if f.family in live]
    plans += [replace(plan, **{flag: not getattr(plan, flag)}) for flag in space.flags()]
    out: list[dict[str, Any]] = []
    for p in plans:
        q = plan_params(p, space)
        if q != params and q not in out:
            out.append(q)
    return out


def seeds_for_length(seeds: Sequence[Any], length: int) -> list[Plan]:
    """The --seed-plan plans for one bucket, in the order to try them. A recipe seeds the
    plan it routes `length` to before its other buckets' plans: with a short budget a bucket
    may run only its first seed, and a recipe's 1-token plan first at 512 tokens cost the
    512 bucket its known-good plan (H200, 2026-12-04: 7.25 ms chosen where 4.1 was known).
    Plans given as plans keep their place; duplicates are dropped."""
    routed: list[Plan] = []
    rest: list[Plan] = []
    for seed in seeds:
        if isinstance(seed, Plan):
            routed.append(seed)
            continue
        own = seed.bucket_for(length)
        if own is not None:
            routed.append(own.plan)
        rest.extend(b.plan for b in seed.buckets if own is None or b is not own)
    out: list[Plan] = []
    for plan in (*routed, *rest):
        if plan not in out:
            out.append(plan)
    return out


def seed_params(space: BucketSpace, plans: Sequence[Plan] = ()) -> list[dict[str, Any]]:
    """Trials every study starts with, so a short budget still measures the plans most
    likely to win: the caller's `plans` (`advisor tune --seed-plan`) first; nothing
    fused; the analyzer's predicted best (every family with a
    positive predicted saving, default configs); the predicted best without our matrix
    kernels (`KernelSpec.matrix_kernel`: Triton GEMMs and attention, which the analyzer
    prices by traffic alone but which can lose to cuBLAS / flash kernels); where CUDA
    graphs are offered, the last two replayed from a graph too (host time is most of the
    latency at short lengths). Duplicates are dropped."""
    from advisor.kernels.registry import all_kernels

    kernels = all_kernels()  # merged_linear (cuBLAS) is not a registry kernel: not "matrix"

    def plan(on: Callable[[FamilySpace], bool], graph: bool) -> dict[str, Any]:
        fams = tuple(f.family for f in space.families if on(f))
        return plan_params(Plan(fusions=fams, cuda_graph=graph), space)  # default configs

    def predicted(f: FamilySpace) -> bool:
        return f.predicted_saving_ms > 0

    def light(f: FamilySpace) -> bool:
        spec = kernels.get(f.kernel)
        return predicted(f) and not (spec is not None and spec.matrix_kernel)

    # Graph replays first where offered: a budget that runs out after a few trials should
    # still have measured the plans most likely to win (H200, 2026-12-02).
    graphs = [plan(light, True), plan(predicted, True)] if space.cuda_graph else []
    seeds = [*(plan_params(p, space) for p in plans),
             plan(lambda f: False, False), *graphs, plan(predicted, False), plan(light, False)]
    return [p for i, p in enumerate(seeds) if p not in seeds[:i]]


# ---- worker side: find the space on the captured graph ------------------------------


def _meta(value: Any) -> Any:
    """An operand as the kernel's `problem` sees it: a meta tensor of the site's shape."""
    import torch

    from advisor.graph.capture import fake, hint

    if isinstance(value, (list, tuple)):  # e.g. the weights of a merged projection
        return [_meta(v) for v in value]
    t = fake(value)
    if t is None:
        return value
    return torch.empty([hint(s) for s in t.shape], dtype=t.dtype, device="meta")


def site_problem(match: Any) -> tuple[Any, Any] | None:
    """(the match's kernel spec, the Problem its operands make at this site), or None where
    the kernel takes no generic call or its problem() cannot read these operands."""
    from advisor.kernels.registry import get
    from advisor.runtime.emit import KERNEL_ARGS

    if match.kernel not in KERNEL_ARGS:
        return None
    spec = get(match.kernel)
    names = KERNEL_ARGS[match.kernel][0]
    # a written-out attention's drop becomes (part of) its mask at emit: a mask tile either way
    ops = {**match.operands, "mask": match.operands.get("mask", None) or match.operands.get("drop")}
    args = [_meta(ops.get(name)) for name in names]
    try:
        return spec, spec.problem(*args)
    except Exception:
        return None


def site_configs(match: Any) -> list[str] | None:
    """Encoded configs of the match's kernel valid for this site's problem (None: unknown)."""
    from advisor.kernels.space import encode

    found = site_problem(match)
    if found is None:  # default only
        return None
    spec, problem = found
    return [encode(c) for c in spec.space.configs(problem)]


def fused_launches(match: Any) -> int:
    """Launches the match's kernel takes at this site at its default config (1 where
    unknown): what the analyzer's price subtracts from the eager launches it removes."""
    found = site_problem(match)
    return 1 if found is None else found[0].fused_launches(found[1])


def family_configs(kernel: str, matches: list[Any]) -> tuple[str, ...]:
    """"" plus the configs valid at every site (in the space's grid order)."""
    if kernel in UNTUNED_KERNELS:
        return (DEFAULT_CONFIG,)
    common: list[str] | None = None
    for m in matches:
        here = site_configs(m)
        if here is None:
            return (DEFAULT_CONFIG,)
        common = here if common is None else [c for c in common if c in set(here)]
    return (DEFAULT_CONFIG, *(common or []))


def describe_bucket(model: Any, inputs: Any, costs: Any, length: int, lower: int,
                    cuda: bool, pdl: bool = False) -> BucketSpace:
    """Capture the model at `length`, price its candidates, and lay out the space."""
    from advisor.graph.candidates import candidates, matches_of
    from advisor.graph.capture import capture

    matches = matches_of(capture(model, inputs))
    fams = []
    for c in candidates(matches, costs):
        if not c.applicable or c.family not in FAMILIES:
            continue
        mine = [m for m in matches if m.family == c.family]
        fams.append(FamilySpace(c.family, str(c.kernel), c.count, float(c.predicted_saving_ms),
                                family_configs(FAMILIES[c.family], mine)))
    fams.sort(key=lambda f: list(FAMILIES).index(f.family))
    return BucketSpace(length, lower, tuple(fams), cuda_graph=cuda, pdl=pdl, sites=site_order(matches))


def site_order(matches: Sequence[Any]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """`BucketSpace.sites` of `matches` (in the order the rewrite meets them): each kernel
    site's family and the earlier kernel sites that hold one of its own nodes. Sites with
    no kernel never apply and hold nothing."""
    kernel_sites = [m for m in matches if m.kernel is not None]
    holders: dict[Any, list[int]] = {}  # node -> the sites holding it, in order
    out = []
    for i, m in enumerate(kernel_sites):
        own = set(m.nodes) - set(m.shared)
        out.append((m.family, tuple(sorted({j for n in own for j in holders.get(n, ())}))))
        for n in own:
            holders.setdefault(n, []).append(i)
    return tuple(out)
