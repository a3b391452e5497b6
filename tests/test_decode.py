"""Decode phase: one token against a filled KV cache, for a hand-written model and a
transformers model with a static cache; cache state is restored; greedy tokens match."""

import sys

import torch

from advisor.analyze import find_candidates
from advisor.loader import build, call, first_tensor, inputs_for, load_model_file
from advisor.profile.ceilings import Ceilings
from advisor.runtime.apply import apply
from advisor.runtime.plan import ALL_FUSIONS
from advisor.state import Snapshot

CPU = torch.device("cpu")
CEIL = Ceilings("cpu", "cpu", 20.0, {"float32": 0.3}, 2.0, None, {}, "", "")


def _decode(path, ctx=12, batch=2):
    mf = load_model_file(path)
    model = build(mf, CPU, torch.float32)
    return mf, model, inputs_for(mf, ctx, batch, CPU, phase="decode", dtype=torch.float32)


def test_decode_candidates_include_cache_writes():
    for path in ("examples/tiny_llama.py", "examples/llama_hf.py"):
        _, model, x = _decode(path)
        fams = {c.family: c.count for c in find_candidates(model, x, CEIL)}
        assert fams.get("rope_kv_cache") == 2 and fams.get("add_rms_norm") == 4, (path, fams)


def test_decode_apply_matches_eager_and_state_is_restored(decode_steps):
    """`decode_steps` (conftest): each example's step, eager then fused from the restored cache."""
    for path in ("examples/tiny_llama.py", "examples/llama_hf.py"):
        step = decode_steps[path]
        assert step.eager_wrote_cache, path  # the step wrote its keys/values into the cache
        assert step.restored, path
        torch.testing.assert_close(step.got, step.ref, atol=1e-4, rtol=1e-4)


def _greedy_tiny(model, prompt, steps, s_max):
    d = model.d
    cache = [(torch.zeros(prompt.shape[0], d.kv_heads, s_max, d.head_dim),
              torch.zeros(prompt.shape[0], d.kv_heads, s_max, d.head_dim)) for _ in range(d.layers)]
    t = prompt.shape[1]
    with torch.no_grad():
        logits = model(prompt, cache, torch.arange(t))
        out = []
        for i in range(steps):
            nxt = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
            out.append(nxt)
            logits = model(nxt, cache, torch.tensor([t + i]))
    return torch.cat(out, dim=1)


def test_greedy_tokens_identical_over_32_steps_fp32(monkeypatch):
    mf = load_model_file("examples/tiny_llama.py")
    # The example model at half its CPU widths (GQA, a hidden size off the powers of two and
    # 2 layers kept): 33 fused forwards, each interpreted kernel with fewer programs.
    example = sys.modules[mf.build_model.__module__]
    small = example.Dims(vocab=64, dim=64, hidden=96, layers=2, heads=4, kv_heads=2)
    monkeypatch.setattr(example, "dims_for", lambda device: small)
    model = build(mf, CPU, torch.float32)
    assert model.d == small
    prompt = torch.randint(0, model.d.vocab, (2, 7), generator=torch.Generator().manual_seed(1))
    want = _greedy_tiny(model, prompt, 32, 64)
    fast = apply(model, ALL_FUSIONS, length_of=lambda a, k: 64)
    fast.d = model.d
    got = _greedy_tiny(fast, prompt, 32, 64)
    assert torch.equal(got, want)
    assert [r["compiles"] for r in fast.summary() if r["family"] == "(all)"] == [2]  # prompt + T=1 step


def test_tune_decode_phase_writes_a_decode_recipe(tmp_path):
    import subprocess
    import sys

    from advisor.runtime.recipe import load_recipe

    out = tmp_path / "decode.json"
    proc = subprocess.run([sys.executable, "-m", "advisor.cli", "tune", "examples/tiny_llama.py",
                           "--phase", "decode", "--shapes", "24", "--trials", "2", "--device", "cpu",
                           "--rep-ms", "20", "--out", str(out)],
                          capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "TRITON_INTERPRET": "0"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipe = load_recipe(out)
    assert recipe.model["phase"] == "decode" and recipe.buckets[0].max_len == 24
    assert recipe.buckets[0].measured["trials"] == 2


def test_every_committed_recipe_loads_and_the_decode_deep_plan_matches_eager():
    """recipes/ holds what the README and NOTES run on the H200: each must load, and the
    decode plan with GEMV-path configs (configs tuned for Llama-3-8B widths fall back to the
    defaults at tiny widths) must give eager's decode step on the transformers model."""
    from pathlib import Path

    from advisor.runtime.recipe import load_recipe

    for path in sorted(Path("recipes").glob("*.json")):
        assert load_recipe(path).buckets, path
    _, model, x = _decode("examples/llama_hf.py", batch=1)
    snap = Snapshot(x)
    with torch.no_grad():
        ref = first_tensor(call(model, x))
        snap.restore()
        fast = apply(model, load_recipe("recipes/decode-fused-cudagraph.plan.json"),
                     length_of=lambda a, k: 12)
        out = first_tensor(call(fast, x))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    rows = fast.summary()
    applied = {r["family"]: r.get("applied") for r in rows}
    assert applied["linear_residual"] > 0 and applied["attention"] == 2 and applied["rope_kv_cache"] == 2, rows
    # per layer: norm+gate/up+SwiGLU in one GEMM; the final norm reaches lm_head through
    # the `alias` of a full-range slice; the layers' copies of the additive mask merge
    assert applied["rms_norm_swiglu"] + applied["add_rms_norm_swiglu"] == 2
    assert applied["add_rms_norm_linear"] == 2  # layer 1's QKV and lm_head
    assert rows[-1]["repeats_merged"] > 0
