"""rope_table matched and applied in whole graphs: transformers' current rotary spelling
(positions[..., None].float() * inv_freq, bf16 casts) and its older one (inv_freq ⊗ positions
as a bmm with K = 1, then a transpose). The fused op replaces every node from the product
to the casts, and the model's output is eager's."""

import pytest
import torch

from advisor.graph.capture import aten_backend
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


def _run(model, x, pos):
    seen = []

    def fuse(gm, params, example):  # what apply's backend does, recording the result
        seen.append(rewrite(gm, params, Plan(fusions=("rope_table",))))
        seen.append([n.target for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend=aten_backend(model, fuse), dynamic=False)(x, pos)
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
