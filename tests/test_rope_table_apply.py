"""rope_table matched and applied in whole graphs: transformers' current rotary spelling
(positions[..., None].float() * inv_freq, bf16 casts) and its older one (inv_freq ⊗ positions
as a bmm with K = 1, then a transpose). The fused op replaces every node from the product
to the casts, and the model's output is eager's."""

import operator

import pytest
import torch

from advisor.graph.capture import aten_backend
from advisor.graph.shape_only import ShapeMemo
from advisor.runtime.apply import apply
from advisor.runtime.plan import Plan
from advisor.runtime.rewrite import rewrite
from tests.hf_models import FAMILIES, ids, tiny_hf

aten = torch.ops.aten
TABLE_OPS = (aten.cos.default, aten.sin.default, aten.cat.default, aten.bmm.default)


class _Rotary(torch.nn.Module):
    """A rotary embedding feeding a product with x (the table's only readers)."""

    def __init__(self, bmm: bool, scale: float):
        super().__init__()
        self.bmm, self.scale = bmm, scale
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 12, 2).float() / 12),
                             persistent=False)

    def forward(self, x, position_ids):
        if self.bmm:  # transformers <= 5.1x
            inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
            freqs = (inv.float() @ position_ids[:, None, :].float()).transpose(1, 2)
        else:
            freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.scale, emb.sin() * self.scale
        return x * cos.to(x.dtype) + x.flip(-1) * sin.to(x.dtype)


def _run(model, x, pos):  # pos None: the model takes x alone
    seen = []

    def fuse(gm, params, example):  # what apply's backend does, recording the result
        seen.append(rewrite(gm, params, Plan(fusions=("rope_table",))))
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        args = (x,) if pos is None else (x, pos)
        got = torch.compile(model, backend=aten_backend(model, fuse), dynamic=False)(*args)
    torch._dynamo.reset()
    return got, seen[0], seen[1]


@pytest.mark.parametrize("bmm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_tables_fused_and_exact(bmm, dtype):
    model = _Rotary(bmm, scale=0.75)
    pos = torch.tensor([[0, 5, 4095], [7, 8, 9]])  # (B, T): large angles too
    x = torch.randn(2, 3, 12).to(dtype)
    want = model(x, pos)
    got, report, targets = _run(model, x, pos)
    assert [s.family for s in report.sites if s.applied] == ["rope_table"], report.sites
    assert not any(t in TABLE_OPS for t in targets), targets  # product, cat, cos, sin all gone
    torch.testing.assert_close(got, want)


def test_table_read_elsewhere_is_left_alone():
    class Leaky(_Rotary):
        def forward(self, x, position_ids):
            freqs = position_ids[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return x * emb.cos() + x * emb.sin() + emb  # emb itself is an output
    model = Leaky(False, 1.0)
    x, pos = torch.randn(1, 2, 12), torch.tensor([[1, 2]])
    got, report, _ = _run(model, x, pos)
    assert not any(s.applied for s in report.sites if s.family == "rope_table")
    torch.testing.assert_close(got, model(x, pos))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_transformers_family_fuses_its_tables(family):
    model = tiny_hf(family)
    want = model(**ids(5)).logits
    fast = apply(model, Plan(fusions=("rope_table",)))
    got = fast(**ids(5)).logits
    row = {r["family"]: r for r in fast.summary()}["rope_table"]
    assert row["applied"] == 1 and not row["unfused"], row
    torch.testing.assert_close(got, want)


def test_table_from_sizes_alone_is_computed_once_fused_or_not():
    """Positions from `arange` (no caller input): the whole table is derived from sizes, so
    the runtime computes it once per length. Fused (rope_table, a custom op returning a
    (cos, sin) tuple) it must be kept too, or the fusion would add launches the unfused
    graph no longer has."""
    class FromSizes(torch.nn.Module):  # a hand-written spelling: inv_freq built in forward
        def forward(self, x):
            d = x.shape[-1]
            inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)
            freqs = torch.arange(x.shape[1])[None, :, None].float() * inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            return x * emb.cos() + x.flip(-1) * emb.sin()
    model = FromSizes()
    x = torch.randn(2, 3, 12)
    got, report, targets = _run(model, x, None)
    assert [s.family for s in report.sites if s.applied] == ["rope_table"], report.sites
    # left each call: the memo (no launch on a hit), its items, and the four data ops
    data_ops = {aten.mul.Tensor, aten.flip.default, aten.add.Tensor, operator.getitem}
    assert isinstance(targets[0], ShapeMemo) and set(targets[1:]) <= data_ops, targets
    torch.testing.assert_close(got, model(x))
