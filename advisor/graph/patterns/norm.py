"""Norm patterns: RMSNorm / LayerNorm, with the residual add that feeds them.

RMSNorm is matched by what it computes, through casts and these spellings:
  x·rsqrt(mean(x², -1) + eps)         (x² as pow(x, 2) or x·x)
  x / sqrt(mean(x², -1) + eps)
then an optional weight: w·n (Llama) or (1 + w)·n (Gemma), the weight possibly cast
(`w.float()`), and a cast of the result back to x's dtype. Also the L2-normalised form
  F.normalize(x, dim=-1) · √D [· w]   (x / max(‖x‖₂, ε), x-transformers' RMSNorm)
which is x / max(rms(x), ε/√D): RMSNorm with eps = ε²/D (x / √(rms² + ε²/D)); and the older
  x / (‖x‖₂ · D^-½).clamp(min=ε) [· w]   (x / max(rms(x), ε): eps = ε²)
The max and the sum differ by a factor √(1 + ε²/‖x‖²) (up to ε²/2‖x‖², relative): 29% at
‖x‖ = ε, under 5e-5 past 100ε; a zero row is 0 in both. Only floors 0 < ε <= L2_FLOOR_MAX
are read so (F.normalize's is 1e-12): rows of a model's activations are far from them.
LayerNorm is aten's `native_layer_norm` (what F.layer_norm lowers to) or the same spelled
out: the RMSNorm form above of d = x - mean(x, -1) (Cohere, hand-written models; d may be
computed twice, once for the variance and once to normalise), then w·n and an optional + b. A residual
add `h = a + b` whose result is normalised (and read again later: the residual stream)
makes it add+norm — also across layer boundaries, since the graph is the whole model.
"""

from __future__ import annotations

import math
from typing import Any

from torch import fx

from advisor.graph.capture import fake, module_path
from advisor.graph.match import (
    CAST_OPS,
    Match,
    aten,
    cast_back,
    is_getitem,
    is_last_dim,
    is_op,
    keepdim,
    other_arg,
    scalar,
    sole_user,
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
    """For add(mean(x², -1, keepdim), eps): (x, eps, nodes). eps may be an add.Scalar
    operand: `F.rms_norm` and `nn.RMSNorm` decompose to that (torch 2.13). The mean may be
    written sum(x², -1, keepdim) / D or · (1/D), D the last dim's size."""
    if not is_op(node, aten.add.Tensor, aten.add.Scalar) or node.kwargs or len(node.args) != 2:
        return None  # an alpha (a kwarg of add.Tensor, positional in add.Scalar) scales eps
    found = next(((a, m) for a in node.args[:2] if (m := _mean_of_last(a)) is not None), None)
    eps = scalar(other_arg(node, found[0])) if found is not None else None
    if found is None or eps is None:
        return None
    _, (reduced, taken) = found
    x = _square_of(reduced)
    return (x, eps, [node, *taken, reduced]) if x is not None else None


def _mean_of_last(node: Any) -> tuple[Any, list[fx.Node]] | None:
    """(what is averaged, the nodes) for mean(v, -1, keepdim=True) or sum(v, -1, keepdim=True)
    divided by (or times 1/) the last dim's size; else None."""
    if is_op(node, aten.mean.dim):
        return (node.args[0], [node]) if keepdim(node) and is_last_dim(node.args[1], node.args[0]) else None
    if not is_op(node, aten.div.Tensor, aten.div.Scalar, aten.mul.Tensor, aten.mul.Scalar) or node.kwargs:
        return None
    total = node.args[0] if is_op(node.args[0], aten.sum.dim_IntList) else (
        node.args[1] if is_op(node, aten.mul.Tensor, aten.mul.Scalar) else None)
    if not is_op(total, aten.sum.dim_IntList) or not is_last_dim(total.args[1], total.args[0]):
        return None
    t, by = fake(total.args[0]), scalar(other_arg(node, total))
    if not keepdim(total) or set(total.kwargs) - {"keepdim"} or t is None or t.dim() == 0 or by is None:
        return None
    n = t.shape[-1]
    if not isinstance(n, int):
        return None  # a symbolic width: no norm we fuse has one
    per = by if is_op(node, aten.mul.Tensor, aten.mul.Scalar) else 1.0 / by
    return (total.args[0], [node, total]) if math.isclose(per, 1.0 / n, rel_tol=1e-6) else None


def _same_value(a: Any, b: Any) -> bool:
    """a and b are one value through casts, or the same subtraction computed twice
    (LayerNorm spelled out: x - mean for the variance, again to normalise)."""
    a, b = strip_casts(a), strip_casts(b)
    return a is b or (is_op(a, aten.sub.Tensor) and is_op(b, aten.sub.Tensor) and not a.kwargs
                      and not b.kwargs and a.args[:2] == b.args[:2])


def _normalised(inv: fx.Node, xf: Any) -> fx.Node | None:
    """The user of `inv` that multiplies (rsqrt, pow -0.5) or divides (sqrt) the same x."""
    root = is_op(inv, aten.sqrt.default)
    for user in inv.users:
        if not root and is_op(user, aten.mul.Tensor) and _same_value(other_arg(user, inv), xf):
            return user
        if root and is_op(user, aten.div.Tensor) and user.args[1] is inv and _same_value(user.args[0], xf):
            return user
    return None


def _reciprocal_root(node: fx.Node) -> bool:
    """rsqrt(v), pow(v, -0.5) (both multiply x) or sqrt(v) (divides it)."""
    return is_op(node, aten.rsqrt.default, aten.sqrt.default) or (
        is_op(node, aten.pow.Tensor_Scalar) and scalar(node.args[1]) == -0.5)


def _centred(d: Any) -> tuple[Any, fx.Node] | None:
    """For d = x - mean(x, -1, keepdim=True) (through casts): (x as d reads it, the mean)."""
    if not is_op(strip_casts(d), aten.sub.Tensor) or strip_casts(d).kwargs:
        return None
    xc, mean = strip_casts(d).args[:2]
    if not is_op(mean, aten.mean.dim) or strip_casts(mean.args[0]) is not strip_casts(xc):
        return None
    return (xc, mean) if keepdim(mean) and is_last_dim(mean.args[1], mean.args[0]) else None


def _param_vector(node: Any, n: int, params: dict[str, str]) -> tuple[Any, list[fx.Node]]:
    """(parameter, its cast nodes) if `node` is an (n,) parameter, possibly cast
    (`w.float()`), else (None, [])."""
    p = strip_casts(node)
    if not (isinstance(p, fx.Node) and p.name in params and _is_vector(p, n)):
        return None, []
    casts = []
    while node is not p:
        casts.append(node)
        node = node.args[0]
    return p, casts


def _weight(normed: fx.Node, n_cols: int,
            params: dict[str, str]) -> tuple[fx.Node, Any, float, list[fx.Node]]:
    """Follow an optional cast then `w·n` or `(1+w)·n` (w possibly cast): (y, weight,
    offset, extra nodes)."""
    out, extra = normed, []
    if (cast := sole_user(out, *CAST_OPS)) is not None:
        out = cast
        extra.append(out)
    if (mul := sole_user(out, aten.mul.Tensor)) is not None:
        w = other_arg(mul, out)
        base, casts = _param_vector(w, n_cols, params)
        if base is not None:
            return mul, base, 0.0, [*extra, *casts, mul]
        if is_op(w, aten.add.Tensor) and len(w.users) == 1:
            for arg in w.args[:2]:
                base, casts = _param_vector(arg, n_cols, params)
                if base is not None and scalar(other_arg(w, arg)) == 1.0:
                    return mul, base, 1.0, [*extra, *casts, w, mul]
    return out, None, 0.0, extra


def _is_vector(node: fx.Node, n: int) -> bool:
    t = fake(node)
    return t is not None and t.dim() == 1 and int(t.shape[0]) == n


def _rms_at(inv: fx.Node, params: dict[str, str]) -> Match | None:
    """Match an RMSNorm whose reciprocal-root node is `inv` (rsqrt or sqrt) — or, where
    what it normalises is x - mean(x), the LayerNorm of x spelled out."""
    found = _mean_plus_eps(inv.args[0])
    if found is None:
        return None
    xf, eps, core = found
    normed = _normalised(inv, xf)
    t = fake(xf)
    if normed is None or t is None or t.dim() == 0:
        return None
    if (centred := _centred(xf)) is not None:
        return _spelled_layer_norm(inv, xf, normed, centred, eps, core, params)
    x = strip_casts(xf)
    casts = [n for n in (xf, normed.args[0]) if is_op(n, *CAST_OPS)]
    y, weight, offset, tail = _weight(normed, int(t.shape[-1]), params)
    return _rms_match(inv, x, [*casts, *core, inv, normed, *tail], y, weight, offset, eps)


def _rms_match(anchor: fx.Node, x: Any, nodes: list[fx.Node], y: fx.Node, weight: Any,
               offset: float, eps: float) -> Match:
    """The RMSNorm site of x whose result (after its weight, if any) is y, with the cast of
    y back to x's dtype when there is one."""
    y, back = cast_back(y, x)
    nodes = tuple(dict.fromkeys([*nodes, *back]))
    operands = {"x": x, "weight": weight, "eps": eps, "weight_offset": offset}
    ty, tx = fake(y), fake(x)
    if weight is None and (ty is None or tx is None or ty.dtype != tx.dtype):
        # no weight multiply after it (none at all — `F.rms_norm(x, (D,))`, NanoChat — or one
        # behind a reshape: Bamba's grouped norm) and a result in another dtype than x: the
        # kernel writes x's dtype, so analysis only, a family of its own
        return Match("rms_norm_no_weight", None, module_path(anchor), nodes, operands, {"y": y})
    return Match("rms_norm", "rms_norm", module_path(anchor), nodes, operands, {"y": y})


def _by_root_width(node: fx.Node, n: int, inverse: bool = False) -> fx.Node | None:
    """The sole user of `node` that multiplies it by √n (a number), else None; inverse:
    that multiplies it by 1/√n or divides it by √n."""
    mul = sole_user(node, aten.mul.Tensor, *((aten.div.Tensor,) if inverse else ()))
    if mul is None or (is_op(mul, aten.div.Tensor) and mul.args[0] is not node):
        return None
    c = scalar(other_arg(mul, node))
    if c is not None and inverse and is_op(mul, aten.mul.Tensor):
        c = 1 / c if c else None
    return mul if c is not None and math.isclose(c, math.sqrt(n), rel_tol=1e-6) else None


L2_FLOOR_MAX = 1e-6  # the largest clamp floor ε read as an RMSNorm's eps (module doc)


def _l2_normalized_at(norm: fx.Node, params: dict[str, str]) -> Match | None:
    """x / [expand] clamp_min(‖x‖₂ over the last dim, keepdim, ε) · √D [· w], the product by
    √D and the weight's in either order (F.normalize, or x / x.norm(...).clamp(min=ε)):
    RMSNorm of x with eps ε²/D (module doc); without a clamp, eps 0 (0/0 in both). Or the
    norm · D^-½ (or / √D) clamped, x divided by it [· w]: RMSNorm with eps ε²."""
    x, order, dims = (list(norm.args) + [None, None])[:3]
    t = fake(x)
    if (norm.kwargs.get("dtype") is not None or len(norm.args) < 4 or norm.args[3] is not True
            or scalar(order) != 2.0 or dims is None or len(dims) != 1 or not is_last_dim(dims, x)
            or t is None or t.dim() == 0 or not isinstance(t.shape[-1], int)):
        return None
    n, nodes, node, eps = int(t.shape[-1]), [norm], norm, 0.0
    rms = _by_root_width(node, n, inverse=True)  # ‖x‖ / √D: rms(x) already
    if rms is not None:
        node = rms
        nodes.append(rms)
    clamp = sole_user(node, aten.clamp_min.default, aten.clamp.default)
    if clamp is not None:
        floor = scalar(clamp.args[1]) if len(clamp.args) > 1 else None
        if floor is None or (is_op(clamp, aten.clamp.default) and len(clamp.args) > 2
                             and clamp.args[2] is not None) or clamp.kwargs:
            return None  # a ceiling, or a floor that is no number
        if not 0.0 < floor <= L2_FLOOR_MAX:
            return None  # a floor <= 0 does nothing; a large one is no RMSNorm's eps
        node, eps = clamp, floor
        nodes.append(clamp)
    if (expand := sole_user(node, aten.expand.default)) is not None:
        node = expand
        nodes.append(expand)
    div = sole_user(node, aten.div.Tensor)
    if div is None or div.args[1] is not node or not _same_value(div.args[0], x):
        return None
    nodes.append(div)
    if rms is not None:  # x / rms(x): the weight may follow, no √D
        y, weight, offset, tail = _weight(div, n, params)
        casts = [c for c in (x, div.args[0]) if is_op(c, *CAST_OPS)]
        return _rms_match(norm, strip_casts(x), [*casts, *nodes, *tail], y, weight, offset, eps * eps)
    if (scaled := _by_root_width(div, n)) is not None:  # · √D, then the weight
        y, weight, offset, tail = _weight(scaled, n, params)
        nodes += [scaled, *tail]
    else:  # the weight, then · √D
        y, weight, offset, tail = _weight(div, n, params)
        scaled = _by_root_width(y, n) if weight is not None else None
        if scaled is None:
            return None
        nodes += [*tail, scaled]
        y = scaled
    casts = [c for c in (x, div.args[0]) if is_op(c, *CAST_OPS)]  # x.float(): the site's own
    return _rms_match(norm, strip_casts(x), [*casts, *nodes], y, weight, offset, eps * eps / n)


def _spelled_layer_norm(inv: fx.Node, d: Any, normed: fx.Node, centred: tuple[Any, fx.Node],
                        eps: float, core: list[fx.Node], params: dict[str, str]) -> Match | None:
    """(x - mean)·rsqrt(mean((x - mean)²) + eps) [· w] [+ b] [cast back]: layer_norm(x)."""
    xc, mean = centred
    x = strip_casts(xc)
    tx = fake(x)
    if tx is None or not tx.is_floating_point():
        return None
    n = int(tx.shape[-1])
    d2 = other_arg(normed, inv) if is_op(normed, aten.mul.Tensor) else normed.args[0]
    subs = [strip_casts(v) for v in (d, d2)]
    casts = [c for c in (xc, mean.args[0], d, d2) if is_op(c, *CAST_OPS)]
    y, weight, offset, tail = _weight(normed, n, params)
    if offset:
        return None  # (1 + w)·n: no LayerNorm we know writes it
    bias = None
    if weight is not None and (add := sole_user(y, aten.add.Tensor)) is not None:
        bias, bias_casts = _param_vector(other_arg(add, y), n, params)
        if bias is not None:
            y, tail = add, [*tail, *bias_casts, add]
    y, back = cast_back(y, x)
    ty = fake(y)
    if ty is None or ty.dtype != tx.dtype:
        return None  # the kernel writes x's dtype
    nodes = tuple(dict.fromkeys([*casts, mean, *subs, *core, inv, normed, *tail, *back]))
    operands = {"x": x, "weight": weight, "bias": bias, "eps": eps}
    return Match("layer_norm", "layer_norm", module_path(inv), nodes, operands, {"y": y})


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
    return Match(fam, fam if m.kernel else None, m.module, (x, *m.nodes), operands,
                 {**m.outputs, "residual": x})


def find(gm: fx.GraphModule, params: dict[str, str]) -> list[Match]:
    """Every RMSNorm/LayerNorm site, folded with its residual add where there is one."""
    found: list[Match] = []
    for node in gm.graph.nodes:
        if _reciprocal_root(node):
            m = _rms_at(node, params)
        elif is_op(node, aten.linalg_vector_norm.default):
            m = _l2_normalized_at(node, params)
        elif is_op(node, aten.native_layer_norm.default):
            m = _layer_norm_at(node)
        else:
            continue
        if m is not None:
            found.append(m)
    claimed: set[fx.Node] = set()
    return [_with_residual(m, claimed) for m in found]
