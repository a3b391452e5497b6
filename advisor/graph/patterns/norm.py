"""Norm patterns: RMSNorm / LayerNorm, with the residual add that feeds them.

RMSNorm is matched by what it computes, through casts and these spellings:
  x·rsqrt(mean(x², -1) + eps)         (x² as pow(x, 2) or x·x)
  x / sqrt(mean(x², -1) + eps)
then an optional weight: w·n (Llama) or (1 + w)·n (Gemma). LayerNorm is aten's
`native_layer_norm` (what F.layer_norm lowers to). A residual add `h = a + b` whose
result is normalised (and read again later: the residual stream) makes it add+norm —
also across layer boundaries, since the graph is the whole model.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from advisor.graph.capture import fake, module_path
from advisor.graph.match import (
    CAST_OPS,
    Match,
    aten,
    is_getitem,
    is_last_dim,
    is_op,
    other_arg,
    scalar,
    strip_casts,
)


def _square_of(node: Any) -> Any:
    """x for pow(x, 2) or mul(x, x), else None."""
    if is_op(node, aten.pow.Tensor_Scalar) and scalar(node.args[1]) == 2.0:
        return node.args[0]
    if is_op(node, aten.mul.Tensor) and node.args[0] is node.args[1]:
        return node.args[0]
    return None


def _mean_plus_eps(node: Any) -> tuple[Any, float, list[fx.Node]] | None:
    """For add(mean(x², -1, keepdim), eps): (x, eps, nodes)."""
    if not is_op(node, aten.add.Tensor):
        return None
    mean = next((a for a in node.args[:2] if is_op(a, aten.mean.dim)), None)
    eps = scalar(other_arg(node, mean)) if mean is not None else None
    if mean is None or eps is None or not is_last_dim(mean.args[1], mean.args[0]):
        return None
    x = _square_of(mean.args[0])
    return (x, eps, [node, mean, mean.args[0]]) if x is not None else None


def _normalised(inv: fx.Node, xf: Any) -> fx.Node | None:
    """The user of `inv` that multiplies (or divides, for sqrt) the same x."""
    for user in inv.users:
        if is_op(user, aten.mul.Tensor) and strip_casts(other_arg(user, inv)) is strip_casts(xf):
            return user
        same_x = strip_casts(user.args[0]) is strip_casts(xf)
        if is_op(user, aten.div.Tensor) and user.args[1] is inv and same_x:
            return user
    return None


def _weight(normed: fx.Node, n_cols: int,
            params: dict[str, str]) -> tuple[fx.Node, Any, float, list[fx.Node]]:
    """Follow an optional cast then `w·n` or `(1+w)·n`: (y, weight, offset, extra nodes)."""
    out, extra = normed, []
    only = list(out.users)
    if len(only) == 1 and is_op(only[0], *CAST_OPS):
        out = only[0]
        extra.append(out)
    users = list(out.users)
    if len(users) == 1 and is_op(users[0], aten.mul.Tensor):
        mul = users[0]
        w = other_arg(mul, out)
        if isinstance(w, fx.Node) and w.name in params and _is_vector(w, n_cols):
            return mul, w, 0.0, [*extra, mul]
        if is_op(w, aten.add.Tensor) and len(w.users) == 1:
            base = next((a for a in w.args[:2] if isinstance(a, fx.Node) and a.name in params), None)
            if base is not None and scalar(other_arg(w, base)) == 1.0 and _is_vector(base, n_cols):
                return mul, base, 1.0, [*extra, w, mul]
    return out, None, 0.0, extra


def _is_vector(node: fx.Node, n: int) -> bool:
    t = fake(node)
    return t is not None and t.dim() == 1 and int(t.shape[0]) == n


def _rms_at(inv: fx.Node, params: dict[str, str]) -> Match | None:
    """Match an RMSNorm whose reciprocal-root node is `inv` (rsqrt or sqrt)."""
    found = _mean_plus_eps(inv.args[0])
    if found is None:
        return None
    xf, eps, core = found
    normed = _normalised(inv, xf)
    t = fake(xf)
    if normed is None or t is None or t.dim() == 0:
        return None
    x = strip_casts(xf)
    casts = [n for n in (xf, normed.args[0]) if is_op(n, *CAST_OPS)]
    y, weight, offset, tail = _weight(normed, int(t.shape[-1]), params)
    nodes = tuple(dict.fromkeys([*casts, *core, inv, normed, *tail]))
    operands = {"x": x, "weight": weight, "eps": eps, "weight_offset": offset}
    return Match("rms_norm", "rms_norm", module_path(inv), nodes, operands, {"y": y})


def _layer_norm_at(node: fx.Node) -> Match | None:
    """aten.native_layer_norm over the last dim, reading only item 0 of its result."""
    x, shape, w, b, eps = node.args[:5]
    t = fake(x)
    if t is None or list(shape) != [int(t.shape[-1])]:
        return None
    users = list(node.users)
    if len(users) != 1 or not is_getitem(users[0]) or users[0].args[1] != 0:
        return None
    operands = {"x": x, "weight": w, "bias": b, "eps": float(eps)}
    return Match("layer_norm", "layer_norm", module_path(node), (node, users[0]), operands,
                 {"y": users[0]})


def _with_residual(m: Match, claimed: set[fx.Node]) -> Match:
    """Fold `x = a + b` into the norm when x is a plain same-shape add of two tensors."""
    x = m.operands["x"]
    if not is_op(x, aten.add.Tensor) or x in claimed or "alpha" in x.kwargs:
        return m
    a, b = x.args[0], x.args[1]
    ta, tb, tx = fake(a), fake(b), fake(x)
    if ta is None or tb is None or tx is None or not (ta.shape == tb.shape == tx.shape):
        return m
    if not (ta.dtype == tb.dtype == tx.dtype):
        return m
    claimed.add(x)
    fam = "add_" + m.family
    operands = {**m.operands, "x": a, "residual": b}
    return Match(fam, fam, m.module, (x, *m.nodes), operands, {**m.outputs, "residual": x})


def find(gm: fx.GraphModule, params: dict[str, str]) -> list[Match]:
    """Every RMSNorm/LayerNorm site, folded with its residual add where there is one."""
    found: list[Match] = []
    for node in gm.graph.nodes:
        if is_op(node, aten.rsqrt.default, aten.sqrt.default):
            m = _rms_at(node, params)
        elif is_op(node, aten.native_layer_norm.default):
            m = _layer_norm_at(node)
        else:
            continue
        if m is not None:
            found.append(m)
    claimed: set[fx.Node] = set()
    return [_with_residual(m, claimed) for m in found]
