"""Recipes: round trip, and the RELIABILITY.md recipe cases (items 18-24)."""

import json
import sys
import warnings

import pytest
import torch

from advisor.errors import RecipeError
from advisor.loader import build, call, inputs_for, load_model_file
from advisor.runtime.apply import apply
from advisor.runtime.plan import ALL_FUSIONS, Plan
from advisor.runtime.recipe import (
    SCHEMA_VERSION,
    Bucket,
    Recipe,
    load_recipe,
    recipe_from_json,
    save_recipe,
)

GOOD = Recipe(
    buckets=(Bucket(128, Plan(("add_rms_norm", "rope"), {"add_rms_norm": "BLOCK_N=128,ROWS_PER_PROG=1,num_warps=1"})),
             Bucket(2048, ALL_FUSIONS, {"unfused_ms": 2.0, "tuned_ms": 1.5, "max_error": 0.01, "trials": 9,
                                        "failures": {"mismatch": 1}})),
    model={"fingerprint": "abc", "source": "examples/tiny_llama.py", "dtype": "float32", "batch": 1,
           "phase": "prefill"},
    environment={},
)


def test_round_trip(tmp_path):
    path = save_recipe(GOOD, tmp_path / "r.json")
    assert load_recipe(path) == GOOD
    assert "pdl" not in path.read_text()  # written only when on
    pdl = Recipe.from_plan(Plan(("rms_norm",), cuda_graph=True, pdl=True))
    assert load_recipe(save_recipe(pdl, tmp_path / "p.json")).buckets[0].plan.pdl
    assert GOOD.bucket_for(1).max_len == 128 and GOOD.bucket_for(129).max_len == 2048
    assert GOOD.bucket_for(10**6).max_len == 2048  # beyond the largest: largest (documented)


def _corrupt(tmp_path, mutate) -> str:
    obj = GOOD.to_json()
    mutate(obj)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(obj))
    with pytest.raises(RecipeError) as exc:
        load_recipe(p)
    return str(exc.value)


@pytest.mark.parametrize("mutate,where", [
    (lambda o: o.update(schema_version=99), "schema_version"),                                 # 18
    (lambda o: o["buckets"][0]["plan"].update(fusions=["nope"]), "$.buckets[0].plan.fusions[0]"),
    (lambda o: o["buckets"][1]["measured"].update(tuned_ms=float("nan")), "$.buckets[1].measured.tuned_ms"),
    (lambda o: o["buckets"][0]["plan"]["configs"].update(add_rms_norm="BLOCK_N=-4"), "BLOCK_N"),
    (lambda o: o["buckets"][0]["plan"]["configs"].update(add_rms_norm="__import__('os')"), "configs.add_rms_norm"),
    (lambda o: o["buckets"][0].update(extra=1), "unknown field"),
    (lambda o: o["buckets"][0].update(max_len="128"), "$.buckets[0].max_len"),
    (lambda o: o["buckets"].reverse(), "increasing"),
    (lambda o: o.update(kind="pickle"), "$.kind"),
    (lambda o: o["buckets"][0]["plan"].update(cuda_graph="yes"), "cuda_graph"),
    (lambda o: o["buckets"][0]["plan"].update(pdl=1), "$.buckets[0].plan.pdl"),
    # off the kernel's grid: at the first call the site would run unfused with no word
    (lambda o: o["buckets"][0]["plan"]["configs"].update(add_rms_norm="BLOCK_N=3,ROWS_PER_PROG=1,num_warps=1"),
     "$.buckets[0].plan.configs.add_rms_norm: BLOCK_N=3"),
    (lambda o: o["buckets"][0]["plan"]["configs"].update(add_rms_norm="BLOCK_N=128,ROWS_PER_PROG=1,num_warps=1,EVIL=1"),
     "$.buckets[0].plan.configs.add_rms_norm: config keys"),
    # within the parser's depth, past what a copy of the recipe survives
    (lambda o: o["model"].update(x=json.loads("[" * 600 + "]" * 600)), "$.model: nested deeper"),
])
def test_corrupt_recipes_name_the_json_path(tmp_path, mutate, where):  # 21, 22
    msg = _corrupt(tmp_path, mutate)
    assert where in msg and "bad.json" in msg


def test_truncated_and_non_json(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps(GOOD.to_json())[:50])
    with pytest.raises(RecipeError, match="not valid JSON"):
        load_recipe(p)
    p.write_bytes(b"\x80\x04\x95pickle")
    with pytest.raises(RecipeError):
        load_recipe(p)
    texts = ["[" * 100_000 + "]" * 100_000]  # past the parser's depth
    if hasattr(sys, "set_int_max_str_digits"):  # Python's integer digit limit (3.10.7+)
        texts.append('{"schema_version": ' + "9" * 5000 + "}")
    for text in texts:
        p.write_text(text)
        with pytest.raises(RecipeError, match="not a recipe JSON"):
            load_recipe(p)


def test_hand_written_plan_file(tmp_path):
    p = tmp_path / "plan.json"
    p.write_text(json.dumps({"schema_version": SCHEMA_VERSION, "kind": "advisor.plan",
                             "fusions": ["rms_norm"], "cuda_graph": False}))
    r = load_recipe(p)
    assert r.buckets[0].plan.fusions == ("rms_norm",)


def test_other_environment_falls_back_to_unfused_or_errors_when_strict():  # 19
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    foreign = Recipe(buckets=(Bucket(64, ALL_FUSIONS),),
                     environment={"device_name": "Some Other GPU", "torch": "0.0"})
    with pytest.raises(RecipeError, match="another environment"):
        apply(model, foreign, strict=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fast = apply(model, foreign)
    assert any("running unfused" in str(w.message) for w in caught)
    x = inputs_for(mf, 5, 1, torch.device("cpu"))
    assert torch.equal(call(fast, x), call(model, x))
    assert fast.buckets[64].compiles == 0


def test_changed_model_fuses_only_sites_that_still_match():  # 20
    """Patterns are matched on the model as it is now: a site whose norm became a
    LayerNorm is simply not an RMSNorm site any more, and stays unfused."""
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    model.layers[1].ffn_norm = torch.nn.LayerNorm(model.d.dim)
    x = inputs_for(mf, 6, 1, torch.device("cpu"))
    ref = call(model, x)
    fast = apply(model, Plan(("add_rms_norm", "rms_norm")))
    torch.testing.assert_close(call(fast, x), ref, atol=1e-4, rtol=1e-4)
    applied = {r["family"]: r["applied"] for r in fast.summary() if "applied" in r}
    assert applied["add_rms_norm"] == 3  # 4 in the unchanged model


def test_recipe_from_json_rejects_non_objects():
    with pytest.raises(RecipeError):
        recipe_from_json([1, 2])


def test_a_zero_config_value_is_an_off_switch(tmp_path):
    """TMA=0 (pointer loads) is a value tune writes; negative values stay errors."""
    obj = GOOD.to_json()
    obj["buckets"][0]["plan"]["configs"]["linear_residual"] = (
        "BLOCK_K=64,BLOCK_M=128,BLOCK_N=128,GROUP_M=8,SPLIT_K=1,TMA=0,num_stages=3,num_warps=8")
    p = tmp_path / "ok.json"
    p.write_text(json.dumps(obj))
    assert "TMA=0" in load_recipe(p).buckets[0].plan.configs["linear_residual"]


def test_a_recipe_for_another_model_warns():  # 20
    """Its sites are matched anew (correct either way), but configs and timings tuned for
    other widths apply without a word unless the parameter fingerprint is compared. A cast
    after apply (the tuned dtype) is the same model. Strict or not, a warning: names and
    dtypes can differ for the same model (a wrapper module, dtypes kept mixed)."""
    from advisor.runtime.recipe import fingerprint

    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    same = Recipe(buckets=(Bucket(64, Plan(("rms_norm",))),),
                  model={"fingerprint": fingerprint(model, torch.bfloat16), "dtype": "bfloat16"})
    other = Recipe(buckets=same.buckets, model={"fingerprint": "0" * 64, "source": "other.py"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply(model, same)
        fast = apply(model, other)
    said = [str(w.message) for w in caught if "another model" in str(w.message)]
    assert len(said) == 1 and "other.py" in said[0], [str(w.message) for w in caught]
    x = inputs_for(mf, 5, 1, torch.device("cpu"))
    torch.testing.assert_close(call(fast, x), call(model, x), atol=1e-4, rtol=1e-4)
    with pytest.warns(UserWarning, match="another model"):
        apply(model, other, strict=True)


def test_another_advisor_versions_configs_are_not_held_to_our_grids(tmp_path):  # 19
    """Its kernels' grids may differ from ours: it loads, and apply runs it unfused with
    the environment warning (strict: the error)."""
    obj = GOOD.to_json()
    obj["environment"] = {"advisor": "0.0.1"}
    obj["buckets"][0]["plan"]["configs"]["add_rms_norm"] = "BLOCK_N=96,num_warps=1,OLD_AXIS=1"
    p = tmp_path / "old.json"
    p.write_text(json.dumps(obj))
    old = load_recipe(p)
    model = build(load_model_file("examples/tiny_llama.py"), torch.device("cpu"), torch.float32)
    with pytest.warns(UserWarning, match="running unfused"):
        apply(model, old)
    with pytest.raises(RecipeError, match="another environment"):
        apply(model, old, strict=True)
