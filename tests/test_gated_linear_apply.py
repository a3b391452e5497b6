"""gated_act_linear at decode: SwiGLU's act(g)·u computed in the down projection's GEMV
prologue (with the residual add in its epilogue), on a `transformers` Llama step with a
static cache — equal to eager, the MLP's gated_act and down_proj one op per layer."""

import torch

from advisor.loader import build, call, first_tensor, inputs_for, load_model_file
from advisor.runtime.apply import apply
from advisor.runtime.recipe import load_recipe
from advisor.state import Snapshot

CPU = torch.device("cpu")


def test_decode_plan_with_the_product_in_down_proj_matches_eager():
    plan = load_recipe("recipes/decode-gated-down-pdl-cudagraph.plan.json").buckets[0].plan
    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, CPU, torch.float32)
    x = inputs_for(mf, 12, 1, CPU, phase="decode", dtype=torch.float32)
    snap = Snapshot(x)
    with torch.no_grad():
        want = first_tensor(call(model, x))
    after = Snapshot(x)
    snap.restore()
    fast = apply(model, plan, length_of=lambda a, k: 12)
    with torch.no_grad():
        got = first_tensor(call(fast, x))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for live, eager in after.pairs:
        torch.testing.assert_close(live, eager, atol=1e-5, rtol=1e-5)
    rows = {r["family"]: r.get("applied") for r in fast.summary()}
    assert rows["gated_act_linear"] == 2 and rows["gated_act"] == 0, rows  # 2 layers
    assert rows["linear_residual"] == 2, rows  # o_proj only: down_proj's add is the new op's
