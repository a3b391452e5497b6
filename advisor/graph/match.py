"""Matching vocabulary shared by every pattern: what a node computes, seen through casts
and views, and the `Match` a pattern returns.

Patterns work on aten graphs from `graph.capture`. A `Match` names the fused op's operands
(fx nodes or constants) and the nodes whose values the fused op replaces; `nodes` is the
whole subgraph, used both to price it (launches, bytes) and to check it is self-contained.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from advisor.graph.capture import fake, module_path, nbytes

aten = torch.ops.aten

# Ops that only re-describe memory: no kernel, no bytes.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
    aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.default, aten.expand.default, aten.slice.Tensor, aten.select.int,
    aten.split.Tensor, aten.split_with_sizes.default, aten.alias.default, aten.detach.default,
    aten.as_strided.default, aten.unbind.int,
}
CAST_OPS = {aten._to_copy.default}
# Reshapes: a new shape in row order (a copy where the strides need one), the same values.
RESHAPE_OPS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)
GETITEM = "getitem"


def is_op(node: Any, *targets: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def is_getitem(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and getattr(
        node.target, "__name__", "") == GETITEM


def launches(node: fx.Node) -> int:
    """Kernel launches a node costs in eager mode (views and getitems cost none; a callable
    may declare its own count, as graph/shape_only's memo does: 0 once its values are kept)."""
    if node.op != "call_function" or is_getitem(node) or node.target in VIEW_OPS:
        return 0
    return int(getattr(node.target, "LAUNCHES_PER_CALL", 1))


def known(cond: Any) -> bool:
    """True only when `cond` holds for every size the graph may run at (no guard added)."""
    return bool(statically_known_true(cond))


def keepdim(reduction: fx.Node) -> bool:
    """A reduction node's keepdim argument (mean.dim / sum.dim_IntList: third or keyword)."""
    return bool(reduction.args[2] if len(reduction.args) > 2 else reduction.kwargs.get("keepdim", False))


def same_sizes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == b.dim() and all(known(x == y) for x, y in zip(a.shape, b.shape))


def strip_casts(node: Any) -> Any:
    """Follow widening dtype casts (`.float()` of bf16/fp16: exact) back to the tensor they
    convert. A narrowing one (`.to(bf16)` of fp32) rounds: what reads it reads the rounded
    values, so it stays (a norm of x.to(bf16) is not a norm of x)."""
    while (is_op(node, *CAST_OPS) and set(node.kwargs) <= {"dtype", "layout", "device"}
           and _widens(node.args[0], node)):
        node = node.args[0]
    return node


def _widens(src: Any, cast: fx.Node) -> bool:
    """`cast` holds every value of `src` exactly: floating point to a wider one."""
    a, b = fake(src), fake(cast)
    return (a is not None and b is not None and a.dtype.is_floating_point and b.dtype.is_floating_point
            and b.dtype.itemsize > a.dtype.itemsize)


def sole_user(node: fx.Node, *targets: Any) -> fx.Node | None:
    """The one reader of `node` if it is one of `targets`, else None."""
    users = list(node.users)
    return users[0] if len(users) == 1 and is_op(users[0], *targets) else None


def cast_back(y: fx.Node, x: Any) -> tuple[fx.Node, list[fx.Node]]:
    """A value computed in fp32 from x and cast back to x's dtype by its only reader (a
    norm's or RoPE's fp32 math): (the cast, [the cast]); else (y, [])."""
    cast = sole_user(y, *CAST_OPS)
    tc, tx = fake(cast), fake(x)
    if cast is not None and tc is not None and tx is not None and tc.dtype == tx.dtype:
        return cast, [cast]
    return y, []


def strip_views(node: Any) -> Any:
    while is_op(node, *VIEW_OPS):
        node = node.args[0]
    return node


def scalar(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def other_arg(node: fx.Node, known: Any) -> Any:
    """For a binary op, the argument that is not `known` (None if neither/both)."""
    a, b = node.args[0], node.args[1]
    if a is known and b is not known:
        return b
    if b is known and a is not known:
        return a
    return None


def last_dim(node: Any) -> int | None:
    t = fake(node)
    return int(t.shape[-1]) if t is not None and t.dim() > 0 else None


def is_last_dim(dims: Any, node: Any) -> bool:
    t = fake(node)
    if t is None:
        return False
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    return len(dims) == 1 and dims[0] in (-1, t.dim() - 1)


@dataclass
class Match:
    """One site a fused kernel can replace.

    family:   candidate family ("add_rms_norm", "gated_act", "rope", "qkv_merge", ...).
    kernel:   registry id of the kernel that implements it (None: analysis only).
    module:   module path of the site.
    nodes:    every node of the matched subgraph.
    operands: name -> fx.Node or constant, the fused op's inputs.
    outputs:  name -> fx.Node whose value the fused op produces (external users read them).
    shared:   nodes of `nodes` that other sites read too (a decoder's one causal mask, read
              by every layer's attention): the fused op recomputes what it needs of them, so
              they are checked with the site but stay in the graph until their last reader
              is gone, and are not priced as this site's saving.
    """

    family: str
    kernel: str | None
    module: str
    nodes: tuple[fx.Node, ...]
    operands: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, fx.Node] = field(default_factory=dict)
    shared: tuple[fx.Node, ...] = ()

    def launches(self) -> int:
        shared = set(self.shared)
        return sum(launches(n) for n in self.nodes if n not in shared)

    def external_inputs(self) -> list[fx.Node]:
        inside = set(self.nodes)
        seen: dict[fx.Node, None] = {}
        for n in self.nodes:
            for a in n.all_input_nodes:
                if a not in inside:
                    seen[a] = None
        return list(seen)

    def bytes_avoided(self) -> int:
        """Unfused traffic (each launching node reads its inputs, writes its output) minus
        fused traffic (external inputs read once, outputs written once)."""
        unfused, shared = 0, set(self.shared)
        for n in self.nodes:
            if launches(n) and n not in shared:
                unfused += nbytes(n) + sum(nbytes(strip_views(a)) for a in n.all_input_nodes)
        fused = sum(nbytes(strip_views(a)) for a in self.external_inputs())
        fused += sum(nbytes(o) for o in self.outputs.values())
        return max(0, unfused - fused)

    def self_contained(self) -> bool:
        """True when only `outputs` are read outside the subgraph, so replacing the subgraph
        by one op cannot change any other value."""
        inside, keep = set(self.nodes), {*self.outputs.values(), *self.shared}
        return all(set(n.users) <= inside for n in self.nodes if n not in keep)


def _is_view(node: fx.Node) -> bool:
    return is_op(node, *VIEW_OPS) or (is_getitem(node) and is_op(node.args[0], *VIEW_OPS))


def with_shared_views(m: Match) -> Match:
    """`m` with its views that other nodes read too — a split or slice of an input, which
    merged repeated views (graph/cse.py) give two sites — counted as `shared`: a view
    launches nothing, and it stays for its other reader. Views of a value the site computes
    stay its own (the fused op does not produce that value)."""
    inside = set(m.nodes)

    def source(n: fx.Node) -> Any:
        while _is_view(n):
            n = n.args[0]
        return n

    keep = {*m.shared, *m.outputs.values()}
    extra = tuple(n for n in m.nodes if n not in keep and _is_view(n)
                  and any(u not in inside for u in n.users) and source(n) not in inside)
    return replace(m, shared=(*m.shared, *extra)) if extra else m


def module_of(nodes: Iterable[fx.Node]) -> str:
    for n in nodes:
        path = module_path(n)
        if path:
            return path
    return ""
