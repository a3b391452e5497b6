"""The cache write's positions `p + arange(T)` (transformers' StaticCache computes them per
layer from each layer's counter) reach the fused rope_kv_cache op as the counter p itself:
the add leaves the graph, and the cache is written where eager writes it."""

import pytest
import torch

from advisor.graph.capture import aten_backend
from advisor.runtime.plan import Plan
from advisor.runtime.rewrite import rewrite

aten = torch.ops.aten


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layers(torch.nn.Module):
    """Two layers' RoPE + static-cache writes, each at its own counter's positions."""

    def forward(self, q, k, v, cos, sin, kc0, vc0, kc1, vc1, p0, p1):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # (1, 1, T, D)
        outs = []
        for i, (kc, vc, p) in enumerate(((kc0, vc0, p0), (kc1, vc1, p1))):
            pos = torch.arange(q.shape[2]) + p  # (T,)
            ql, kl = q * (i + 2.0), k * (i + 2.0)  # each layer's own q and k
            qr, kr = ql * c + _rotate_half(ql) * s, kl * c + _rotate_half(kl) * s
            kc.index_copy_(2, pos, kr)
            vc.index_copy_(2, pos, v)
            outs.append(qr * 2 + kc.sum(dim=2, keepdim=True).mean())
        return tuple(outs)


def _inputs(t: int):
    g = torch.Generator().manual_seed(t)
    b, h, d, slots = 1, 2, 8, 12
    q, k, v = (torch.randn(b, h, t, d, generator=g) for _ in range(3))
    cos, sin = torch.randn(1, t, d, generator=g), torch.randn(1, t, d, generator=g)
    caches = [torch.zeros(b, h, slots, d) for _ in range(4)]  # k, v of layer 0, then of layer 1
    return q, k, v, cos, sin, *caches, torch.tensor([3]), torch.tensor([3])


def _position_adds(gm):
    return [n for n in gm.graph.nodes if n.target is aten.add.Tensor
            and any(getattr(a, "target", None) is aten.arange.default for a in n.args)]


def _clone(args):
    return [a.clone() for a in args]


@pytest.mark.parametrize("t", [1, 3])  # one decode token; a chunk of T consecutive slots
def test_position_add_leaves_the_graph_and_the_cache_is_written_as_eager(t):
    seen = []

    def fuse(gm, params, example):  # what apply's backend does, recording the graph
        seen.append(len(_position_adds(gm)))  # before: one p + arange(T) per layer
        seen.append(rewrite(gm, params, Plan(fusions=("rope", "rope_kv_cache"))))
        seen.append(len(_position_adds(gm)))
        return gm.forward

    args = _inputs(t)
    want_args, got_args = _clone(args), _clone(args)
    want = _Layers()(*want_args)
    torch._dynamo.reset()
    model = _Layers()
    with torch.no_grad():
        got = torch.compile(model, backend=aten_backend(model, fuse), dynamic=False)(*got_args)
    torch._dynamo.reset()
    before, report, after = seen
    assert [s.family for s in report.sites if s.applied] == ["rope_kv_cache"] * 2, report.sites
    assert (before, after) == (2, 0)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w)
    for wc, gc in zip(want_args[5:9], got_args[5:9]):  # the caches, written where eager wrote
        assert torch.equal(gc, wc)
        assert (gc[:, :, 3:3 + t] != 0).all() and (gc[:, :, 3 + t:] == 0).all()
