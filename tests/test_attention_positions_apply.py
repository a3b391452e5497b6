"""A static KV cache's causal mask (key j visible to query i iff j <= position[i]) is read
as the positions it is computed from: the attention kernel takes `q_pos`, the mask's ops
(arange, compare, where, fills) are gone from the graph, and the output is eager's.
Masks that are not exactly that (a padding term, an offset key index) keep the mask."""

import pytest
import torch
import torch.nn.functional as F

from advisor.graph.capture import aten_backend
from advisor.loader import build, call, first_tensor, inputs_for, load_model_file
from advisor.runtime.plan import Plan
from advisor.runtime.rewrite import rewrite
from advisor.state import Snapshot

aten = torch.ops.aten
MASK_OPS = (aten.le.Tensor, aten.ge.Tensor, aten.where.self, aten.scalar_tensor.default)


def _rewritten(model, inputs, fusions=("attention",)):
    """Run `model` through the runtime's rewrite; returns (output, report, node targets,
    the q_pos operand of each fused attention node)."""
    seen = {}

    def fuse(gm, params, example):
        seen["report"] = rewrite(gm, params, Plan(fusions=fusions))
        nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
        seen["targets"] = [n.target for n in nodes]
        seen["q_pos"] = [n.args[9] for n in nodes if "attention" in getattr(n.target, "__name__", "")]
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        out = call(torch.compile(model, backend=aten_backend(model, fuse), dynamic=False), inputs)
    torch._dynamo.reset()
    return first_tensor(out), seen["report"], seen["targets"], seen["q_pos"]


class _CachedAttention(torch.nn.Module):
    """One attention over a static cache of `slots` keys, the mask spelled several ways."""

    def __init__(self, spelling: str):
        super().__init__()
        self.spelling = spelling

    def forward(self, q, k, v, pos):  # q (B, H, Tq, D); k, v (B, H, S, D); pos (Tq,) int64
        keys = torch.arange(k.shape[2], device=q.device)
        if self.spelling == "offset":  # keys counted from 1: not the positions' bound
            keys = keys + 1
        if self.spelling == "ge":
            visible = pos.view(1, 1, -1, 1) >= keys.view(1, 1, 1, -1)
        elif self.spelling == "per_batch":  # pos (B,): one position for all of a row's queries
            visible = keys[None, None, None, :] <= pos[:, None, None, None]
        else:
            visible = keys[None, None, None, :] <= pos[None, None, :, None]
        if self.spelling == "padded":  # and a left-padding term
            visible = visible & (keys >= 2)[None, None, None, :]
        if self.spelling in ("le", "offset", "padded", "per_batch"):
            mask = torch.where(visible, 0.0, torch.finfo(q.dtype).min)
        elif self.spelling == "fp16_min":  # what transformers 5.17 writes on CUDA, any dtype
            mask = torch.where(visible, 0.0, -65504.0)
        elif self.spelling == "small_bias":  # a real bias: not a hidden key
            mask = torch.where(visible, 0.0, -30.0)
        else:
            mask = visible  # bool: True = attend
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("spelling, positional", [
    ("le", True), ("ge", True), ("fp16_min", True), ("offset", False), ("padded", False),
    ("small_bias", False), ("per_batch", False)])
def test_hand_written_cache_masks(spelling, positional):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 16, generator=g)
    k, v = torch.randn(2, 4, 24, 16, generator=g), torch.randn(2, 4, 24, 16, generator=g)
    pos = torch.tensor([9, 10, 11])  # slots 12.. are dead
    if spelling == "per_batch":  # as many positions as queries: must not be read as per query
        q, pos = q[:, :, :2], torch.tensor([3, 20])
    model = _CachedAttention(spelling)
    want = model(q, k, v, pos)
    got, report, targets, q_pos = _rewritten(model, (q, k, v, pos))
    assert [s.family for s in report.sites if s.applied] == ["attention"], report.sites
    assert (q_pos[0] is not None) == positional
    if positional:
        assert not any(t in MASK_OPS for t in targets), targets
    torch.testing.assert_close(got, want)


def test_runtime_trace_with_a_symbolic_cache_length(monkeypatch):
    """Through `apply` the cache length is traced symbolically and the mask's key index
    carries a no-op slice: the positions are still read, the mask still dropped."""
    import advisor.runtime.apply as runtime

    seen, real = [], runtime.rewrite

    def spy(gm, params, plan, cache=None):
        report = real(gm, params, plan, cache)
        seen.extend(n for n in gm.graph.nodes if n.op == "call_function")
        return report

    monkeypatch.setattr(runtime, "rewrite", spy)
    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    x = inputs_for(mf, 20, 1, torch.device("cpu"), phase="decode", dtype=torch.float32)
    snap = Snapshot(x)
    with torch.no_grad():
        want = first_tensor(call(model, x))
    snap.restore()
    fast = runtime.apply(model, Plan(fusions=("attention",)))
    with torch.no_grad():
        got = first_tensor(call(fast, x))
    attention = [n for n in seen if getattr(n.target, "__name__", "") == "advisor_attention"]
    assert len(attention) == 2 and all(n.args[9] is not None for n in attention)
    assert not any(n.target in MASK_OPS for n in seen)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("batch", [1, 2])
def test_transformers_static_cache_decode(batch):
    """The example `transformers` Llama at decode: every layer's attention reads the cache
    position instead of the one shared mask, which then disappears from the graph."""
    mf = load_model_file("examples/llama_hf.py")
    model = build(mf, torch.device("cpu"), torch.float32)
    x = inputs_for(mf, 12, batch, torch.device("cpu"), phase="decode", dtype=torch.float32)
    snap = Snapshot(x)
    with torch.no_grad():
        want = first_tensor(call(model, x))
    snap.restore()
    got, report, targets, q_pos = _rewritten(model, x)
    applied = [s for s in report.sites if s.applied]
    assert len(applied) == 2 and all(s.family == "attention" for s in applied), report.sites
    assert len(q_pos) == 2 and all(p is not None for p in q_pos)
    assert not any(t in MASK_OPS for t in targets), targets
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
