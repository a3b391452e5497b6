"""A kept mask whose values are causal is read as `causal=True` (kernels/masks.py): by our
attention kernel and by the SDPA calls left to torch (runtime/causal_sdpa.py). Any other
mask — padding, a sliding window, a real bias — stays a mask."""

from __future__ import annotations

import pytest
import torch

from advisor.graph.shape_only import ShapeMemo
from advisor.kernels import attention as attn
from advisor.kernels.masks import MASKED_BIAS, is_causal_mask, mark_if_causal, marked_causal
from advisor.kernels.testing import assert_close, randn_nonzero
from advisor.runtime import apply as apply_mod
from advisor.runtime.causal_sdpa import CausalWhenMarked
from advisor.runtime.plan import Plan
from tests.hf_models import ids, tiny_hf


def _additive(keep: torch.Tensor, hidden: float, dtype=torch.float32) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, hidden)


TRIL = torch.ones(6, 6, dtype=torch.bool).tril()


@pytest.mark.parametrize("hidden", [float("-inf"), torch.finfo(torch.float32).min, MASKED_BIAS])
def test_causal_values_in_every_spelling(hidden):
    assert is_causal_mask(TRIL) and is_causal_mask(TRIL.expand(2, 1, 6, 6))
    assert is_causal_mask(_additive(TRIL, hidden)[None, None])
    assert is_causal_mask(_additive(TRIL, max(hidden, torch.finfo(torch.bfloat16).min), torch.bfloat16))
    assert is_causal_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool))  # one token


def test_other_masks_are_not_causal():
    padded = TRIL.clone().expand(2, 6, 6).clone()
    padded[1, :, :2] = False  # left padding in the second row
    window = TRIL & ~torch.ones(6, 6, dtype=torch.bool).tril(-3)  # sliding window of 3
    biased = _additive(TRIL, float("-inf"))
    biased[3, 1] = -2.0  # a real bias (ALiBi-like) where a key is visible
    soft = _additive(TRIL, -100.0)  # "hidden" by a bias that does not hide
    nan = _additive(TRIL, float("-inf"))
    nan[0, 0] = float("nan")
    for m in (padded, window, biased, soft, nan, TRIL.T, torch.ones(6, 6, dtype=torch.bool),
              TRIL[:5], TRIL.long(), torch.zeros(0, 0)):
        assert not is_causal_mask(m), m


def test_the_memo_marks_what_it_keeps_only(monkeypatch):
    def build(t):
        keep = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
        return keep, keep.T  # causal, anti-causal
    memo = ShapeMemo(build, 2, 2)
    causal, anti = memo(5)
    assert marked_causal(causal) and not marked_causal(anti)
    assert not marked_causal(causal[:, :4]) and not marked_causal(None)  # views are not marked
    import advisor.graph.shape_only as so
    monkeypatch.setattr(so, "_capturing", lambda out: True)
    assert not marked_causal(memo(7)[0])  # computed, not kept: not marked


def test_attention_kernel_reads_a_marked_mask_as_causal(monkeypatch):
    """Interpreter: the marked mask's launch runs the causal path (no mask operand) and
    matches the reference with the mask."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    g = torch.Generator().manual_seed(0)
    q, k, v = (randn_nonzero((1, h, 7, 16), torch.float32, torch.device("cpu"), g) for h in (4, 2, 2))
    mask = _additive(torch.ones(7, 7, dtype=torch.bool).tril(), float("-inf"))[None, None]
    assert attn._causal_for_mask(q, k, mask, False) == (mask, False)  # unmarked: a mask
    assert mark_if_causal(mask)
    assert attn._causal_for_mask(q, k, mask, False) == (None, True)
    assert attn._causal_for_mask(q, k[:, :, :5], mask, False)[0] is mask  # Tq != Tk: as given
    seen = []
    run = attn._run
    monkeypatch.setattr(attn, "_run", lambda q, k, v, tables, m4, causal, *a, **kw:
                        seen.append((m4, causal)) or run(q, k, v, tables, m4, causal, *a, **kw))
    out = attn.launch_attention(q, k, v, mask=mask, config={"BLOCK_M": 16, "BLOCK_N": 16,
                                "num_warps": 4, "num_stages": 1, "SPLITS": 1})
    assert seen == [(None, True)]
    assert_close(out, attn.reference(q, k, v, mask=mask))


def _graphs(monkeypatch) -> list:
    grabbed = []
    rewrite = apply_mod.rewrite
    monkeypatch.setattr(apply_mod, "rewrite", lambda gm, *a, **k: grabbed.append(gm) or rewrite(gm, *a, **k))
    return grabbed


def _wrapped(graphs) -> list[CausalWhenMarked]:
    return [n.target for gm in graphs for n in gm.graph.nodes if isinstance(n.target, CausalWhenMarked)]


def test_sdpa_left_to_torch_reads_the_kept_causal_mask(monkeypatch):
    model = tiny_hf("Llama")
    graphs = _graphs(monkeypatch)
    fast = apply_mod.apply(model, Plan(fusions=("rms_norm",)))
    for t in (8, 5):
        x = ids(t)
        torch.testing.assert_close(fast(**x).logits, model(**x).logits, rtol=1e-4, atol=1e-4)
    wrapped = _wrapped(graphs)
    assert len(wrapped) == 2 and all(w.causal_calls == 2 for w in wrapped)  # 2 layers, 2 calls
    assert all(w.group == 2 for w in wrapped)  # 4 q / 2 kv heads: k, v read before repeat_kv
    assert not any(n.target is torch.ops.aten.clone.default for gm in graphs for n in gm.graph.nodes)
    x, pad = ids(8), torch.ones(2, 8, dtype=torch.long)
    pad[1, :3] = 0  # left padding: the mask reads attention_mask, not a kept causal one
    torch.testing.assert_close(fast(**x, attention_mask=pad).logits,
                               model(**x, attention_mask=pad).logits, rtol=1e-4, atol=1e-4)
    assert sum(w.causal_calls for w in _wrapped(graphs)) == 4


def test_a_sliding_window_shorter_than_the_input_stays_a_mask(monkeypatch):
    model = tiny_hf("Mistral")
    model.config.sliding_window = 4
    graphs = _graphs(monkeypatch)
    fast = apply_mod.apply(model, Plan(fusions=("rms_norm",)))
    for t in (3, 9):  # 3 tokens: inside the window, causal; 9: the window hides keys
        x = ids(t)
        torch.testing.assert_close(fast(**x).logits, model(**x).logits, rtol=1e-4, atol=1e-4)
    # 3 tokens only; at 9 the original op ran on k, v repeated as the graph did
    assert [(w.causal_calls, w.group) for w in _wrapped(graphs)] == [(1, 2), (1, 2)]


def test_a_marked_one_by_one_mask_broadcast_over_more_tokens_is_not_causal():
    """A (1, 1, 1, 1) zero bias is the causal mask of one token, and marked; broadcast over
    T x T it hides nothing, and neither reader may take it as causal."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (randn_nonzero((1, 2, 4, 8), torch.float32, torch.device("cpu"), g) for _ in range(3))
    one = torch.zeros(1, 1, 1, 1)
    assert mark_if_causal(one)
    assert attn._causal_for_mask(q, k, one, False) == (one, False)
    wrapper = CausalWhenMarked(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, [0, 2, 1, 3])
    got = wrapper(q, k, v, attn_mask=one)[0]
    torch.testing.assert_close(got, torch.nn.functional.scaled_dot_product_attention(q, k, v))
    assert wrapper.causal_calls == 0


@pytest.mark.parametrize("op", ["_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"])
def test_the_causal_path_answers_in_each_cuda_forms_results(op):
    """The CUDA SDPA forms' schemas (4 and 9 results, the mask as attn_bias): on a marked
    mask the wrapper never calls the op, so this runs on the CPU; GQA k, v (group 2) and an
    output laid out as the traced (B, T, H, D) buffer."""
    aten_op = getattr(torch.ops.aten, op).default
    g = torch.Generator().manual_seed(2)
    q = randn_nonzero((1, 5, 4, 8), torch.float32, torch.device("cpu"), g).transpose(1, 2)  # (1, 4, 5, 8)
    k, v = (randn_nonzero((1, 2, 5, 8), torch.float32, torch.device("cpu"), g) for _ in range(2))
    mask = _additive(torch.ones(5, 5, dtype=torch.bool).tril(), float("-inf"))[None, None]
    mark_if_causal(mask)
    wrapper = CausalWhenMarked(aten_op, [0, 2, 1, 3], group=2)
    extra = (True, 0.0, False) if "efficient" in op else (True, 0.0, False, False)
    out = wrapper(q, k, v, mask, *extra)
    assert len(out) == len(aten_op._schema.returns) and all(o is None for o in out[1:])
    y = out[0]
    assert y.transpose(1, 2).is_contiguous()  # dims in the traced order, densely
    want = attn.reference(q, k, v, causal=True)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert wrapper.causal_calls == 1


def test_in_order_copies_only_a_layout_the_graph_did_not_trace():
    from advisor.runtime.causal_sdpa import _in_order

    y = torch.randn(2, 3, 4, 5)  # contiguous (B, H, T, D)
    assert _in_order(y, [0, 1, 2, 3]) is y
    bthd = _in_order(y, [0, 2, 1, 3])  # traced as a (B, T, H, D) buffer viewed (B, H, T, D)
    assert torch.equal(bthd, y) and bthd.transpose(1, 2).is_contiguous()
    assert _in_order(bthd, [0, 2, 1, 3]) is bthd
