"""RoPE pattern: x·cos + rotate_half(x)·sin on q and k, paired into one launch.

rotate_half(x) = cat(-x[..., R/2:], x[..., :R/2]) is matched whether the halves come from
slicing or from `chunk`/`split`; the two products may be written in either order. q and k
rotated with the same cos/sin in one module make one `rope_qk` site.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from torch import fx

from advisor.graph.capture import fake, module_path
from advisor.graph.match import Match, aten, is_getitem, is_op, other_arg


def _half_of(node: Any) -> tuple[Any, int, int] | None:
    """(x, start, stop) when node is x[..., start:stop] by slice or split+getitem."""
    t = fake(node)
    if t is None:
        return None
    width = int(t.shape[-1])
    if is_op(node, aten.slice.Tensor):
        x, dim = node.args[0], node.args[1]
        tx = fake(x)
        if tx is None or dim not in (-1, tx.dim() - 1):
            return None
        start = int(node.args[2]) if len(node.args) > 2 else 0
        return x, start, start + width
    if is_getitem(node) and is_op(node.args[0], aten.split.Tensor):
        split = node.args[0]
        x, size = split.args[0], int(split.args[1])
        dim = split.args[2] if len(split.args) > 2 else 0
        tx = fake(x)
        if tx is None or dim not in (-1, tx.dim() - 1):
            return None
        start = int(node.args[1]) * size
        return x, start, start + width
    return None


def _rotate_half(cat: fx.Node) -> tuple[Any, list[fx.Node]] | None:
    """x and the nodes of cat(-x2, x1) over the full last dim of x."""
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    if len(parts) != 2 or not is_op(parts[0], aten.neg.default):
        return None
    hi, lo = _half_of(parts[0].args[0]), _half_of(parts[1])
    if hi is None or lo is None or hi[0] is not lo[0]:
        return None
    x = hi[0]
    tx = fake(x)
    if tx is None or dim not in (-1, tx.dim() - 1):
        return None
    r = int(tx.shape[-1])
    if lo[1:] != (0, r // 2) or hi[1:] != (r // 2, r):
        return None
    halves = [parts[0].args[0], parts[1]]
    split = [h.args[0] for h in halves if is_getitem(h)]
    return x, [*split, *halves, parts[0], cat]


def _rope_at(cat: fx.Node) -> Match | None:
    rot = _rotate_half(cat)
    if rot is None:
        return None
    x, rot_nodes = rot
    for mul_sin in cat.users:
        if not is_op(mul_sin, aten.mul.Tensor):
            continue
        sin = other_arg(mul_sin, cat)
        for add in mul_sin.users:
            if not is_op(add, aten.add.Tensor):
                continue
            mul_cos = other_arg(add, mul_sin)
            if not is_op(mul_cos, aten.mul.Tensor):
                continue
            cos = other_arg(mul_cos, x)
            if cos is None:
                continue
            nodes = (*rot_nodes, mul_sin, mul_cos, add)
            operands = {"x": x, "cos": cos, "sin": sin, "interleaved": False}
            return Match("rope", "rope_qk", module_path(add), nodes, operands, {"y": add})
    return None


def find(gm: fx.GraphModule) -> list[Match]:
    """rope_qk sites: pairs of rotations sharing cos/sin, q (more heads) first."""
    singles = [m for n in gm.graph.nodes if is_op(n, aten.cat.default) and (m := _rope_at(n))]
    by_key: dict[tuple[Any, Any, str], list[Match]] = defaultdict(list)
    for m in singles:
        by_key[(m.operands["cos"], m.operands["sin"], m.module)].append(m)
    found = []
    for (cos, sin, module), ms in by_key.items():
        ms = sorted(ms, key=lambda m: m.nodes[-1].meta.get("seq_nr", 0))
        for q, k in zip(ms[0::2], ms[1::2]):
            tq, tk = fake(q.operands["x"]), fake(k.operands["x"])
            if tq is None or tk is None or tq.dim() != 4 or tk.dim() != 4:
                continue
            if tq.shape[1] < tk.shape[1]:
                q, k = k, q
            operands = {"q": q.operands["x"], "k": k.operands["x"], "cos": cos, "sin": sin,
                        "interleaved": False}
            found.append(Match("rope", "rope_qk", module, (*q.nodes, *k.nodes), operands,
                               {"q": q.outputs["y"], "k": k.outputs["y"]}))
    return found
