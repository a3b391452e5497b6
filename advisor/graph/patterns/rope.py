"""RoPE patterns: x·cos + rotate_half(x)·sin on q and k, paired into one launch; and the
cos/sin tables themselves (`find_tables`: cos and sin of positions ⊗ inverse frequencies).

rotate_half(x) = cat(-x[..., R/2:], x[..., :R/2]) is matched whether the halves come from
slicing or from `chunk`/`split`; the two products may be written in either order. The
interleaved convention (GPT-J, Cohere) rotates pairs: stack((-x[..., 1::2], x[..., ::2]),
-1) viewed back to x's shape. Also matched: the rotation written out on x's halves with
half-width tables (`_halves_rope_at`: GPT-OSS, NanoChat), on (re, im) pairs (gpt-fast) and as
a complex product (Meta's reference). q and k rotated with the same cos/sin in one module
make one `rope_qk` site.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from advisor.graph.capture import fake, module_path
from advisor.graph.match import (
    CAST_OPS,
    Match,
    aten,
    cast_back,
    is_getitem,
    is_last_dim,
    is_op,
    other_arg,
    scalar,
    strip_casts,
)


def _half_of(node: Any) -> tuple[Any, int, int] | None:
    """(x, start, stop) when node is x[..., start:stop] (step 1; a negative start counts
    from the end) by slice, or by split / split_with_sizes and getitem."""
    t = fake(node)
    if t is None:
        return None
    width = int(t.shape[-1])
    if is_op(node, aten.slice.Tensor):
        x, dim = node.args[0], node.args[1]
        tx = fake(x)
        step = node.args[4] if len(node.args) > 4 else 1
        if tx is None or dim not in (-1, tx.dim() - 1) or step != 1:
            return None
        start = _size(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else 0
        if start is None:
            return None
        start = start + int(tx.shape[-1]) if start < 0 else start
        return x, start, start + width
    if is_getitem(node) and is_op(node.args[0], aten.split.Tensor, aten.split_with_sizes.default):
        split = node.args[0]
        x, sizes = split.args[0], split.args[1]
        dim = split.args[2] if len(split.args) > 2 else 0
        tx = fake(x)
        if tx is None or dim not in (-1, tx.dim() - 1):
            return None
        i = int(node.args[1])
        before = [_size(s) for s in sizes[:i]] if isinstance(sizes, (list, tuple)) else [_size(sizes)] * i
        if None in before:
            return None
        start = sum(before)
        return x, start, start + width
    return None


def _size(v: Any) -> int | None:
    """A split size or slice start: an int, or (traced with dynamic shapes: `x.chunk(2)`,
    `x[..., -(d // 2):]` of a size the graph computes) the value its node was traced with.
    int() of a SymInt guards on it, unlike `capture.hint`, on purpose: which halves a site
    rotates must hold for every call the graph serves (these derive from the head dim,
    fixed by the weights, so the guard costs no recompiles across lengths)."""
    if isinstance(v, fx.Node):
        v = v.meta.get("val")
    return int(v) if isinstance(v, (int, torch.SymInt)) else None


def _rotate_half(cat: fx.Node) -> tuple[Any, list[fx.Node], bool] | None:
    """(x, the nodes, False) of cat(-x2, x1) over the full last dim of x; (x, the nodes,
    True) of cat(x2, -x1), the rotation the other way (NanoChat's: x·cos + that·sin is RoPE
    with sin negated)."""
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    if len(parts) != 2:
        return None
    other_way = is_op(parts[1], aten.neg.default) and not is_op(parts[0], aten.neg.default)
    if other_way:
        hi, lo, neg = _half_of(parts[0]), _half_of(parts[1].args[0]), parts[1]
    elif is_op(parts[0], aten.neg.default):
        hi, lo, neg = _half_of(parts[0].args[0]), _half_of(parts[1]), parts[0]
    else:
        return None
    if hi is None or lo is None or hi[0] is not lo[0]:
        return None
    x = hi[0]
    tx = fake(x)
    if tx is None or dim not in (-1, tx.dim() - 1):
        return None
    r = int(tx.shape[-1])
    if lo[1:] != (0, r // 2) or hi[1:] != (r // 2, r):
        return None
    halves = [neg.args[0], parts[0] if other_way else parts[1]]
    split = [h.args[0] for h in halves if is_getitem(h)]
    return x, [*split, *halves, neg, cat], other_way


_FLATTENS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _every_other(node: Any, start: int) -> Any:
    """x for x[..., start::2] (a last-dim slice with step 2 to the end), else None."""
    if not is_op(node, aten.slice.Tensor) or len(node.args) != 5:
        return None
    x, dim, lo, hi, step = node.args
    tx = fake(x)
    if tx is None or dim not in (-1, tx.dim() - 1) or (lo, step) != (start, 2):
        return None
    return x if isinstance(hi, int) and hi >= int(tx.shape[-1]) else None


def _rotate_pairs(stack: fx.Node) -> tuple[Any, fx.Node, list[fx.Node]] | None:
    """x, the rotation and its nodes for stack((-x[..., 1::2], x[..., ::2]), -1) viewed
    back to x's shape (interleaved RoPE's rotate)."""
    parts, dim = stack.args[0], stack.args[1] if len(stack.args) > 1 else 0
    if len(parts) != 2 or not is_op(parts[0], aten.neg.default) or len(stack.users) != 1:
        return None
    x = _every_other(parts[0].args[0], 1)
    if x is None or _every_other(parts[1], 0) is not x:
        return None
    flat = next(iter(stack.users))
    tx, tf = fake(x), fake(flat)
    if not is_op(flat, *_FLATTENS) or tx is None or tf is None or dim not in (-1, tx.dim()):
        return None
    if tf.shape != tx.shape:
        return None
    return x, flat, [parts[0].args[0], parts[1], parts[0], stack, flat]


def _pair_select(node: Any) -> tuple[Any, int] | None:
    """(P, i) for P[..., i] of a last dim of 2 (the (re, im) pairs of a RoPE operand)."""
    if not is_op(node, aten.select.int):
        return None
    src, dim, i = node.args
    ts = fake(src)
    if ts is None or dim not in (-1, ts.dim() - 1) or int(ts.shape[-1]) != 2 or i not in (0, 1):
        return None
    return src, int(i)


def _product_of(mul: Any) -> frozenset | None:
    """{(pair source, i), (other source, j)} for a mul of two pair selects A[..., i]·B[..., j]."""
    if not is_op(mul, aten.mul.Tensor) or len(mul.args) != 2:
        return None
    a, b = _pair_select(mul.args[0]), _pair_select(mul.args[1])
    if a is None or b is None or a[0] is b[0]:
        return None
    return frozenset((a, b))


def _complex_product(stack: fx.Node) -> tuple[Any, Any, list[fx.Node]] | None:
    """(X pairs, table pairs, nodes) for stack((x0·c − x1·s, x1·c + x0·s), -1): RoPE on
    (re, im) pairs written out (gpt-fast; Meta's Llama reference without complex dtypes),
    x_i = X[..., i] of X viewed as (..., D/2, 2), (c, s) = F[..., 0], F[..., 1]. Pair
    products commute, so X is the operand of the output's full shape; the table broadcasts."""
    parts, dim = stack.args[0], stack.args[1] if len(stack.args) > 1 else 0
    tst = fake(stack)
    if tst is None or len(parts) != 2 or dim not in (-1, tst.dim() - 1):
        return None
    re, im = parts
    if not (is_op(re, aten.sub.Tensor) and is_op(im, aten.add.Tensor)) or re.kwargs or im.kwargs:
        return None
    prods = [_product_of(n) for n in (*re.args, *im.args)]
    if any(p is None for p in prods):
        return None
    sources = {src for p in prods for src, _ in p}
    if len(sources) != 2:
        return None
    a, b = sources
    # re = a0·b0 − a1·b1, im = a1·b0 + a0·b1 (in either order, each product's factors too)
    if (prods[0] != {(a, 0), (b, 0)} or prods[1] != {(a, 1), (b, 1)}
            or set(prods[2:]) != {frozenset({(a, 1), (b, 0)}), frozenset({(a, 0), (b, 1)})}):
        return None
    pairs_shape = tuple(tst.shape[:-1])
    full = [n for n in (a, b) if (t := fake(n)) is not None and tuple(t.shape[:-1]) == pairs_shape]
    if len(full) != 1:  # which side is the table must be unambiguous
        return None
    x = full[0]
    selects = [n for p in (*re.args, *im.args) for n in p.args]
    return x, b if x is a else a, [*dict.fromkeys(selects), *re.args, *im.args, re, im, stack]


def _eq(a: Any, b: Any) -> bool:
    return bool(statically_known_true(a == b))


def _table_layout(tx: torch.Tensor, tc: torch.Tensor) -> int | None:
    """X's sequence dim (1: (B, T, H, D), 2: (B, H, T, D)) read off how a cos/sin table
    (..., R), or a per-pair one (..., R/2), broadcasts against X (or its pairs):
    (1|B, T, 1, ·) or (1|B, 1, T, ·) or (T, ·). EITHER where both readings fit (one token
    and one head: a decode step's k with one KV head); `find` settles it with the rest."""
    # one table value per pair (by broadcasting, a width of 1 would serve every pair)
    if tx.dim() != 4 or (_eq(tc.shape[-1], 1) and not _eq(tx.shape[-1], 2)):
        return None
    if tc.dim() == 2:
        return 2 if _eq(tc.shape[0], tx.shape[2]) else None
    if tc.dim() != 4 or not (_eq(tc.shape[0], 1) or _eq(tc.shape[0], tx.shape[0])):
        return None
    fits = [seq for seq, heads in ((1, 2), (2, 1))
            if _eq(tc.shape[heads], 1) and _eq(tc.shape[seq], tx.shape[seq])]
    return fits[0] if len(fits) == 1 else EITHER if fits else None


EITHER = 0  # a RoPE whose layout reads the same either way (`_table_layout`)


def _pairs_rope_at(stack: fx.Node) -> Match | None:
    """RoPE on (re, im) pairs written out (`_complex_product`) of X (B, T, H, D) or
    (B, H, T, D), fp32 math cast back allowed: the interleaved convention with one table
    value per pair. The kernels take full-width tables in (B, H, T, D) order: the emitter
    repeats each table value twice and transposes X (runtime/emit.py `_emit_prepared_rope`)."""
    found = _complex_product(stack)
    flat = next(iter(stack.users)) if len(stack.users) == 1 else None
    if found is None or not is_op(flat, *_FLATTENS):
        return None
    x5, table, nodes = found
    if not is_op(x5, *_FLATTENS):
        return None
    xin = x5.args[0]
    x = strip_casts(xin)
    tx, tin, tf = fake(x), fake(xin), fake(flat)
    if tx is None or tin is None or tf is None or tuple(tf.shape) != tuple(tin.shape):
        return None
    y, back = cast_back(flat, x) if x is not xin else (flat, [])
    ty = fake(y)
    if ty is None or ty.dtype != tx.dtype:
        return None  # the kernel writes x's dtype
    tables = {}
    for user in table.users:
        sel = _pair_select(user)
        if sel is not None and sel[0] is table:
            tables.setdefault(sel[1], user)
    cos, sin = tables.get(0), tables.get(1)
    tc = fake(cos)
    seq_dim = _table_layout(tx, tc) if tc is not None else None
    if cos is None or sin is None or seq_dim is None:
        return None
    inner = [n for n in nodes if n not in (cos, sin)]
    operands = {"x": x, "cos": cos, "sin": sin, "interleaved": True, "pairs": True, "seq_dim": seq_dim}
    upcast = [xin] if x is not xin else []
    return Match("rope", "rope_qk", module_path(stack), (*upcast, x5, *inner, flat, *back),
                 operands, {"y": y})


def _complex_rope_at(real: fx.Node) -> Match | None:
    """Meta's Llama reference: view_as_real(view_as_complex(X.float() viewed as (..., D/2,
    2)) · F) viewed back to X's shape, F a complex (..., D/2) table broadcasting as
    (1|B, T, 1, ·): the pairs RoPE of `_pairs_rope_at`, with cos = F.real, sin = F.imag."""
    mul = real.args[0]
    flat = next(iter(real.users)) if len(real.users) == 1 else None
    if not is_op(mul, aten.mul.Tensor) or len(mul.users) != 1 or not is_op(flat, *_FLATTENS):
        return None
    for xc, table in (mul.args[:2], mul.args[1::-1]):
        if not is_op(xc, aten.view_as_complex.default) or len(xc.users) != 1:
            continue
        x5 = xc.args[0]
        tt = fake(table)
        if not is_op(x5, *_FLATTENS) or tt is None or not tt.dtype.is_complex:
            continue
        xin = x5.args[0]
        x = strip_casts(xin)
        tx, tin, tf = fake(x), fake(xin), fake(flat)
        if tx is None or tin is None or tf is None or tuple(tf.shape) != tuple(tin.shape):
            continue
        y, back = cast_back(flat, x) if x is not xin else (flat, [])
        ty = fake(y)
        seq_dim = _table_layout(tx, tt)
        if ty is None or ty.dtype != tx.dtype or seq_dim is None:
            continue
        operands = {"x": x, "cos": table, "sin": table, "interleaved": True, "pairs": "complex",
                    "seq_dim": seq_dim}
        upcast = [xin] if x is not xin else []
        return Match("rope", "rope_qk", module_path(real), (*upcast, x5, xc, mul, real, flat, *back),
                     operands, {"y": y})
    return None


def _signed_products(node: Any) -> list[tuple[int, fx.Node, list[fx.Node]]] | None:
    """node = ±(a·b) ± (c·d) (add, sub, a neg on a product or on one factor) as
    [(sign, product, the negs)]."""
    if not is_op(node, aten.add.Tensor, aten.sub.Tensor) or node.kwargs or len(node.args) != 2:
        return None
    terms = []
    for sign, term in zip((1, -1 if node.target is aten.sub.Tensor else 1), node.args):
        negs = []
        if is_op(term, aten.neg.default):
            sign, negs, term = -sign, [term], term.args[0]
        if not is_op(term, aten.mul.Tensor) or len(term.args) != 2:
            return None
        terms.append((sign, term, negs))
    return terms


def _half_term(sign: int, mul: fx.Node,
               negs: list[fx.Node]) -> tuple[Any, int, int, Any, list[fx.Node], int] | None:
    """(x, start, sign, table, nodes, width) for sign·(x[..., start:start + width] · ±table)."""
    for half, table in (mul.args, mul.args[::-1]):
        found = _half_of(half)
        if found is None:
            continue
        if is_op(table, aten.neg.default):  # x1 · (−sin): the site's, shared (`_halves_rope_at`)
            sign, negs, table = -sign, [*negs, table], table.args[0]
        views = [half.args[0], half] if is_getitem(half) else [half]
        return found[0], found[1], sign, table, [*views, *negs, mul], found[2] - found[1]
    return None


def _halves_rope_at(cat: fx.Node) -> Match | None:
    """RoPE written out on the two halves of x (R = 2h): cat(x1·c − x2·s, x2·c + x1·s), x1 =
    x[..., :h], x2 = x[..., h:], with half-width tables (GPT-OSS; a rotation the other way,
    x1·c + x2·s and x2·c − x1·s, is NanoChat's: sin negated). Sums and products in either
    order. The kernels take full-width tables: the emitter repeats each (`pairs`: "halves",
    "halves_neg")."""
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    tcat = fake(cat)
    if tcat is None or len(parts) != 2 or dim not in (-1, tcat.dim() - 1):
        return None
    sums = [_signed_products(p) for p in parts]
    if sums[0] is None or sums[1] is None:
        return None
    terms = [[_half_term(*t) for t in terms] for terms in sums]
    if any(t is None for ts in terms for t in ts):
        return None
    xin = terms[0][0][0]
    tin = fake(xin)
    if tin is None or any(t[0] is not xin for ts in terms for t in ts):
        return None
    h = int(tin.shape[-1]) // 2
    if 2 * h != int(tin.shape[-1]):
        return None
    by_half = [{t[1]: t for t in ts} for ts in terms]  # per output half: x's half start -> term
    if any(set(b) != {0, h} for b in by_half) or any(t[5] != h for ts in terms for t in ts):
        return None  # each factor is a whole half (a narrower slice would broadcast)
    (c1, c2), (s1, s2) = (by_half[0][0], by_half[1][h]), (by_half[0][h], by_half[1][0])
    if c1[3] is not c2[3] or s1[3] is not s2[3] or c1[2] != 1 or c2[2] != 1 or s1[2] != -s2[2]:
        return None
    cos, sin, negated = c1[3], s1[3], s2[2] < 0
    x = strip_casts(xin)
    # fp32 math cast back: x.float()'s halves, or x's halves promoted by fp32 tables
    y, back = cast_back(cat, x)
    tx, ty, tc, ts = fake(x), fake(y), fake(cos), fake(sin)
    if tx is None or ty is None or tc is None or ts is None or ty.dtype != tx.dtype:
        return None  # the kernel writes x's dtype
    if not (_eq(tc.shape[-1], h) and _eq(ts.shape[-1], h)):
        return None
    seq_dim = _table_layout(tx, tc)
    if seq_dim is None:
        return None
    nodes = [*([xin] if x is not xin else []), *[n for ts_ in terms for t in ts_ for n in t[4]],
             *parts, cat, *back]
    x, y, views = _partial(x, y)
    if views:
        nodes = [*views, *nodes, y]
    operands = {"x": x, "cos": cos, "sin": sin, "interleaved": False,
                "pairs": "halves_neg" if negated else "halves", "seq_dim": seq_dim}
    # −sin is computed once for every layer after CSE: checked with the site (the reference
    # reads it), left in the graph while another site reads it (the emitter negates sin)
    shared = tuple(n for n in nodes if is_op(n, aten.neg.default) and n.args[0] in (cos, sin))
    return Match("rope", "rope_qk", module_path(cat), tuple(dict.fromkeys(nodes)), operands, {"y": y},
                 shared)


def _rope_at(node: fx.Node) -> Match | None:
    """The RoPE of x whose rotation ends at `node` (rotate_half's cat, interleaved RoPE's
    stack, the stack of (re, im) pairs, or view_as_real of a complex product)."""
    if is_op(node, aten.view_as_real.default):
        return _complex_rope_at(node)
    if is_op(node, aten.stack.default) and (pairs := _pairs_rope_at(node)) is not None:
        return pairs
    if is_op(node, aten.cat.default) and (halves := _halves_rope_at(node)) is not None:
        return halves
    other_way = False
    if is_op(node, aten.cat.default):
        found, interleaved = _rotate_half(node), False
        if found is not None:
            *found, other_way = found
        rot = node
    else:
        pairs, interleaved = _rotate_pairs(node), True
        found, rot = (None, None) if pairs is None else ((pairs[0], pairs[2]), pairs[1])
    if found is None:
        return None
    x, rot_nodes = found
    widened = _widened(rot)  # rotated in x's dtype, then upcast (ERNIE 4.5): exact either way
    if widened is not None:
        rot, rot_nodes = widened, [*rot_nodes, widened]
    for mul_sin in rot.users:
        if not is_op(mul_sin, aten.mul.Tensor):
            continue
        sin = other_arg(mul_sin, rot)
        for add in mul_sin.users:
            if not is_op(add, aten.add.Tensor):
                continue
            mul_cos = other_arg(add, mul_sin)
            if not is_op(mul_cos, aten.mul.Tensor):
                continue
            cos = other_arg(mul_cos, x)
            if cos is None and widened is not None:  # x upcast in the cos term too
                xc = next((a for a in mul_cos.args[:2] if _widens(x, a)), None)
                x, cos = (xc, other_arg(mul_cos, xc)) if xc is not None else (x, None)
            if cos is None:
                continue
            # fp32 math (x.float(), or fp32 tables promoting x), the result cast back to
            # the dtype x came in: the kernel reads that x and writes that dtype.
            x0 = strip_casts(x)
            y, back = cast_back(add, x0)
            upcast = [x] if back and x0 is not x else []
            x = x0 if upcast else x
            if not back:
                y, back = cast_back(add, x)
            tx, ty = fake(x), fake(y)
            if tx is None or ty is None or ty.dtype != tx.dtype:
                return None  # the kernel writes x's dtype
            nodes = (*upcast, *rot_nodes, mul_sin, mul_cos, add, *back)
            x, y, views = _partial(x, y)
            if views:  # the slices run first, the cat last
                nodes = (*views, *nodes, y)
            operands = {"x": x, "cos": cos, "sin": sin, "interleaved": interleaved}
            tx, tc = fake(x), fake(cos)
            layout = _table_layout(tx, tc) if tx is not None and tc is not None else None
            if layout in (1, EITHER):
                operands["seq_dim"] = layout  # 1: (B, T, H, D), GPT-J: the emitter transposes
            if other_way:  # the emitter negates sin
                operands["pairs"] = "neg"
            return Match("rope", "rope_qk", module_path(add), nodes, operands, {"y": y})
    return None


def _widened(node: Any) -> fx.Node | None:
    """node's only reader when that is an exact upcast of it, read once; else None."""
    cast = next(iter(node.users)) if isinstance(node, fx.Node) and len(node.users) == 1 else None
    return cast if _widens(node, cast) else None


def _widens(node: Any, cast: Any) -> bool:
    """`cast` upcasts `node` exactly (`strip_casts`: fp16/bf16 to fp32) and is read once."""
    return is_op(cast, *CAST_OPS) and len(cast.users) == 1 and strip_casts(cast) is node


def _partial(x: Any, y: fx.Node) -> tuple[Any, fx.Node, list[fx.Node]]:
    """Partial rotary, cat(rope(X[..., :R]), X[..., R:]): (X, the cat, the slices (and
    split) of X it reads) — the kernels rotate the first R dims of X
    (R: the tables' width) and pass the rest through, so the cat's launch goes; (x, y, [])
    otherwise."""
    rotated = _half_of(x)
    cat = next(iter(y.users)) if len(y.users) == 1 else None
    if rotated is None or rotated[1] != 0 or not is_op(cat, aten.cat.default) or len(cat.args[0]) != 2:
        return x, y, []
    full, r = rotated[0], rotated[2]
    dim = cat.args[1] if len(cat.args) > 1 else 0
    tx, ty, tc = fake(full), fake(y), fake(cat)
    if tx is None or ty is None or tc is None or dim not in (-1, tx.dim() - 1):
        return x, y, []
    if cat.args[0][0] is not y or _half_of(cat.args[0][1]) != (full, r, int(tx.shape[-1])):
        return x, y, []
    if r == int(tx.shape[-1]):  # nothing passed: a copy of the rotation (graph/copies.py)
        return x, y, []
    if tc.dtype != tx.dtype or tc.shape != tx.shape:  # the kernel writes X's dtype and shape
        return x, y, []
    # the slices of X: the site's (a view another node reads too is shared: match.py)
    views = [v for v in (x, cat.args[0][1]) if is_getitem(v) or is_op(v, aten.slice.Tensor)]
    views = [*[v.args[0] for v in views if is_getitem(v)], *views]  # a split before its pieces
    return full, cat, list(dict.fromkeys(views))


def find(gm: fx.GraphModule) -> list[Match]:
    """rope_qk sites: pairs of rotations sharing cos/sin, q (more heads) first."""
    singles = [m for n in gm.graph.nodes
               if is_op(n, aten.cat.default, aten.stack.default, aten.view_as_real.default)
               and (m := _rope_at(n))]
    by_key: dict[tuple[Any, ...], list[Match]] = defaultdict(list)
    for m in singles:
        by_key[(m.operands["cos"], m.operands["sin"], m.module, m.operands["interleaved"],
                m.operands.get("pairs", False))].append(m)
    found = []
    for (cos, sin, module, interleaved, pairs), ms in by_key.items():
        # the rotations' layout: the one those that tell agree on ((B, H, T, D) if none does)
        told = {m.operands.get("seq_dim", 2) for m in ms} - {EITHER}
        if len(told) > 1:
            continue
        seq_dim = told.pop() if told else 2
        ms = sorted(ms, key=lambda m: m.nodes[-1].meta.get("seq_nr", 0))
        heads = 3 - seq_dim  # (B, H, T, D) or (B, T, H, D)
        for q, k in zip(ms[0::2], ms[1::2]):
            tq, tk = fake(q.operands["x"]), fake(k.operands["x"])
            if tq is None or tk is None or tq.dim() != 4 or tk.dim() != 4:
                continue
            if tq.shape[heads] < tk.shape[heads]:
                q, k = k, q
            operands = {"q": q.operands["x"], "k": k.operands["x"], "cos": cos, "sin": sin,
                        "interleaved": interleaved}
            if pairs or seq_dim != 2:  # read by the emitter, which makes the kernel's operands
                operands.update(pairs=pairs, seq_dim=seq_dim)
            found.append(Match("rope", "rope_qk", module, tuple(dict.fromkeys((*q.nodes, *k.nodes))),
                               operands, {"q": q.outputs["y"], "k": k.outputs["y"]},
                               tuple(dict.fromkeys((*q.shared, *k.shared)))))
    return found


# --------------------------------------------------------------------------- cos/sin tables


def _scaled_cast(node: fx.Node) -> tuple[fx.Node, float, list[fx.Node]]:
    """trig(e) [· scalar] [.to(dtype)]: (the last node, the scale, the nodes) when each step
    has one reader (a site the fused op can replace whole)."""
    nodes, scale, out = [node], 1.0, node
    if len(out.users) == 1 and is_op(nxt := next(iter(out.users)), aten.mul.Tensor):
        s = scalar(other_arg(nxt, out))
        if s is not None:
            nodes.append(nxt)
            scale, out = s, nxt
    nxt = next(iter(out.users)) if len(out.users) == 1 else None
    if is_op(nxt, *CAST_OPS) and set(nxt.kwargs) <= {"dtype"}:
        nodes.append(nxt)
        out = nxt
    return out, scale, nodes


_FACTOR_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
                 aten.expand.default)


def _fp32_factor(node: Any) -> tuple[Any, list[fx.Node], list[fx.Node]]:
    """A factor as the kernel reads it: views(x.float()) with no other reader of the cast
    or the views is read as views(x), the cast done on load (exact: integer positions
    below 2^24 and any float dtype convert to fp32 as `.float()` does). Returns (x, the
    views to replay on x in order, the nodes replaced); (node, [], []) otherwise."""
    views, cur = [], node
    while is_op(cur, *_FACTOR_VIEWS) and len(cur.users) == 1:
        views.append(cur)
        cur = cur.args[0]
    src = cur.args[0] if is_op(cur, *CAST_OPS) else None
    ts, tc = fake(src), fake(cur)
    if (ts is None or tc is None or cur.kwargs.get("dtype") != torch.float32 or len(cur.users) != 1
            or not set(cur.kwargs) <= {"dtype", "device", "layout"} or ts.device != tc.device):
        return node, [], []
    return src, views[::-1], [cur, *views]


def _product(f: Any) -> tuple[Any, Any, list[tuple[int, int]], list[fx.Node], dict] | None:
    """f = transposes(a · b): (a, b, the transposes to apply to both, the nodes, the views
    to replay on a and b) where the product is a broadcast mul or a bmm whose contracted
    dim is 1 (an outer product); a `.float()` of either factor is done on load."""
    nodes, swaps = [], []
    while is_op(f, aten.transpose.int, aten.view.default) and len(f.users) == 1:
        t_in, t_out = fake(f.args[0]), fake(f)
        if t_in is None or t_out is None:
            return None
        if f.target is aten.transpose.int:
            swaps.append((int(f.args[1]), int(f.args[2])))
        elif tuple(t_in.shape) != tuple(t_out.shape):
            return None  # only identity views (AOT's around bmm)
        nodes.append(f)
        f = f.args[0]
    if not isinstance(f, fx.Node) or len(f.users) != 1:
        return None
    if is_op(f, aten.bmm.default):
        ta, tb = fake(f.args[0]), fake(f.args[1])
        if ta is None or tb is None or ta.shape[-1] != 1:
            return None
        (a, va, ca), (b, vb, cb) = _fp32_factor(f.args[0]), _fp32_factor(f.args[1])
        return a, b, swaps[::-1], [*ca, *cb, f, *nodes], {"a_views": va, "b_views": vb}
    if is_op(f, aten.mul.Tensor) and all(isinstance(x, fx.Node) for x in f.args[:2]):
        (a, va, ca), (b, vb, cb) = _fp32_factor(f.args[0]), _fp32_factor(f.args[1])
        ta, tb, tf = fake(f.args[0]), fake(f.args[1]), fake(f)
        if swaps and (ta is None or tb is None or tf is None or ta.dim() != tf.dim() or tb.dim() != tf.dim()):
            return None  # transposes of lower-rank (broadcast) factors: not modelled
        return a, b, swaps[::-1], [*ca, *cb, f, *nodes], {"a_views": va, "b_views": vb}
    return None


def _table_at(e: fx.Node) -> Match | None:
    trig = {u.target: u for u in e.users if is_op(u, aten.cos.default, aten.sin.default)}
    if len(e.users) != 2 or len(trig) != 2:
        return None
    cos_end, cos_scale, cos_nodes = _scaled_cast(trig[aten.cos.default])
    sin_end, sin_scale, sin_nodes = _scaled_cast(trig[aten.sin.default])
    tc, ts, te = fake(cos_end), fake(sin_end), fake(e)
    if (tc is None or ts is None or te is None or tc.dtype != ts.dtype or te.dtype != torch.float32
            or tc.dtype not in (torch.float32, torch.float16, torch.bfloat16)):
        return None
    f, dup, cat = e, False, []
    if is_op(e, aten.cat.default) and len(e.args[0]) == 2 and e.args[0][0] is e.args[0][1] \
            and is_last_dim(e.args[1] if len(e.args) > 1 else 0, e):
        f, dup, cat = e.args[0][0], True, [e]
    prod = _product(f)
    if prod is None or te.dim() > 3:
        return None
    a, b, swaps, prod_nodes, views = prod
    operands = {"a": a, "b": b, **views, "transposes": swaps, "cos_scale": cos_scale,
                "sin_scale": sin_scale, "dup": dup, "dtype": tc.dtype}
    nodes = (*prod_nodes, *cat, *cos_nodes, *sin_nodes)
    return Match("rope_table", "rope_table", module_path(e), nodes, operands,
                 {"cos": cos_end, "sin": sin_end})


def find_tables(gm: fx.GraphModule) -> list[Match]:
    """rope_table sites: cos(e) and sin(e) of one fp32 e = [cat(f, f) | f], f a product of
    two factors (positions ⊗ inverse frequencies), each optionally scaled and cast."""
    return [m for n in gm.graph.nodes if isinstance(n, fx.Node) and (m := _table_at(n))]
