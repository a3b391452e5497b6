"""apply(): the rewritten model matches the original in and across buckets, with fewer
launches, without recompiling inside a bucket; nothing global is patched."""

import warnings

import pytest
import torch

from advisor.kernels.testing import max_violation, tolerance
from advisor.loader import build, call, first_tensor, inputs_for, load_model_file
from advisor.runtime.apply import apply
from advisor.runtime.plan import ALL_FUSIONS, Plan
from advisor.runtime.recipe import Bucket, Recipe
from tests.hf_models import ids, tiny_hf

CPU = torch.device("cpu")


def _check_close(out, ref, dtype):
    excess = max_violation(first_tensor(out), first_tensor(ref), tolerance(dtype, model=True))
    assert excess <= 0, f"exceeds tolerance by {excess}"


def _two_buckets(plan: Plan) -> Recipe:
    return Recipe(buckets=(Bucket(8, plan), Bucket(32, plan)))


@pytest.mark.parametrize("path", ["examples/tiny_llama.py", "examples/llama_hf.py"])
def test_examples_all_fusions_match_and_do_not_recompile(path):
    mf = load_model_file(path)
    model = build(mf, CPU, torch.float32)
    lengths = (3, 5, 8, 13, 21)  # in and across the two buckets
    refs = {t: call(model, inputs_for(mf, t, 2, CPU)) for t in lengths}
    fast = apply(model, _two_buckets(ALL_FUSIONS))
    for t in lengths:
        _check_close(call(fast, inputs_for(mf, t, 2, CPU)), refs[t], torch.float32)
    summary = fast.summary()
    totals = [r for r in summary if r["family"] == "(all)"]
    # one plan, one graph: the two buckets share one symbolic compile across all lengths
    assert fast.buckets[8] is fast.buckets[32] and fast.buckets[8].compiles == 1, totals
    assert [r["graph_shared_with"] for r in totals] == [[32], [8]]
    # cold-start accounting: the rewrite's host time, confirmations part of it
    assert all(r["rewrite_s"] >= r["confirm_s"] >= 0 and r["rewrite_s"] > 0 for r in totals), totals
    # the first call holds its trace (before the first rewrite) and the rewrite
    assert all(r["first_call_s"] >= r["trace_s"] + r["rewrite_s"] and r["trace_s"] > 0 for r in totals), totals
    assert all(r["launches_after"] < r["launches_before"] for r in totals)
    applied = {r["family"]: r["applied"] for r in summary if r["bucket"] == 8 and "applied" in r}
    # Deepest first: norms folded into the projections that read them (into gate/up with
    # SwiGLU in the same GEMM), then what is left.
    for fam in ("add_rms_norm_linear", "rms_norm_linear", "add_rms_norm_swiglu", "attention_rope"):
        assert applied[fam] > 0, (fam, summary)


def test_one_token_bucket_traces_static_shapes_and_recompiles_once_for_another_batch(monkeypatch):
    """A bucket of one token holds one length: traced with static shapes (a symbolic trace
    was half of a first call); another batch size recompiles it once, symbolic (dynamo's
    automatic dynamic), and later batch sizes reuse that graph."""
    import advisor.runtime.apply as apply_module

    symbolic = []  # per compile: does the captured graph hold symbolic sizes?
    real_rewrite = apply_module.rewrite

    def spy(gm, *args, **kwargs):
        symbolic.append(any(isinstance(n.meta.get("val"), torch.SymInt) for n in gm.graph.nodes
                            if n.op == "placeholder"))
        return real_rewrite(gm, *args, **kwargs)

    monkeypatch.setattr(apply_module, "rewrite", spy)
    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, CPU, torch.float32)
    plan = Plan(("add_rms_norm", "rope"))
    fast = apply(model, Recipe(buckets=(Bucket(1, plan), Bucket(8, plan))))
    for batch in (1, 2, 3):
        x = inputs_for(mf, 1, batch, CPU)
        _check_close(call(fast, x), call(model, x), torch.float32)
    call(fast, inputs_for(mf, 5, 1, CPU))  # the 8-token bucket: symbolic from the start
    assert symbolic == [False, True, True]
    assert fast.buckets[1].compiles == 2 and fast.buckets[8].compiles == 1
    assert all(s.applied for r in fast.buckets[1].reports for s in r.sites)


def test_norm_and_mlp_fusions_without_the_norm_prologue():
    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, CPU, torch.float32)
    x = inputs_for(mf, 7, 2, CPU)
    ref = call(model, x)
    fast = apply(model, Plan(("rms_norm", "add_rms_norm", "gate_up_swiglu", "rope", "qkv_merge")))
    _check_close(call(fast, x), ref, torch.float32)
    applied = {r["family"]: r["applied"] for r in fast.summary() if "applied" in r}
    assert applied == {"rms_norm": 1, "add_rms_norm": 4, "gate_up_swiglu": 2, "rope": 2, "qkv_merge": 2}


def test_shallower_alternatives_apply_when_the_deeper_fusion_is_off():
    """Without gate_up_swiglu, the same MLP sites take gate/up merge + gated activation."""
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, CPU, torch.float32)
    x = inputs_for(mf, 6, 2, CPU)
    ref = call(model, x)
    fast = apply(model, Plan(("gated_act", "gate_up_merge")))
    _check_close(call(fast, x), ref, torch.float32)
    applied = {r["family"]: r["applied"] for r in fast.summary() if "applied" in r}
    assert applied == {"gated_act": 2, "gate_up_merge": 2}


@pytest.mark.parametrize("family", ["Gemma", "Qwen2", "GPTNeoX", "Cohere"])
def test_other_transformers_families(family):
    model = tiny_hf(family)
    refs = {t: model(**ids(t)) for t in (4, 11)}
    fast = apply(model, ALL_FUSIONS)
    for t, ref in refs.items():
        _check_close(fast(**ids(t)), ref, torch.float32)
    totals = [r for r in fast.summary() if r["family"] == "(all)"][0]
    assert totals["compiles"] == 1 and totals["launches_after"] < totals["launches_before"]


def test_biased_qkv_merge_reads_adjacent_biases_without_copies():
    """Qwen2's q/k/v projections carry biases: apply lays them out back to back, like the
    weights, so the merged GEMM reads one (ΣN,) view and copies nothing per call."""
    from advisor.kernels import merged_linear as ml

    model = tiny_hf("Qwen2")
    x = ids(6)
    ref = model(**x)
    fast = apply(model, Plan(("qkv_merge",)))
    _check_close(fast(**x), ref, torch.float32)  # first call: traces, rewrites, lays out
    attn = model.model.layers[0].self_attn
    biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
    assert ml.adjacent_view(biases) is not None
    assert ml.adjacent_view([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]) is not None
    before = ml.COPIES
    _check_close(fast(**x), ref, torch.float32)
    assert ml.COPIES == before
    applied = {r["family"]: r["applied"] for r in fast.summary() if "applied" in r}
    assert applied == {"qkv_merge": 2}


def test_merged_bias_with_a_member_without_one():
    """Only some members biased: zeros stand in for the others (correct, one copy)."""
    from advisor.kernels import merged_linear as ml

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, generator=gen)
    ws = [torch.randn(n, 8, generator=gen) for n in (4, 2)]
    bs = [torch.randn(4, generator=gen), None]
    want = torch.cat([torch.nn.functional.linear(x, w, b) for w, b in zip(ws, bs)], dim=-1)
    torch.testing.assert_close(ml.merged_linear_impl(x, ws, bs), want)
    torch.testing.assert_close(ml.merged_linear_impl(x, ws, [None, None]), x @ torch.cat(ws).T)


@pytest.mark.parametrize("family", ["Cohere", "Olmo2", "Ernie4_5"])
def test_bf16_families_fuse_their_fp32_norms_and_rope(family):
    """bf16 models that compute norms and RoPE in fp32 and cast back (Cohere's q.float(),
    Olmo2's fp32 tables, ERNIE 4.5's rotation made in bf16 and then upcast; Gemma's
    w.float(): tests/test_patterns.py): every site is fused, none refused."""
    model = tiny_hf(family, torch.bfloat16)
    ref = model(**ids(9))
    plan = Plan(("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm", "rope_table",
                 "attention_rope", "rope"))
    fast = apply(model, plan)
    _check_close(fast(**ids(9)), ref, torch.bfloat16)
    rows = [r for r in fast.summary() if r["family"] != "(all)"]
    assert not [r for r in rows if r["unfused"]], rows
    applied = {r["family"] for r in rows if r["applied"]}
    assert "attention_rope" in applied and applied & {"rms_norm", "layer_norm"}, applied


def test_bf16_model_within_tolerance():
    model = tiny_hf("Llama", torch.bfloat16)
    ref = model(**ids(9))
    fast = apply(model, ALL_FUSIONS)
    _check_close(fast(**ids(9)), ref, torch.bfloat16)


def test_beyond_largest_bucket_and_unfused_plan():
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, CPU, torch.float32)
    recipe = Recipe(buckets=(Bucket(4, ALL_FUSIONS),), beyond_largest="unfused")
    fast = apply(model, recipe)
    x = inputs_for(mf, 6, 1, CPU)
    _check_close(call(fast, x), call(model, x), torch.float32)
    assert fast.buckets[4].compiles == 0  # the 6-token call ran the original model


class _Untraceable(torch.nn.Module):
    """Eager works; under dynamo a branch multiplies by a (3, 3) matrix that x (..., 4) does
    not fit: the trace fails on fake tensors (as transformers' GLM-4-MoE-Lite did, on a
    branch taken only while compiling)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        if torch.compiler.is_compiling():
            return x @ torch.ones(3, 3)
        return torch.relu(x @ self.w)


def test_a_model_dynamo_cannot_trace_runs_unfused_with_one_warning():
    model, x = _Untraceable(), torch.randn(2, 5, 4)
    fast = apply(model, ALL_FUSIONS)
    with pytest.warns(UserWarning, match="cannot trace this model"):
        out = fast(x)
    torch.testing.assert_close(out, model(x))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: later calls run the original quietly
        torch.testing.assert_close(fast(x[:, :3]), model(x[:, :3]))
    total = next(r for r in fast.summary() if r["family"] == "(all)")
    assert "TorchRuntimeError" in total["untraceable"]
    assert not [r for r in fast.summary() if r.get("applied")]  # nothing fused runs
    fast = apply(_Untraceable(), ALL_FUSIONS)
    with pytest.raises(RuntimeError):  # the model's own error is the caller's, as without advisor
        fast(torch.randn(2, 5, 5))
    with pytest.warns(UserWarning, match="cannot trace"):  # and the next call falls back
        assert fast(x).shape == x.shape
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        apply(_Untraceable(), ALL_FUSIONS, strict=True)(x)


class _WritesThenBreaks(_Untraceable):
    """A graph that writes state in place runs before the break; the trace fails after it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(2, 5, 4))

    def forward(self, x):
        self.seen.add_(x)
        torch._dynamo.graph_break()
        return super().forward(x)


def test_a_failed_trace_after_a_graph_ran_is_not_run_again():
    """Running the model again would write its state twice (a review's case: a cache
    doubled): the trace's error is raised instead."""
    model, x = _WritesThenBreaks(), torch.randn(2, 5, 4)
    with pytest.raises(torch._dynamo.exc.TorchDynamoException):
        apply(model, ALL_FUSIONS)(x)
    torch.testing.assert_close(model.seen, x)


def test_apply_patches_nothing_global_and_is_reversible():
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, CPU, torch.float32)
    x = inputs_for(mf, 5, 1, CPU)
    before = call(model, x)
    forward_before = type(model).forward
    fast = apply(model, ALL_FUSIONS)
    call(fast, x)
    assert type(model).forward is forward_before
    assert fast.remove() is model
    _check_close(call(model, x), before, torch.float32)


def test_site_that_fails_confirmation_is_left_unfused(monkeypatch):
    """A kernel returning wrong values at a site is caught before use and reported."""
    import dataclasses

    from advisor.kernels import registry

    spec = registry.get("gated_act")
    wrong = lambda *args, **kw: spec.reference(*args[:3]) * 1.5  # noqa: E731
    monkeypatch.setitem(registry._REGISTRY, "gated_act",
                        dataclasses.replace(spec, launch=wrong, reference=wrong))
    model = tiny_hf("Llama")
    ref = model(**ids(6))
    fast = apply(model, Plan(fusions=("gated_act",)))
    _check_close(fast(**ids(6)), ref, torch.float32)
    row = next(r for r in fast.summary() if r["family"] == "gated_act")
    assert row["applied"] == 0 and row["unfused"] and "mismatch" in row["unfused"][0]


def test_more_accurate_kernel_is_accepted_less_accurate_is_not():
    """A fused op may differ from eager beyond tolerance only where it is at least as
    accurate as eager against a float64 truth (eager rounds each intermediate)."""
    from advisor.runtime.rewrite import _as_accurate

    truth = (torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64),)
    eager = (torch.tensor([1.0625, -2.0, 0.0625]),)      # rounding error 0.0625
    better = (torch.tensor([1.0, -2.0, 0.0]),)
    worse = (torch.tensor([1.25, -2.0, 0.0]),)
    assert _as_accurate(better, eager, truth)
    assert not _as_accurate(worse, eager, truth)
    assert not _as_accurate((torch.tensor([float("nan"), -2.0, 0.0]),), eager, truth)


def test_fp32_summation_order_is_not_a_mismatch_but_a_wrong_kernel_still_is():
    """fp32 sites: our FMA GEMMs sum in another order than cuBLAS and land a few times
    further from float64 (H100: ~1e-6 against ~2e-7 relative), far below anything a model
    can notice; they were refused on the GPU. A kernel 1e-3 off (tf32-sized) still is."""
    from advisor.runtime.rewrite import _as_accurate

    gen = torch.Generator().manual_seed(0)
    truth = (torch.randn(64, 96, generator=gen, dtype=torch.float64) * 8,)
    scale = float(truth[0].abs().max())
    eager = (truth[0].float(),)                                   # one rounding
    noise = torch.randn(64, 96, generator=gen, dtype=torch.float64)
    reordered = ((truth[0] + noise.sign() * 20 * 1.2e-7 * scale).float(),)
    tf32ish = ((truth[0] * (1 + 1e-3 * noise.sign())).float(),)
    assert _as_accurate(reordered, eager, truth)
    assert not _as_accurate(tf32ish, eager, truth)


def test_linear_bias_act_folds_the_mlp_activation_into_the_gemm_epilogue():
    """GPT-NeoX's MLP is gelu(x·Wᵀ + b): one gemm_epilogue per layer, viewed back to
    (B, T, N) with the captured (symbolic) sizes — two lengths, one compile."""
    model = tiny_hf("GPTNeoX")
    refs = {t: model(**ids(t)) for t in (4, 11)}
    fast = apply(model, Plan(("linear_bias_act",)))
    for t, ref in refs.items():
        _check_close(fast(**ids(t)), ref, torch.float32)
    rows = {r["family"]: r for r in fast.summary()}
    assert rows["linear_bias_act"]["applied"] == 2 and rows["(all)"]["compiles"] == 1
    alone = apply(model, Plan(("bias_act",)))  # without it, the elementwise epilogue still applies
    _check_close(alone(**ids(4)), refs[4], torch.float32)
    assert {r["family"]: r for r in alone.summary()}["bias_act"]["applied"] == 2


class _FlatMLP(torch.nn.Module):
    """OPT's spelling: the MLP runs on (B·T, D) rows, so fc1 lowers to an addmm the
    activation reads directly (no view between them)."""

    def __init__(self, d: int = 32, f: int = 48, act: str = "relu"):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d, f), torch.nn.Linear(f, d)
        self.act = {"relu": torch.nn.ReLU(), "gelu": torch.nn.GELU()}[act]

    def forward(self, x):
        b, t, d = x.shape
        return self.fc2(self.act(self.fc1(x.reshape(-1, d)))).view(b, t, d)


@pytest.mark.parametrize("act", ["relu", "gelu"])
def test_bias_act_on_an_addmm_read_directly(act):
    """bias_act where the activation reads the addmm itself: the bias is added once."""
    torch.manual_seed(0)
    model = _FlatMLP(act=act).eval()
    x = torch.randn(2, 5, 32)
    ref = model(x)
    for family in ("bias_act", "linear_bias_act"):  # the act in its own kernel / the GEMM's epilogue
        fast = apply(model, Plan((family,)))
        _check_close(fast(x), ref, torch.float32)
        x2 = torch.randn(3, 7, 32)  # another length: the same graph (one compile)
        _check_close(fast(x2), model(x2), torch.float32)
        row = {r["family"]: r for r in fast.summary()}[family]
        assert row["applied"] == 1 and not row["unfused"], row
        assert {r["family"]: r for r in fast.summary()}["(all)"]["compiles"] == 1


def test_linear_residual_folds_the_residual_add_into_the_projection():
    """o_proj and down_proj each feed a residual add: h = r + x·Wᵀ runs as one gemm_epilogue
    per site (2 per layer), also next to add+norm folded into the following projections
    (the add+norm takes the norm; the add it leaves is the epilogue's)."""
    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, CPU, torch.float32)
    refs = {t: call(model, inputs_for(mf, t, 2, CPU)) for t in (3, 9)}
    for plan in (Plan(("linear_residual",)), Plan(("add_rms_norm_linear", "rms_norm_linear", "linear_residual"))):
        fast = apply(model, plan)
        for t, ref in refs.items():
            _check_close(call(fast, inputs_for(mf, t, 2, CPU)), ref, torch.float32)
        rows = {r["family"]: r for r in fast.summary()}
        assert rows["linear_residual"]["applied"] == 4, rows  # 2 layers x (o_proj, down_proj)
        assert rows["(all)"]["compiles"] == 1
    assert rows["add_rms_norm_linear"]["applied"] > 0


def test_confirmation_inputs_keep_the_models_strides():
    """A site is confirmed on random inputs laid out as the model's: a padded mask row
    (what SDPA's efficient kernel is handed on CUDA: a (1, 1, 1, 1) mask of row stride 16,
    refused when dense) and a broadcast (stride 0) dim stay so, also through the copy each
    side of the comparison gets."""
    from torch import fx

    from advisor.runtime.rewrite import clone_laid_out, random_like

    graph = fx.Graph()
    node = graph.placeholder("mask")
    gen = torch.Generator().manual_seed(0)
    base = torch.empty(1, 1, 1, 16)
    for value, stride in ((base[..., :1], (16, 16, 16, 1)),
                          (torch.empty(2, 1, 3, 5).expand(2, 4, 3, 5), (15, 0, 5, 1))):
        node.meta["val"] = value
        x = random_like(node, gen)
        assert x.shape == value.shape and x.stride() == stride and (x != 0).all()
        copy = clone_laid_out(x)
        assert copy.stride() == stride and torch.equal(copy, x) and copy.data_ptr() != x.data_ptr()


def test_a_config_the_site_does_not_keep_is_said_in_the_summary():
    """A recipe's kernel config that no longer fits its site (here TMA=2, which only large
    16-bit GEMMs keep) runs the default, and the summary says so for the site."""
    from advisor.kernels import gemm
    from advisor.kernels.space import encode

    model = tiny_hf("Llama")
    x = ids(7)
    problem = {"M": 7, "N": 64, "K": 64, "dtype": "torch.float32", "gated": 0}
    refused = encode({**gemm.SPACE.default(problem), "TMA": 2})
    assert not gemm.SPACE.keep(gemm.SPACE.well_formed({**gemm.SPACE.default(problem), "TMA": 2}), problem)
    fast = apply(model, Plan(("linear_residual",), configs={"linear_residual": refused}))
    _check_close(fast(**x), model(**x), torch.float32)
    (row,) = [r for r in fast.summary() if r["family"] == "linear_residual"]
    assert row["applied"] > 0 and row["notes"], row
    assert all("config not kept at this shape, the default ran: " in n and "TMA=2" in n for n in row["notes"])
    plain = apply(model, Plan(("linear_residual",)))
    plain(**x)
    assert not [r for r in plain.summary() if r["family"] == "linear_residual"][0]["notes"]


def test_confirmations_at_once_inside_a_real_trace(monkeypatch):
    """Each round's confirmations run in threads inside dynamo's trace, whose one fake
    mode they share (graph building takes turns): every site confirms and applies as one
    at a time does. Kernels run their references here (TRITON_INTERPRET=0 on the CPU: the
    interpreter is not thread-safe, so the runtime keeps one thread under it)."""
    from advisor.runtime import rewrite as rw

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    mf = load_model_file("examples/llama_hf.py")
    sites = {}
    for workers in (1, 8):
        monkeypatch.setattr(rw, "confirm_workers", lambda w=workers: w)
        fast = apply(build(mf, CPU, torch.float32), Recipe(buckets=(Bucket(8, ALL_FUSIONS),)))
        call(fast, inputs_for(mf, 5, 2, CPU))
        sites[workers] = [(r["family"], r["applied"], r["unfused"]) for r in fast.summary() if "applied" in r]
    assert sites[8] == sites[1]
    assert all(not unfused for _, _, unfused in sites[8]) and sum(n for _, n, _ in sites[8]) > 8


class _Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def test_many_applies_of_one_class_each_compile_their_own(monkeypatch):
    """Each apply compiles its own entry: compiling the module shared its class's forward
    code, and so one recompile limit, across every model of that class in the process;
    past it dynamo ran the forward eager, unfused, and nothing said so."""
    import advisor.runtime.apply as apply_module

    monkeypatch.setattr(apply_module, "RECOMPILE_LIMIT", 2)
    x = torch.randn(2, 3, 16)
    for _ in range(4):  # twice the limit
        model = _Norm()
        fast = apply(model, Plan(("rms_norm",)))
        torch.testing.assert_close(fast(x), model(x))
        rows = {r["family"]: r for r in fast.summary()}
        assert rows["rms_norm"]["applied"] == 1 and rows["(all)"]["compiles"] == 1, rows


class _Broken(torch.nn.Module):
    """Two norms with a graph break between them."""

    def __init__(self):
        super().__init__()
        self.n1, self.n2 = _Norm(), _Norm()

    def forward(self, x):
        h = self.n1(x)
        torch._dynamo.graph_break()  # a print(), an .item(): the rest is this class's code
        return self.n2(h)


def test_applies_past_the_recompile_limit_with_a_graph_break_inside(monkeypatch):
    """Frames past a graph break are the model class's own code, which every apply of the
    class compiles again (another backend); with a fixed limit the applies past it ran
    them eager, unfused, silently ([2, 2, 0, 0, 0] at a limit of 2)."""
    import advisor.runtime.apply as apply_module

    monkeypatch.setattr(apply_module, "RECOMPILE_LIMIT", 2)
    x = torch.randn(2, 3, 16)
    for _ in range(5):
        model = _Broken()
        fast = apply(model, Plan(("rms_norm",)))
        torch.testing.assert_close(fast(x), model(x))
        rows = {r["family"]: r for r in fast.summary()}
        assert rows["rms_norm"]["applied"] == 2, rows


def test_a_dropped_model_is_freed():
    """Dynamo keeps every backend until torch._dynamo.reset(); ours held the wrapper and
    through it the user's model and weights, after the user dropped both."""
    import gc
    import weakref

    refs = []
    for model in (_Norm(), _Broken()):
        fast = apply(model, Plan(("rms_norm",)))
        fast(torch.randn(2, 3, 16))
        fast(torch.randn(2, 5, 16))
        refs += [weakref.ref(model), weakref.ref(fast), weakref.ref(model.get_parameter(
            "w" if isinstance(model, _Norm) else "n2.w"))]
        assert sum(r["applied"] for r in fast.summary() if r["family"] == "rms_norm") >= 1
        del model, fast
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)
