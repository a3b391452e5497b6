"""state.Snapshot: tensors and the Python scalars beside them come back; a sliding-window
static cache (transformers' StaticSlidingWindowLayer counts its length in a Python int)
decodes the same step twice from one snapshot, eager and fused."""

import torch

from advisor.runtime.apply import apply
from advisor.runtime.plan import ALL_FUSIONS
from advisor.state import Snapshot
from tests.hf_models import tiny_hf


class _Layer:
    def __init__(self):
        self.keys = torch.zeros(4)
        self.length = 0  # counted in Python, as a sliding-window layer does
        self.meta = {"full": False, "steps": [0]}


def test_scalars_beside_tensors_are_restored_and_seen_as_changes():
    layer = _Layer()
    inputs = {"cache": [layer], "use_cache": True}
    snap = Snapshot(inputs)
    assert not snap.changed()
    layer.keys[1] = 3.0
    layer.length += 1
    layer.meta["full"] = True
    layer.meta["steps"][0] = 7
    inputs["use_cache"] = False
    assert snap.changed()
    snap.restore()
    assert not snap.changed()
    assert layer.length == 0 and layer.meta == {"full": False, "steps": [0]} and inputs["use_cache"]
    assert torch.equal(layer.keys, torch.zeros(4))
    layer.length = 5  # a scalar alone is a change
    assert snap.changed()


def _sliding_decode_inputs(model, ctx: int) -> dict:
    from transformers import StaticCache

    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=ctx + 8)
    g = torch.Generator().manual_seed(ctx)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    for layer in range(cfg.num_hidden_layers):
        kv = [torch.randn(1, cfg.num_key_value_heads, ctx, head_dim, generator=g) for _ in range(2)]
        cache.update(*kv, layer, {"cache_position": torch.arange(ctx)})
    return {"input_ids": torch.randint(2, 128, (1, 1), generator=g), "past_key_values": cache,
            "use_cache": True, "cache_position": torch.tensor([ctx])}


def test_sliding_window_cache_step_twice_from_a_snapshot_eager_and_fused():
    model = tiny_hf("Mistral")  # sliding_window set: StaticSlidingWindowLayer per layer
    x = _sliding_decode_inputs(model, 12)
    assert any(type(layer).__name__ == "StaticSlidingWindowLayer" for layer in x["past_key_values"].layers)
    snap = Snapshot(x)
    with torch.no_grad():
        want = model(**x).logits
    after = Snapshot(x)
    snap.restore()
    with torch.no_grad():
        again = model(**x).logits
    assert torch.equal(again, want)  # the int counter came back too: the same update path
    snap.restore()
    fast = apply(model, ALL_FUSIONS, length_of=lambda a, k: 12)
    with torch.no_grad():
        got = fast(**x).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    for live, eager in after.pairs:
        torch.testing.assert_close(live, eager, atol=1e-5, rtol=1e-5)
    assert [value for _, _, value in Snapshot(x).scalars] == [value for _, _, value in after.scalars]
    assert {r["family"]: r.get("applied") for r in fast.summary()}["rope_kv_cache"] == 2
