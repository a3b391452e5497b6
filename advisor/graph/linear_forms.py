"""Products with a weight spelled otherwise than `nn.Linear`, rewritten into its aten form
`mm(view(x, [-1, K]), t(W))` (W: an (N, K) parameter), the form the linear patterns match
(graph/patterns/linear.py): projections, merges, norm prologues and epilogues.

`torch.einsum("btk,nk->btn", x, W)` traces to a `bmm` of one batch: a (1, B·T, K) view of x
and a (1, K, N) view of W built by unsqueeze/permute/view, then a view/permute/view back to
(B, T, N). A hand-written decoder that spells its projections so kept every GEMM fusion
away (28 launches per forward of a tiny 2-layer model where `x @ W.T` gives 15).

What is rewritten is decided by what the operands hold, read off their fake tensors' sizes,
strides and offsets, never by the op that made them: the weight operand must hold Wᵀ (each
(k, n) at W's (n, k)), the activation operand x's rows flattened to (M, K).

A product whose weight operand holds a parameter W stored (K, N) as it is (`x @ W`;
GPT-2's `Conv1D`, `addmm(b, x, W)`) becomes `mm(view(x, [-1, K]), t(t(W)))`: the inner
`t(W)` is the (N, K) weight our GEMMs read, a view with strides (1, N) (they take any
strides). The parameter itself is not laid out anew: that would change its strides,
which dynamo guards (a recompile). `patterns/linear.py` reads such a weight as
`Linear.transposed_view` and keeps it out of the kernels that read several weights as one
buffer (merges, norm prologues, SwiGLU GEMMs: they need adjacent (N, K) rows).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import fx

from advisor.graph.capture import fake, infer_meta
from advisor.graph.dce import settle
from advisor.graph.match import RESHAPE_OPS, VIEW_OPS, aten, is_op, known, strip_views
from advisor.graph.patterns.linear import bias_ok, linear_at


def _holds(view: torch.Tensor, sizes: tuple, strides: tuple, offset: Any) -> bool:
    """`view` addresses its elements as (sizes, strides, offset) do: a stride counts only
    where its dim holds more than one element."""
    return (view.dim() == len(sizes) and known(view.storage_offset() == offset)
            and all(known(a == b) for a, b in zip(view.shape, sizes))
            and all(known(n == 1) or known(a == b) for n, a, b in zip(sizes, view.stride(), strides)))


def _weight_transposed(b: Any, params: dict[str, str]) -> fx.Node | None:
    """The (N, K) weight W whose transpose `b` ((K, N), or (1, K, N)) is, through views."""
    w = strip_views(b)
    tb, tw = fake(b), fake(w)
    if not isinstance(w, fx.Node) or w.name not in params or tb is None or tw is None or tw.dim() != 2:
        return None
    if tb.dim() == 3:
        if not known(tb.shape[0] == 1):
            return None
        sizes, strides = (1, tw.shape[1], tw.shape[0]), (0, tw.stride(1), tw.stride(0))
    else:
        sizes, strides = (tw.shape[1], tw.shape[0]), (tw.stride(1), tw.stride(0))
    return w if _holds(tb, sizes, strides, tw.storage_offset()) else None


def _weight_as_stored(b: Any, params: dict[str, str]) -> fx.Node | None:
    """The 2-D parameter W that `b` ((K, N), or (1, K, N)) is, as stored, through views."""
    w = strip_views(b)
    tb, tw = fake(b), fake(w)
    if not isinstance(w, fx.Node) or w.name not in params or tb is None or tw is None or tw.dim() != 2:
        return None
    lead = () if tb.dim() == 2 else (1,)
    if tb.dim() == 3 and not known(tb.shape[0] == 1):
        return None
    as_stored = _holds(tb, (*lead, *tw.shape), (*(0,) * len(lead), *tw.stride()), tw.storage_offset())
    return w if as_stored else None


def _flattens(ta: torch.Tensor, x: Any) -> bool:
    """`ta` ((M, K) or (1, M, K)) addresses the elements x.view(-1, K) would. Worked out
    from sizes and strides (a fake view could add guards on symbolic sizes)."""
    tx = fake(x)
    if tx is None or tx.dim() < 2 or not (ta.dim() == 2 or (ta.dim() == 3 and known(ta.shape[0] == 1))):
        return False
    sizes, strides = tx.shape, tx.stride()
    for i in range(tx.dim() - 2):  # x's leading dims must be one stride apart, as rows
        if not (known(sizes[i] == 1) or known(strides[i] == strides[i + 1] * sizes[i + 1])):
            return False
    rows = math.prod(sizes[:-1])
    lead = () if ta.dim() == 2 else (1,)
    return _holds(ta, (*lead, rows, sizes[-1]), (*(0,) * len(lead), strides[-2], strides[-1]),
                  tx.storage_offset())


def _rows_of(a: Any) -> fx.Node | None:
    """The earliest value along `a`'s view chain whose rows, flattened to (M, K), `a` is
    (as `strip_views` reads nn.Linear's x back to the norm that made it)."""
    ta, found, node = fake(a), None, a
    while ta is not None and isinstance(node, fx.Node):
        if _flattens(ta, node):
            found = node
        if not is_op(node, *VIEW_OPS):
            break
        node = node.args[0]
    return found


def reshaped_reader(out: fx.Node, dims: int | None = None) -> fx.Node | None:
    """The last of the view chain `out` alone feeds that holds out's elements in row order
    (a reshape of out: einsum's view/permute/view back to (B, T, N)); with `dims`, the
    last with that many dims (a chain may go on past it: (B, H, 1, D) then (B, 1, H·D))."""
    last, node = None, out
    while len(node.users) == 1:
        node = next(iter(node.users))
        t = fake(node)
        if not is_op(node, *VIEW_OPS) or t is None:
            break
        # all of out's elements, in row order: a slice from the start passes the layout
        # test but holds fewer (next-token logits: einsum(...)[:, :-1].reshape(-1, V))
        if (is_op(node, *RESHAPE_OPS) and t.is_contiguous() and known(t.storage_offset() == 0)
                and known(t.numel() == fake(out).numel()) and dims in (None, t.dim())):
            last = node
    return last


def products_as_linears(gm: fx.GraphModule, params: dict[str, str]) -> int:
    """Rewrite each mm/bmm of x's rows by a weight's transpose, spelled otherwise, and each
    mm/bmm/addmm by a weight stored (K, N), as `mm(view(x, [-1, K]), t(W))` (addmm keeps
    its bias; W: the (N, K) weight or a transposed view of the stored one); returns how many."""
    graph, rewritten = gm.graph, 0
    for node in list(graph.nodes):
        if not is_op(node, aten.mm.default, aten.bmm.default, aten.addmm.default) \
                or linear_at(node, params) is not None:
            continue
        bias = node.args[0] if is_op(node, aten.addmm.default) else None
        if bias is not None and node.kwargs:
            continue  # alpha/beta: not a linear
        a, b = node.args[-2:]
        w, stored, x = _weight_transposed(b, params), None, _rows_of(a)
        if w is None:
            stored = w = _weight_as_stored(b, params)  # (K, N): read through t(W)
        out = fake(node)
        if w is None or x is None or out is None or not out.is_contiguous():
            continue
        if not bias_ok(bias, fake(w).shape[1 if stored is not None else 0], params):
            continue  # a bias that is no (N,) parameter: not a linear's
        with graph.inserting_before(node):
            if stored is not None:  # the (N, K) weight: a view, strides (1, N)
                w = infer_meta(graph.call_function(aten.t.default, (stored,)), like=node)
            k = int(fake(w).shape[1])
            x2d = infer_meta(graph.call_function(aten.view.default, (x, [-1, k])), like=node)
            wt = infer_meta(graph.call_function(aten.t.default, (w,)), like=node)
            mm = infer_meta(graph.call_function(aten.mm.default, (x2d, wt)) if bias is None
                            else graph.call_function(aten.addmm.default, (bias, x2d, wt)), like=node)
            new = mm
            if is_op(node, aten.bmm.default):
                new = infer_meta(graph.call_function(aten.unsqueeze.default, (mm, 0)), like=node)
        reader = reshaped_reader(node)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        if reader is not None:  # (B, T, N) straight from the (M, N) product
            reader.args = (mm, *reader.args[1:])
        rewritten += 1
    return settle(gm, rewritten)
