"""Batched products over heads spelled as einsum, rewritten into the form `q @ kᵀ` and
`p @ v` trace to (expand/clone → view (B·H, M, K) → bmm → view (B, H, M, N)), which the
attention pattern reads (graph/patterns/attention.py `_bmm_source`).

`torch.einsum("bhqd,bhkd->bhqk", q, k)` traces to a bmm of (B·H, Tq, D) and (B·H, D, Tk)
operands built by unsqueeze/permute/clone/_unsafe_view through a 5-D tensor, and a
view/permute/view of its (B·H, Tq, Tk) result back to (B, H, Tq, Tk) (x-transformers and
other hand-written decoders spell attention so). As in graph/linear_forms.py, what is
rewritten is decided by what the tensors hold, read off fake sizes, strides and offsets: an
operand is rewritten when the view it was copied from addresses a 4-D (B, H, M, K) value's
elements as its rows (or its last two dims swapped); the result when a reshape of it
holds its elements in row order as (B, H, M, N).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from advisor.graph.capture import fake, infer_meta
from advisor.graph.dce import settle
from advisor.graph.linear_forms import reshaped_reader
from advisor.graph.match import RESHAPE_OPS, VIEW_OPS, aten, is_op, known

_COPIES = (aten.clone.default, *RESHAPE_OPS)


def _copied_view(x: fx.Node) -> fx.Node | None:
    """The view of more than 4 dims a 3-D bmm operand was made of: through
    _unsafe_view/view/reshape and a clone (einsum's permuted 5-D view, copied where it is
    not contiguous)."""
    node = x
    while is_op(node, *_COPIES):
        node = node.args[0]
        t = fake(node)
        if t is not None and t.dim() > 4:
            return node.args[0] if is_op(node, aten.clone.default) else node  # what it copies
    return None


def _as_heads(view: torch.Tensor, src: torch.Tensor, swapped: bool) -> bool:
    """`view` addresses src's (B, H, M, K) elements (its last two dims swapped if
    `swapped`), dims of size 1 on either side aside."""
    order = (0, 1, 3, 2) if swapped else (0, 1, 2, 3)
    want = [(src.shape[i], src.stride(i)) for i in order if not known(src.shape[i] == 1)]
    have = [(view.shape[i], view.stride(i)) for i in range(view.dim()) if not known(view.shape[i] == 1)]
    return (len(want) == len(have) and known(view.storage_offset() == src.storage_offset())
            and all(known(a == c) and known(b == d) for (a, b), (c, d) in zip(have, want)))


def _head_source(x: Any) -> tuple[fx.Node, bool] | None:
    """(the 4-D value, swapped) whose rows (B·H, M, K) the bmm operand x holds, found along
    the views the copied view was made by; None when x is not so made."""
    tx, pre = fake(x), _copied_view(x) if isinstance(x, fx.Node) else None
    tp = fake(pre)
    if tx is None or tx.dim() != 3 or tp is None:
        return None  # made of a 4-D view: matmul's own form, read as it is
    node = pre
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
        ts = fake(node)
        if ts is not None and ts.dim() == 4 and known(ts.shape[0] * ts.shape[1] == tx.shape[0]):
            for swapped in (False, True):
                if _as_heads(tp, ts, swapped):
                    return node, swapped
    return None


def _rows(graph: fx.Graph, src: fx.Node, swapped: bool, operand: fx.Node) -> fx.Node:
    """src (B, H, M, K) [transposed] as contiguous (B·H, M, K) rows: matmul's own trace, in
    the operand's own sizes (graph values: symbolic sizes stay bound)."""
    def add(target, *args, **kwargs):
        return infer_meta(graph.call_function(target, args, kwargs), like=operand)
    if not swapped and fake(src).is_contiguous():  # no copy where none is needed
        return add(aten.view.default, src, operand.args[1])
    x = add(aten.transpose.int, src, 2, 3) if swapped else src
    x = add(aten.clone.default, x, memory_format=torch.contiguous_format)
    return add(aten._unsafe_view.default, x, operand.args[1])


def head_products_as_matmuls(gm: fx.GraphModule) -> int:
    """Rewrite each bmm of einsum-made (B·H, M, K) operands of 4-D values, whose result is
    reshaped to (B, H, M, N), into matmul's form; returns how many."""
    graph, rewritten, inserted = gm.graph, 0, False
    for node in list(graph.nodes):
        if not is_op(node, aten.bmm.default):
            continue
        sources = [_head_source(a) for a in node.args[:2]]
        reader = reshaped_reader(node, dims=4)
        tr = fake(reader) if reader is not None else None
        if any(s is None for s in sources) or tr is None or not all(
                is_op(n, *RESHAPE_OPS) for n in (reader, *node.args[:2])):
            continue  # (each a reshape with its sizes as graph values)
        with graph.inserting_before(node):
            a, b = (_rows(graph, src, swapped, x) for (src, swapped), x in zip(sources, node.args))
            bmm = infer_meta(graph.call_function(aten.bmm.default, (a, b)), like=node)
        if not all(known(x == y) for x, y in zip(fake(bmm).shape, fake(node).shape)):
            inserted = True  # (never: the operands hold what they held) left as it was; the
            continue  # nodes just made are read by nobody, and erased below
        with graph.inserting_before(reader):  # where its sizes are all computed
            view = infer_meta(graph.call_function(aten.view.default, (bmm, reader.args[1])), like=node)
        reader.replace_all_uses_with(view)
        rewritten += 1
    settle(gm, rewritten + inserted)
    return rewritten
