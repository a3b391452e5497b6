"""SDPA calls that read a memoised causal mask run as `is_causal=True` instead.

Traced, a decoder's SDPA reads its causal mask as a tensor (kernels/masks.py says why), so
torch picks a masked backend (the efficient kernel on CUDA) where eager would run flash.
graph/shape_only.py keeps that mask once per length and marks it when its values are
causal. Every aten SDPA node whose mask comes straight from a memo is pointed at a
`CausalWhenMarked` call: with a marked mask over Tq == Tk it runs
`scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=...)` (the mask is never
read; GQA's k, v are taken before repeat_kv, whose copies drop out); with any other mask it
runs the original op on the same values. Sites our attention kernel took read the
mark themselves (kernels/attention.py); this is for the ones it did not.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from advisor.graph.capture import fake, hint
from advisor.graph.dce import eliminate_dead
from advisor.graph.match import is_getitem
from advisor.graph.patterns.attention import SDPA_OPS, bind_args, positional_names, sdpa_args, unrepeat_kv
from advisor.graph.shape_only import ShapeMemo
from advisor.kernels.masks import reads_as_causal


class CausalWhenMarked:
    """Stands in for one aten SDPA form: `op`'s arguments, `op`'s results (only the output,
    the first result, is produced on the causal path; the graph reads no other)."""

    def __init__(self, op: Any, order: list[int], group: int = 1):
        self.op, self.group = op, group
        schema = op._schema
        self.n_results = len(schema.returns)
        self.order = order  # the output's dims from largest stride to smallest, as traced
        # > 1: the node is given GQA's k, v before repeat_kv (Hq / Hkv = group); the causal
        # path reads them as they are, the fallback repeats them as the graph did
        self.causal_calls = 0  # how many calls took the causal path (tests, summaries)
        self.__name__ = f"advisor_causal_when_marked_{schema.name.split('::')[-1]}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        a = bind_args(self.op, args, kwargs)
        q, k, v = a["query"], a["key"], a["value"]
        mask = a.get("attn_mask", a.get("attn_bias"))
        if not reads_as_causal(mask, q.shape[-2], k.shape[-2]) or a.get("dropout_p"):
            if self.group == 1:
                return self.op(*args, **kwargs)
            a["key"], a["value"] = (x.repeat_interleave(self.group, dim=1) for x in (k, v))
            return self.op(**a)
        self.causal_calls += 1
        if q.shape[1] != k.shape[1] and not _gqa_native(q):
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.get("scale"),
                                           enable_gqa=q.shape[1] != k.shape[1])
        y = _in_order(y, self.order)
        return y if self.n_results == 1 else (y, *([None] * (self.n_results - 1)))

    def __repr__(self) -> str:
        return f"CausalWhenMarked({self.op}, causal_calls={self.causal_calls})"


def _gqa_native(q: torch.Tensor) -> bool:
    """Whether SDPA's flash kernel takes GQA's k, v as they are (CUDA, fp16/bf16, head dim a
    multiple of 8 up to 256). Elsewhere `enable_gqa` can send SDPA to its math backend (T x T
    weights per head), where repeated k, v keep the efficient kernel."""
    d = q.shape[-1]
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256


def _in_order(y: torch.Tensor, order: list[int]) -> torch.Tensor:
    """y, or a copy of it laid out densely with dims in `order` (largest stride first): the
    graph's later views were traced against the original op's layout."""
    expect, dense = {}, 1
    for d in reversed(order):  # the dense strides of that dim order
        expect[d], dense = dense, dense * y.shape[d]
    if all(y.stride(d) == expect[d] for d in order if y.shape[d] != 1):
        return y
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return y.permute(order).contiguous().permute(inverse)


def _memo_output(node: Any) -> bool:
    return (isinstance(node, fx.Node) and is_getitem(node) and isinstance(node.args[0], fx.Node)
            and isinstance(node.args[0].target, ShapeMemo))


def read_marked_masks(gm: fx.GraphModule, kept: Callable[[Any], bool] = _memo_output) -> int:
    """Point SDPA nodes whose mask is a kept value (default: a memo's output) at
    `CausalWhenMarked` (in place); returns how many. Nodes whose other results are read
    are left alone."""
    count = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or not any(node.target is op for op in SDPA_OPS):
            continue
        a = sdpa_args(node)
        mask = a.get("attn_mask", a.get("attn_bias"))
        results = [u for u in node.users if is_getitem(u)]
        if not kept(mask) or any(u.users for u in results if u.args[1] != 0):
            continue
        val = node.meta.get("val")
        out = fake(node) if isinstance(val, torch.Tensor) else (val[0] if val else None)
        if out is None:
            continue
        order = sorted(range(out.dim()), key=lambda i: -hint(out.stride()[i]))
        node.target = CausalWhenMarked(node.target, order, _kv_before_repeat(node))
        count += 1
    if count:
        eliminate_dead(gm.graph)  # repeat_kv's copies, where nothing else reads them
        gm.recompile()
    return count


def _kv_before_repeat(node: fx.Node) -> int:
    """Give `node` GQA's k and v before repeat_kv (graph/patterns/attention.py `unrepeat_kv`:
    expand (+ clone) + view, a copy of each to every q head); returns the group (1: as is)."""
    a = sdpa_args(node)
    (k, k_chain), (v, v_chain) = unrepeat_kv(a["key"]), unrepeat_kv(a["value"])
    tq, tk, tv = fake(a["query"]), fake(k), fake(v)
    if not k_chain or not v_chain or tq is None or tk is None or tv is None or tk.shape != tv.shape:
        return 1
    hq, hkv = hint(tq.shape[1]), hint(tk.shape[1])
    if hkv < 1 or hq % hkv or hq == hkv:
        return 1
    args, kwargs = list(node.args), dict(node.kwargs)
    for name, new in (("key", k), ("value", v)):
        if name in kwargs:
            kwargs[name] = new
        else:
            args[positional_names(node.target).index(name)] = new
    node.args, node.kwargs = tuple(args), kwargs
    return hq // hkv

