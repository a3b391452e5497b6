"""`advisor tune`: end to end, injected faults, dead and hung workers, resume, concurrency.

Workers run with TRITON_INTERPRET=0, so on the CPU the custom ops take their eager
reference path: what is under test here is the search (isolation, verification, storage,
choice), not the kernels (tests/test_kernel_*.py run those through the interpreter).
Faults are injected with the test-only ADVISOR_FAULT hook (advisor/search/objective.py).
"""

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import optuna
import pytest
import torch
from optuna.trial import FixedTrial, TrialState
from typer.testing import CliRunner

from advisor.cli import app
from advisor.kernels.testing import max_violation, tolerance
from advisor.loader import build, call, first_tensor, inputs_for, load_model_file
from advisor.runtime.apply import apply
from advisor.runtime.plan import UNFUSED, Plan
from advisor.runtime.recipe import Bucket, Recipe, load_recipe
from advisor.search import TuneOptions, tune
from advisor.search.objective import TrialFailed, classify, plan_of, verify_length
from advisor.search.space import (
    BucketSpace,
    FamilySpace,
    plan_from_params,
    seed_params,
    seeds_for_length,
    suggest,
)
from advisor.search.study import Budget, Timed, choose, open_storage

CPU = torch.device("cpu")
# One block: RMSNorm -> gate/up -> SiLU·mul -> down -> residual add -> RMSNorm.
# Families found: rms_norm_linear, rms_norm, add_rms_norm, gate_up_swiglu, gated_act,
# gate_up_merge.
TINY = """
import torch
import torch.nn.functional as F
from torch import nn


class Norm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Tiny(nn.Module):
    def __init__(self, d=32, h=48):
        super().__init__()
        self.n1, self.n2 = Norm(d), Norm(d)
        self.gate, self.up = nn.Linear(d, h, bias=False), nn.Linear(d, h, bias=False)
        self.down = nn.Linear(h, d, bias=False)

    def forward(self, x):
        y = self.n1(x)
        return self.n2(x + self.down(F.silu(self.gate(y)) * self.up(y)))


def build_model(device, dtype):
    torch.manual_seed(0)
    return Tiny().to(device=device, dtype=dtype)


def make_inputs(seq_len, batch, device):
    return (torch.randn(batch, seq_len, 32).to(device),)
"""
REASON = {"compile": "compile_error", "wrong": "mismatch", "nan": "nan", "exit": "crash",
          "hang": "timeout"}


@pytest.fixture(autouse=True)
def _eager_kernels(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # inherited by the spawned workers
    monkeypatch.delenv("ADVISOR_FAULT", raising=False)


@pytest.fixture
def tiny(tmp_path) -> Path:
    path = tmp_path / "tiny.py"
    path.write_text(TINY)
    return path


def _options(model: Path, out: Path, **kw) -> TuneOptions:
    base = dict(shapes=(8,), dtype=torch.float32, trials=4, warmup_ms=2.0, rep_ms=10.0,
                trial_timeout_s=60.0)
    return TuneOptions(model=str(model), out=out, **{**base, **kw})


def _trials(options: TuneOptions, name: str) -> list[optuna.trial.FrozenTrial]:
    storage, _ = open_storage(options)
    return optuna.load_study(study_name=name, storage=storage).get_trials()


def _check_fault_outcome(trial, faults: list[tuple[str, str]]) -> None:
    """What the injected faults must do to a trial (objective._fault fires where its family
    applied): a completed trial applied no faulty family; a failed one failed with the
    reason of a faulty family its plan asked for. Which of them fires, and whether a family
    asked for finds a site at all, depends on which deeper family takes the site first: the
    climb reaches plans a hand-written model of that order got wrong (a plan with rms_norm
    and rms_norm_linear applied only the latter, in CI). (A completed plan that applied
    fewer families than it asked for passes here: test_apply covers matching.)"""
    faulty = {f for f, _ in faults}
    if trial.state == TrialState.COMPLETE:
        applied = trial.user_attrs["applied_families"]
        assert not faulty & set(applied), (trial.number, applied)
        return
    asked = set(trial.user_attrs["plan"]["fusions"])
    reasons = {REASON[kind] for fam, kind in faults if fam in asked}
    assert trial.state == TrialState.FAIL and trial.user_attrs.get("failure") in reasons, trial


# ---- pure pieces ---------------------------------------------------------------------


def test_tie_break_prefers_fewer_fusions_then_lower_trial():
    a = Plan(fusions=("rms_norm", "gated_act"))
    b = Plan(fusions=("rms_norm",))
    cands = [Timed(1.00, a, 3), Timed(1.005, b, 7), Timed(1.008, b, 5), Timed(1.2, UNFUSED, -1)]
    assert choose(cands) == Timed(1.008, b, 5)           # within 1%: 1 fusion, lowest number
    assert choose([Timed(1.0, a, 3), Timed(1.02, b, 1)]).number == 3  # 2% slower: not a tie


def test_a_tie_goes_to_the_previous_buckets_plan():
    """Equal plans share one compiled graph when applied: within the tie, the shorter
    bucket's plan wins over fewer fusions; past the tie it does not."""
    a = Plan(fusions=("rms_norm", "gated_act"))
    b = Plan(fusions=("rms_norm",))
    cands = [Timed(1.00, b, 3), Timed(1.008, a, 7)]
    assert choose(cands, prefer=a).plan == a
    assert choose(cands, prefer=None).plan == b
    assert choose([Timed(1.0, b, 3), Timed(1.02, a, 7)], prefer=a).plan == b


def test_classify_and_verify_length():
    assert classify(TrialFailed("nan")) == "nan"
    oom = type("OutOfMemoryError", (RuntimeError,), {})("CUDA out of memory")
    assert classify(RuntimeError("wrapped")) == "error"
    try:
        try:
            raise oom
        except RuntimeError as inner:
            raise ValueError("backend failed") from inner
    except ValueError as exc:
        assert classify(exc) == "oom"  # found through the cause chain (dynamo wraps errors)
    assert classify(RuntimeError("CUDA error: an illegal memory access")) == "crash"
    lengths = {verify_length(8, 64, n, 0) for n in range(50)}
    assert lengths <= set(range(9, 64)) and len(lengths) > 5
    assert verify_length(0, 2, 0, 0) == 2


def test_time_budget_is_shared_over_buckets_and_trials_target_the_study():
    b = Budget(trials=None, deadline=time.monotonic() + 100, buckets_left=2, total_s=100)
    n, share, run = b.for_bucket(done=0)
    assert n is None and 49 < share <= 50 and run
    assert b.hard_deadline(trial_timeout_s=300) == b.deadline + 10.0  # a grace, then a kill
    # What re-timing took in an earlier bucket is kept back from the next bucket's share.
    b.finish_s = 9.0
    assert 90 < b.for_bucket(done=0)[1] <= 91  # the last bucket: all that is left, less 9 s
    assert Budget(trials=5, deadline=None, buckets_left=1).for_bucket(done=5) == (0, None, False)
    assert Budget(trials=5, deadline=None, buckets_left=1).for_bucket(done=2) == (3, None, True)
    # Out of time: a bucket with nothing measured still runs one trial (its first seed).
    spent = Budget(trials=None, deadline=time.monotonic() - 1, buckets_left=1, total_s=100)
    assert spent.for_bucket(done=0) == (1, None, True)
    assert Budget(trials=None, deadline=time.monotonic() - 1, buckets_left=1).for_bucket(done=2)[2] is False


def test_space_suggests_conditional_configs_and_seeds():
    space = BucketSpace(64, 0, (FamilySpace("rms_norm", "rms_norm", 2, 0.1, ("", "BLOCK_N=128")),
                                FamilySpace("gated_act", "gated_act", 1, 0.0)), cuda_graph=True)
    nothing, graphed, best = seed_params(space)
    assert not any(nothing.values())
    assert best == {"rms_norm": True, "rms_norm.config": "", "gated_act": False, "cuda_graph": False}
    assert graphed == {**best, "cuda_graph": True}
    no_graphs = BucketSpace(64, 0, space.families, cuda_graph=False)
    assert [p.get("cuda_graph") for p in seed_params(no_graphs)] == [None, None]
    # A Triton matrix kernel (attention) among the predicted winners: the seeds also try
    # the plan without it, with and without CUDA graphs.
    deep = BucketSpace(64, 0, (*space.families, FamilySpace("attention", "attention", 1, 0.2)), cuda_graph=True)
    seeds = seed_params(deep)
    assert [(p["attention"], p["rms_norm"], p["cuda_graph"]) for p in seeds] == [
        (False, False, False), (False, True, True), (True, True, True), (True, True, False),
        (False, True, False)]
    plan = suggest(FixedTrial({"rms_norm": True, "rms_norm.config": "BLOCK_N=128",
                               "gated_act": True, "cuda_graph": True}), space)
    assert plan == Plan(("rms_norm", "gated_act"), {"rms_norm": "BLOCK_N=128"}, True)
    # A hand-written seed plan goes first; a config the space does not list falls back to
    # the default, and a family the space lacks is dropped.
    mine = Plan(("rms_norm", "rope"), {"rms_norm": "BLOCK_N=128"}, True)
    other = Plan(("gated_act",), {"gated_act": "BLOCK_N=7"}, False)
    first, second, *rest = seed_params(space, [mine, other])
    assert first == {"rms_norm": True, "rms_norm.config": "BLOCK_N=128", "gated_act": False,
                     "cuda_graph": True}
    assert second == {"rms_norm": False, "gated_act": True, "cuda_graph": False}
    assert rest == [nothing, graphed, best]
    assert plan_from_params(first, space) == Plan(("rms_norm",), {"rms_norm": "BLOCK_N=128"}, True)
    # A recipe seeds each bucket with the plan it routes that length to first, then its
    # other buckets' plans; a plain plan keeps its place among the routed ones.
    short, wide = Plan(("rms_norm",), {}, True), Plan(("gated_act",))
    recipe = Recipe((Bucket(1, short), Bucket(512, wide), Bucket(2048, short)))
    assert seeds_for_length([recipe], 1) == [short, wide]
    assert seeds_for_length([recipe], 300) == [wide, short]
    assert seeds_for_length([recipe, mine], 4096) == [short, mine, wide]  # past the last: largest
    assert seeds_for_length([replace(recipe, beyond_largest="unfused")], 4096) == [short, wide]
    # Where PDL is offered (CUDA sm_90+) it is one more plan-wide switch, off in the seeds
    # unless a seed plan has it; a resumed study's space from before it reads as "not offered".
    pdl = BucketSpace(64, 0, space.families, cuda_graph=True, pdl=True)
    assert all(p["pdl"] is False for p in seed_params(pdl))
    mine_pdl = Plan(("rms_norm",), {}, cuda_graph=True, pdl=True)
    assert plan_from_params(seed_params(pdl, [mine_pdl])[0], pdl) == mine_pdl
    assert suggest(FixedTrial({"rms_norm": False, "gated_act": False, "cuda_graph": True, "pdl": True}),
                   pdl) == Plan((), {}, True, True)
    assert BucketSpace.from_json(pdl.to_json()) == pdl
    assert plan_of(mine_pdl.to_json()) == mine_pdl  # what a worker builds keeps every option
    old = {k: v for k, v in pdl.to_json().items() if k != "pdl"}
    assert BucketSpace.from_json(old).pdl is False


# ---- end to end ----------------------------------------------------------------------


def test_cli_tune_two_buckets_writes_a_recipe_that_loads_and_applies(tmp_path):
    out = tmp_path / "recipe.json"
    # Two trials per bucket: its seeds "nothing fused" and the predicted best (a third, each
    # compiled again when the best plans are re-timed, added ~5 s a bucket).
    res = CliRunner().invoke(app, ["tune", "examples/tiny_llama.py", "--shapes", "8,16",
                                   "--trials", "2", "--rep-ms", "10", "--device", "cpu",
                                   "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "tuned plan per bucket" in res.output and (tmp_path / "recipe.json.journal").exists()
    recipe = load_recipe(out)
    assert [b.max_len for b in recipe.buckets] == [8, 16]
    for b in recipe.buckets:
        m = b.measured
        assert m["trials"] == 2 and m["failures"] == {} and m["tuned_ms"] > 0 and m["unfused_ms"] > 0
    assert recipe.model["phase"] == "prefill" and len(recipe.model["fingerprint"]) == 64
    assert recipe.environment["device_type"] == "cpu"
    # The predicted-best seed (every fusion on) ran, applied sites and passed verification.
    trials = _trials(_options(Path("examples/tiny_llama.py"), out), _study_of(recipe, 8))
    assert any(t.state == TrialState.COMPLETE and t.user_attrs["applied"] > 0 for t in trials)
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, CPU, torch.float32)
    fast = apply(model, recipe, strict=True)
    for t in (5, 13):
        x = inputs_for(mf, t, 1, CPU)
        got, want = first_tensor(call(fast, x)), first_tensor(call(model, x))
        assert max_violation(got, want, tolerance(torch.float32, model=True)) <= 0


def _study_of(recipe, length: int) -> str:
    fp, dtype = recipe.model["fingerprint"][:8], recipe.model["dtype"]
    return f"tiny_llama-{fp}-{dtype}-b1-cpu-len{length}"


def test_tune_with_a_raising_forward_is_one_line_and_writes_nothing(tmp_path):
    model = tmp_path / "model.py"
    model.write_text(TINY.replace("return self.n2(", "raise RuntimeError('boom'); return self.n2("))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "tune", str(model), "--shapes", "4",
                           "--device", "cpu", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "forward failed: RuntimeError: boom" in lines[0], proc.stderr
    assert not out.exists() and not Path(f"{out}.journal").exists()


# ---- faults --------------------------------------------------------------------------


def test_injected_faults_fail_with_their_reason_and_are_never_chosen(tiny, tmp_path, monkeypatch):
    """The seeded plans hit two faults whatever the sampler draws (the no-matrix-kernel
    seed applies rms_norm: mismatch; the predicted seed folds n1 into the projections and
    applies add_rms_norm: nan); the third may be drawn. Every failed trial fails with a
    reason its plan can give; every completed one applied no faulty family."""
    faults = [("rms_norm", "wrong"), ("add_rms_norm", "nan"), ("gated_act", "compile")]
    monkeypatch.setenv("ADVISOR_FAULT", ",".join(f"{f}:{k}" for f, k in faults))
    result = tune(_options(tiny, tmp_path / "r.json", trials=10, seed=5))
    (bucket,) = result.buckets
    trials = _trials(_options(tiny, tmp_path / "r.json"), bucket.study)
    assert len(trials) == 10
    for t in trials:
        _check_fault_outcome(t, faults)
    assert {"mismatch", "nan"} <= set(bucket.failures) <= {"compile_error", "mismatch", "nan"}
    assert bucket.failures == dict(Counter(t.user_attrs["failure"] for t in trials
                                           if t.state == TrialState.FAIL))
    assert not {f for f, _ in faults} & set(bucket.plan.fusions)
    assert load_recipe(tmp_path / "r.json").buckets[0].measured["failures"] == bucket.failures


def test_dead_and_hung_workers_are_replaced_and_the_study_goes_on(tiny, tmp_path, monkeypatch):
    # Seeded plans hit both: the predicted one folds n1 into the gate/up GEMM with SwiGLU
    # (exit), the one without matrix kernels applies rms_norm (hang). The climb's plans
    # after them may hit either again (each plan once a run); any must fail as its plan can.
    # 12 s a stage: a real compile stage must not pass it with two pytest workers on 2 cores.
    faults = [("rms_norm_swiglu", "exit"), ("rms_norm", "hang")]
    monkeypatch.setenv("ADVISOR_FAULT", ",".join(f"{f}:{k}" for f, k in faults))
    result = tune(_options(tiny, tmp_path / "r.json", trials=9, seed=3093, trial_timeout_s=12.0))
    (bucket,) = result.buckets
    trials = _trials(_options(tiny, tmp_path / "r.json"), bucket.study)
    assert len(trials) == 9 and result.worker_restarts >= 2
    for t in trials:
        _check_fault_outcome(t, faults)
    assert set(bucket.failures) == {"crash", "timeout"}
    first_crash = min(t.number for t in trials if t.user_attrs.get("failure") == "crash")
    assert any(t.state == TrialState.COMPLETE for t in trials if t.number > first_crash)


# ---- storage: resume and concurrency -------------------------------------------------


def test_same_seed_same_search_and_a_rerun_with_more_trials_resumes(tiny, tmp_path):
    runs = [tune(_options(tiny, tmp_path / f"r{i}.json", trials=3, seed=7)).buckets[0]
            for i in range(2)]
    seen = [[t.params for t in _trials(_options(tiny, tmp_path / f"r{i}.json"), r.study)]
            for i, r in enumerate(runs)]
    # Same seed, same search. Which of the trials wins is timed, and on a busy CPU (two
    # pytest workers) the unfused and fused plans of this tiny model trade places.
    assert seen[0] == seen[1]
    options = _options(tiny, tmp_path / "r0.json", trials=5, seed=7)
    before = _trials(options, runs[0].study)
    (again,) = tune(options).buckets
    after = _trials(options, runs[0].study)
    assert [(t.number, t.params, t.value) for t in after[:3]] == \
           [(t.number, t.params, t.value) for t in before]
    assert len(after) == 5 and again.trials == 5 and again.ran == 2


def _wait_for(predicate, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.5)


def test_kill_9_mid_trial_then_the_same_command_resumes(tiny, tmp_path):
    """The parent is killed -9 while trial 1 (the predicted-best seed, every fusion on) hangs;
    the rerun marks it FAIL (crash), retries its parameters and keeps trial 0."""
    out = tmp_path / "r.json"
    env = {**os.environ, "ADVISOR_FAULT": "add_rms_norm:hang"}  # applied in every plan that enables it
    proc = subprocess.Popen([sys.executable, "-m", "advisor.cli", "tune", str(tiny), "--shapes", "8",
                             "--trials", "4", "--rep-ms", "10", "--device", "cpu", "--out", str(out)],
                            env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    options = _options(tiny, out, trials=4)
    name = "tiny-"  # the study name starts with the model file's stem

    def running() -> list:
        if not Path(f"{out}.journal").exists():
            return []
        storage, _ = open_storage(options)
        studies = [s.study_name for s in optuna.get_all_study_summaries(storage)
                   if s.study_name.startswith(name)]
        trials = _trials(options, studies[0]) if studies else []
        return [t for t in trials if t.state == TrialState.RUNNING and t.number == 1]

    try:
        _wait_for(lambda: bool(running()))
        time.sleep(1.0)
    finally:
        proc.kill()
        proc.wait()
    (bucket,) = tune(options).buckets
    trials = _trials(options, bucket.study)
    assert trials[0].state == TrialState.COMPLETE and not trials[0].user_attrs.get("retry_of")
    assert trials[1].state == TrialState.FAIL and trials[1].user_attrs["failure"] == "crash"
    retry = [t for t in trials if t.user_attrs.get("retry_of") == 1]
    assert len(retry) == 1 and retry[0].state == TrialState.COMPLETE
    assert retry[0].params == trials[1].params
    assert len(trials) == 4 and bucket.failures == {"crash": 1}


def test_two_workers_and_two_runs_share_one_journal_without_losing_trials(tiny, tmp_path):
    (bucket,) = tune(_options(tiny, tmp_path / "a.json", trials=4, workers=2)).buckets
    trials = _trials(_options(tiny, tmp_path / "a.json"), bucket.study)
    assert sorted(t.number for t in trials) == list(range(4)) and bucket.ran == 4
    assert {t.user_attrs.get("worker") for t in trials[:2]} == {0, 1}
    # Two runs at once on one journal file and study: numbers unique, count = sum of runs.
    journal, results = str(tmp_path / "shared.journal"), []

    def run(i: int) -> None:
        opts = _options(tiny, tmp_path / f"r{i}.json", trials=2, storage=journal, study="shared")
        results.append(tune(opts).buckets[0])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 2
    trials = _trials(_options(tiny, tmp_path / "x.json", storage=journal), "shared-len8")
    done = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.FAIL)]
    assert len({t.number for t in trials}) == len(trials)
    assert len(done) == results[0].ran + results[1].ran
    assert not [t for t in trials if t.state == TrialState.RUNNING]


def test_a_running_trial_without_an_owner_yet_is_not_recovered_as_dead(monkeypatch):
    """Two runs on one journal: the other run's trial, RUNNING for the instant before its
    objective names its owner, is left alone; an ownerless one past the grace is failed
    (crash) and its parameters re-enqueued; a live owner's trial is never touched."""
    from advisor.search import study as st
    from advisor.search.objective import OWNER

    study = optuna.create_study()
    fresh = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    live = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    live.set_user_attr("owner", OWNER)  # this process: alive
    assert st.recover_stale(study) == []
    monkeypatch.setattr(st, "OWNERLESS_GRACE_S", -1.0)
    assert st.recover_stale(study) == [fresh.number]
    states = {t.number: t.state for t in study.get_trials()}
    assert states[fresh.number] == TrialState.FAIL and states[live.number] == TrialState.RUNNING


def test_seed_configs_stored_before_an_axis_match_the_space():
    # A recipe tuned before the GEMMs' TMA axis stores its configs without TMA; the space
    # lists them with TMA=0. The seed must keep its config, not fall back to the default.
    from advisor.kernels.space import decode, encode

    old = "BLOCK_K=512,BLOCK_M=1,BLOCK_N=16,GROUP_M=8,SPLIT_K=1,num_stages=1,num_warps=4"
    listed = encode({**decode(old), "TMA": 0})
    space = BucketSpace(1, 0, (FamilySpace("rms_norm_linear", "rmsnorm_linear", 8, 0.1,
                                           ("", listed)),))
    first = seed_params(space, [Plan(("rms_norm_linear",), {"rms_norm_linear": old})])[0]
    assert first == {"rms_norm_linear": True, "rms_norm_linear.config": listed}
    from advisor.search.space import canonical_config

    assert canonical_config("rms_norm_linear", old) == listed
    # Not a config of that kernel (or no kernel behind the family): left as it is.
    assert canonical_config("rms_norm_linear", "BLOCK_N=7") == "BLOCK_N=7"
    assert canonical_config("qkv_merge", "X=1") == "X=1"
    assert canonical_config("rms_norm_linear", "") == ""


def test_neighbours_switch_one_family_or_flag():
    from advisor.search.space import neighbour_params

    space = BucketSpace(512, 128, (
        FamilySpace("rms_norm", "rms_norm", 2, 0.05, ("", "BLOCK_N=128")),
        FamilySpace("gated_act", "gated_act", 1, 0.01),
        FamilySpace("linear_residual", "gemm_epilogue", 8, 0.20, ("", "BLOCK_M=64")),
        FamilySpace("rope", "rope", 8, 0.10)), cuda_graph=True)
    best = {"rms_norm": True, "rms_norm.config": "BLOCK_N=128", "gated_act": True,
            "linear_residual": False, "rope": False, "cuda_graph": True}
    got = [plan_from_params(p, space) for p in neighbour_params(space, best)]
    assert got == [
        # off -> on, largest predicted saving first, with the default config
        Plan(("rms_norm", "gated_act", "linear_residual"), {"rms_norm": "BLOCK_N=128"}, True),
        Plan(("rms_norm", "gated_act", "rope"), {"rms_norm": "BLOCK_N=128"}, True),
        # on -> off, smallest predicted saving first; the config goes with its family
        Plan(("rms_norm",), {"rms_norm": "BLOCK_N=128"}, True),
        Plan(("gated_act",), {}, True),
        Plan(("rms_norm", "gated_act"), {"rms_norm": "BLOCK_N=128"}, False)]
    assert best not in neighbour_params(space, best)


def test_neighbours_change_what_runs_not_only_the_parameters():
    """A family the plan lists but that applied at no site is not switched off (nothing
    would change), and a family whose every site a family of the plan takes first is
    switched on with that one off (H100, session 28: light + linear_residual was the light
    plan; add_rms_norm takes the residual add first)."""
    from advisor.search.space import neighbour_params

    fams = (FamilySpace("add_rms_norm_linear", "rmsnorm_linear", 16, 0.30),
            FamilySpace("rms_norm", "rms_norm", 2, 0.05),
            FamilySpace("add_rms_norm", "add_rms_norm", 16, 0.10),
            FamilySpace("linear_residual", "gemm_epilogue", 16, 0.20),
            FamilySpace("rope", "rope", 8, 0.01))
    # the rewrite's order: the norm → projections site, then the add + norm (holding one of
    # its nodes), then the GEMM + add (holding the add), then the others
    sites = (("add_rms_norm_linear", ()), ("add_rms_norm", (0,)), ("linear_residual", (1,)),
             ("rms_norm", ()), ("rope", ()))
    space = BucketSpace(512, 128, fams, sites=sites)
    light = {"rms_norm": True, "add_rms_norm": True, "add_rms_norm_linear": False,
             "linear_residual": False, "rope": True}
    got = [plan_from_params(p, space).fusions for p in neighbour_params(space, light)]
    assert got == [("add_rms_norm_linear", "rms_norm", "add_rms_norm", "rope"),  # takes the norms: plain
                   ("rms_norm", "linear_residual", "rope"),   # the adds' taker goes
                   ("rms_norm", "add_rms_norm"),              # then the usual offs
                   ("add_rms_norm", "rope"), ("rms_norm", "rope")]
    # Where the trial recorded what applied, a family that applied nowhere stays as it is,
    # and one that did not apply takes no site from linear_residual either.
    applied = {"add_rms_norm": 16, "rope": 8}
    got = [plan_from_params(p, space).fusions for p in neighbour_params(space, light, applied)]
    assert ("add_rms_norm", "rope") not in got and ("rms_norm", "add_rms_norm") in got
    # add_rms_norm waits behind add_rms_norm_linear: linear_residual's site only waits behind
    # a waiting one, which the next round may give back — offered plain.
    deep = {**light, "add_rms_norm_linear": True}
    got = [plan_from_params(p, space).fusions for p in neighbour_params(space, deep)]
    assert ("add_rms_norm_linear", "rms_norm", "add_rms_norm", "linear_residual", "rope") in got
    # add_rms_norm applied at fewer sites than recorded (one refused): the one it did not
    # take is linear_residual's in the same round — offered plain too.
    two = replace(space, sites=(("add_rms_norm", ()), ("add_rms_norm", ()), ("linear_residual", (0,)),
                                ("linear_residual", (1,)), ("rms_norm", ()), ("rope", ())))
    half = {"rms_norm": 2, "add_rms_norm": 1, "rope": 8}
    got = [plan_from_params(p, two).fusions for p in neighbour_params(two, light, half)]
    assert ("rms_norm", "add_rms_norm", "linear_residual", "rope") in got
    got = [plan_from_params(p, two).fusions for p in neighbour_params(two, light, {**half, "add_rms_norm": 2})]
    assert ("rms_norm", "linear_residual", "rope") in got
    # Not recorded (a space from before): every family on is offered plain.
    old = replace(space, sites=())
    got = [plan_from_params(p, old).fusions for p in neighbour_params(old, light)]
    assert ("rms_norm", "add_rms_norm", "linear_residual", "rope") in got
    assert BucketSpace.from_json(space.to_json()) == space


def test_recorded_site_order_is_what_the_rewrite_does():
    """describe_bucket's record of which site takes a node first, on a tiny Llama, against
    what apply() does: linear_residual beside add_rms_norm applies nowhere; beside the
    deeper add_rms_norm_swiglu, which makes add_rms_norm wait at the MLP norms, the
    post-attention adds are linear_residual's in the next round (a review's case)."""
    from advisor.analyze import costs_from
    from advisor.profile import load_or_measure
    from advisor.search.space import blocked_by, describe_bucket
    from tests.hf_models import ids, tiny_hf

    model = tiny_hf("Llama")
    space = describe_bucket(model, ids(8), costs_from(load_or_measure(torch.device("cpu"))),
                            8, 0, False)
    light = ("rms_norm", "add_rms_norm", "gated_act", "rope")
    assert blocked_by(space, "linear_residual", light) == {"add_rms_norm"}
    assert blocked_by(space, "linear_residual", ("rms_norm", "gated_act", "rope")) == set()
    assert blocked_by(space, "add_rms_norm_linear", light) == set()
    swiglu = ("add_rms_norm_swiglu", "add_rms_norm")
    assert blocked_by(space, "linear_residual", swiglu) == set()

    def sites(plan):
        fast = apply(model, Plan(plan))
        fast(**ids(8))  # rewritten at the first call
        return {r["family"]: r["applied"] for r in fast.summary() if r["family"] != "(all)"}
    assert sites((*light, "linear_residual"))["linear_residual"] == 0
    assert sites(("rms_norm", "gated_act", "rope", "linear_residual"))["linear_residual"] == 4
    assert sites((*swiglu, "linear_residual"))["linear_residual"] == 2


def _climb_space():
    return BucketSpace(512, 128, tuple(FamilySpace(f, f, 1, s) for f, s in
                                       (("rms_norm", 0.3), ("gated_act", 0.2), ("rope", 0.1),
                                        ("attention", 0.05))))


def _climb_objective(space):
    cost = {"rms_norm": -1.0, "gated_act": -0.5, "rope": 0.4, "attention": 0.2}

    def objective(trial):
        plan = suggest(trial, space)
        return 10.0 + sum(cost[f] for f in plan.fusions)
    return objective


def test_study_climbs_from_its_seed_before_it_samples():
    # A synthetic objective whose optimum is four switches from the seed: the climb reaches
    # it in the trials right after the seed, each plan measured once, nothing left waiting.
    from advisor.search.climb import ClimbSampler
    from advisor.search.space import plan_params

    space = _climb_space()
    study = optuna.create_study(sampler=ClimbSampler(optuna.samplers.TPESampler(seed=0), space))
    study.enqueue_trial(plan_params(Plan(("rope", "attention")), space))
    study.optimize(_climb_objective(space), n_trials=8)
    trials = study.get_trials(states=(TrialState.COMPLETE,))
    plans = [plan_from_params(t.params, space).fusions for t in trials]
    assert plans[:5] == [("rope", "attention"),                       # the seed: 10.6
                         ("rms_norm", "rope", "attention"),           # 9.6, climbed from
                         ("rms_norm", "gated_act", "rope", "attention"),  # 9.1
                         ("rms_norm", "gated_act", "rope"),           # 8.9
                         ("rms_norm", "gated_act")]                   # 8.5: the optimum
    assert study.best_value == 8.5
    assert [t.user_attrs.get("climb_of") for t in trials[:5]] == [None, 0, 1, 2, 3]
    # the optimum's untried neighbours next, then TPE samples
    assert plans[5:7] == [("rms_norm", "gated_act", "attention"), ("rms_norm",)]
    assert len(study.trials) == 8 and len(set(plans[:7])) == 7
    # The asking trial (running, no parameters yet) hides no plan: with one family, the
    # unfused plan is the only neighbour of a best that has it on, and it is offered.
    one = BucketSpace(512, 128, (FamilySpace("rope", "rope", 1, 0.1),))
    solo = optuna.create_study(sampler=ClimbSampler(optuna.samplers.TPESampler(seed=0), one))
    solo.enqueue_trial(plan_params(Plan(("rope",)), one))
    solo.optimize(_climb_objective(one), n_trials=1)
    solo.ask()  # RUNNING, no parameters suggested yet
    asking = solo.get_trials()[1]
    assert asking.user_attrs["climb_of"] == 0 and asking.system_attrs["climb_params"] == {"rope": False}
    # A plan this run finished is not offered again, however it failed (a timeout too).
    timed = optuna.create_study(sampler=ClimbSampler(optuna.samplers.TPESampler(seed=0), space))
    timed.enqueue_trial(plan_params(Plan(("rope",)), space))
    timed.enqueue_trial(plan_params(Plan(("rms_norm", "rope")), space))

    def first_times_out(trial):
        if trial.number == 1:
            suggest(trial, space)
            trial.set_user_attr("failure", "timeout")
            raise RuntimeError("timeout")
        return _climb_objective(space)(trial)
    timed.optimize(first_times_out, n_trials=4, catch=(RuntimeError,))
    later = [plan_from_params(t.params, space).fusions for t in timed.trials[2:]]
    assert ("rms_norm", "rope") not in later
    # A run stopped by time leaves nothing waiting (its next run starts with its own seeds).
    study.optimize(_climb_objective(space), timeout=0.5)
    assert not study.get_trials(states=(TrialState.WAITING,))


def test_climb_counts_a_plan_in_any_spelling_and_retries_what_may_pass_now():
    from advisor.search.climb import ClimbSampler
    from advisor.search.objective import _same_plan

    old = "BLOCK_K=512,BLOCK_M=1,BLOCK_N=16,GROUP_M=8,SPLIT_K=1,num_stages=1,num_warps=4"
    listed = old.replace("SPLIT_K=1,", "SPLIT_K=1,TMA=0,")
    space = BucketSpace(1, 0, (FamilySpace("rms_norm_linear", "rmsnorm_linear", 8, 0.2, ("", listed)),
                               FamilySpace("rope", "rope", 8, 0.1)))
    dist = {"rms_norm_linear": optuna.distributions.CategoricalDistribution([True, False]),
            "rms_norm_linear.config": optuna.distributions.CategoricalDistribution(["", listed, old]),
            "rope": optuna.distributions.CategoricalDistribution([True, False])}

    def trial(params, value=None, failure=None):
        plan = plan_from_params(params, space)
        return optuna.trial.create_trial(
            params=params, distributions={k: dist[k] for k in params}, value=value,
            state=TrialState.COMPLETE if failure is None else TrialState.FAIL,
            user_attrs={"plan": plan.to_json(), **({"failure": failure} if failure else {})})

    # A journal's trial stored the config without TMA (its best), and one with rope on.
    best = trial({"rms_norm_linear": True, "rms_norm_linear.config": old, "rope": False}, 1.0)
    sampler = ClimbSampler(optuna.samplers.TPESampler(seed=0), space)
    # Its neighbour "rope on" has not been tried: the climb offers it, spelled as listed.
    assert sampler.next_climb([best])[1] == {"rms_norm_linear": True,
                                             "rms_norm_linear.config": listed, "rope": True}
    # Tried already in the new spelling: not offered again (nor rms_norm_linear off, tried too).
    again = trial({"rms_norm_linear": True, "rms_norm_linear.config": listed, "rope": True}, 2.0)
    off = trial({"rms_norm_linear": False, "rope": False}, 3.0)
    assert sampler.next_climb([best, again, off]) is None
    # A timeout may pass next time: offered again; a mismatch would fail again: not.
    timed_out = trial({"rms_norm_linear": True, "rms_norm_linear.config": listed, "rope": True},
                      failure="timeout")
    assert sampler.next_climb([best, timed_out, off])[1]["rope"] is True
    mismatch = trial({"rms_norm_linear": True, "rms_norm_linear.config": listed, "rope": True},
                     failure="mismatch")
    assert sampler.next_climb([best, mismatch, off]) is None
    # The best trial's record of what applied is read: rms_norm_linear applied nowhere, so
    # switching it off is no neighbour (only rope on, tried already, is left).
    idle = optuna.trial.create_trial(
        params=best.params, distributions=best.distributions, value=1.0,
        user_attrs={**best.user_attrs, "applied_families": {}})
    assert sampler.next_climb([idle, again]) is None
    assert sampler.next_climb([best, again])[1] == {"rms_norm_linear": False, "rope": False}
    # The objective repeats an outcome across spellings too (not building the plan again).
    study = optuna.create_study()
    study.add_trial(best)
    assert _same_plan(study, plan_from_params(
        {"rms_norm_linear": True, "rms_norm_linear.config": listed, "rope": False}, space)) is not None
