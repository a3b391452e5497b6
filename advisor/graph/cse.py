"""Common-subexpression elimination on a rewritten aten graph.

A `transformers` decoder recomputes per layer what is the same for every layer: at decode,
each attention layer turns the one boolean causal mask into an additive one
(`where(mask, 0.0, -inf)` plus two `scalar_tensor` fills) and adds `arange(1)` to the
cache position. Captured as aten ops, that is ~5 launches per layer for values computed
once — at a 2048-token context on the H200 about 50 µs of a 1.5 ms decode step
(benchmarks/NOTES.md, session 6). Inductor removes them with its own CSE; our runtime runs
the aten graph as it is, so this pass does it: an op with the same target, arguments and
keyword arguments as an earlier one is replaced by it. So is an op that returns its own
input: `x * 1` (transformers' RoPE tables times an attention scaling of 1.0) and, on
integers, `x + 0` (the mask's `arange + 0`) — a launch each per step for a copy.

Only ops whose schema says they are functional are merged: no argument written, not
random (`nondeterministic_seeded`). Mutations are honoured: an in-place op (or a custom op
that writes an argument, like `rope_qk_cache` writing the KV cache) invalidates every
recorded op that read the storage it writes, and a value whose storage is written anywhere
in the graph is never merged (two `empty`s later filled differently stay two). A call the
pass cannot see into (not an aten/custom `OpOverload`, nor `getitem`, nor size arithmetic
given no tensor) ends every record and counts as writing every tensor it is given. Values
that reach the graph's outputs (directly or as a view) are left alone, so a caller never
gets one storage for two outputs.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from advisor.graph.match import VIEW_OPS

_PURE_CALLABLES = {operator.getitem}


def _is_overload(node: fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)


def _arg_values(node: fx.Node) -> list[tuple[Any, Any]]:
    """(schema argument, value passed) for every schema argument given to an OpOverload."""
    out = []
    for i, arg in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            out.append((arg, node.args[i]))
        elif arg.name in node.kwargs:
            out.append((arg, node.kwargs[arg.name]))
    return out


def _nodes_in(value: Any) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    return []


def written_by(node: fx.Node) -> list[fx.Node] | None:
    """The nodes whose storage `node` writes; None when unknown (anything may be written)."""
    if node.op in ("placeholder", "output", "get_attr"):
        return []
    if node.op == "call_function" and node.target in _PURE_CALLABLES:
        return []
    if not _is_overload(node):
        return [] if _touches_no_tensor(node) else None
    return [n for arg, v in _arg_values(node)
            if arg.alias_info is not None and arg.alias_info.is_write for n in _nodes_in(v)]


def _touches_no_tensor(node: fx.Node) -> bool:
    """A call given no tensor, returning none: size arithmetic on SymInts (`operator.add`
    of a dynamic length) — which, taken for opaque, ended every record of the passes here
    under dynamic shapes."""
    def scalar(n: fx.Node) -> bool:
        return isinstance(n.meta.get("val", torch.empty(0)), (int, float, bool, torch.SymInt,
                                                              torch.SymFloat, torch.SymBool))
    return scalar(node) and all(scalar(n) for n in node.all_input_nodes)


def storage_bases(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node -> the node owning the storage it aliases (itself unless it is a view:
    a schema return that aliases an argument — `out=` included —, an op the matcher
    treats as a view (`_unsafe_view` has no alias annotation), or `getitem` of such a
    result)."""
    base: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        base[node] = node
        if node.op == "call_function" and node.target is operator.getitem:
            src = node.args[0]  # a piece of a split (a view) or of a multi-output op (fresh)
            if isinstance(src, fx.Node) and _aliased_arg(src) is not None:
                base[node] = base[src]
            continue
        alias = _aliased_arg(node)
        if alias is not None:
            base[node] = base.get(alias, alias)
    return base


_RESTRIDES = {torch.ops.aten.as_strided.default}


def view_chain(node: fx.Node, base: fx.Node) -> list[fx.Node] | None:
    """The views from `base` (its storage base, `storage_bases`) to `node`, in the order they
    run (`node` last; [] when `node` is `base`): each returns part of the one before. None
    where `node` is not reached from `base` through views alone."""
    chain = []
    while node is not base:
        src = node.args[0] if node.target is operator.getitem and node.args else _aliased_arg(node)
        # an in-place op or `out=` returns its argument too, and as_strided keeps the
        # captured strides whatever it reads: neither is a view to replay elsewhere
        if (not isinstance(src, fx.Node) or node.target in _RESTRIDES
                or (_is_overload(node) and node.target._schema.is_mutable)):
            return None
        chain.append(node)
        node = src
    return chain[::-1]


def _aliased_arg(node: fx.Node) -> fx.Node | None:
    """The argument node a view-like `node` returns (part of), else None."""
    if node.op != "call_function":
        return None
    if node.target in VIEW_OPS:
        first = node.args[0] if node.args else None
        return first if isinstance(first, fx.Node) else None
    if not _is_overload(node):
        return None
    sets = [r.alias_info.before_set for r in node.target._schema.returns if r.alias_info is not None]
    for arg, value in _arg_values(node):
        if arg.alias_info is not None and any(arg.alias_info.before_set & s for s in sets):
            hit = _nodes_in(value)
            if hit:
                return hit[0]
    return None


def _is_pure(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target in _PURE_CALLABLES:
        return True
    if not _is_overload(node):
        return False
    # is_mutable: some argument is written (`Tensor(a!)`)
    return not (torch.Tag.nondeterministic_seeded in node.target.tags or node.target._schema.is_mutable)


def written_storages(graph: fx.Graph, base: dict[fx.Node, fx.Node]) -> set[fx.Node]:
    """The storages (`storage_bases`) some node of `graph` writes; an opaque call counts as
    writing every tensor it is given."""
    out: set[fx.Node] = set()
    for node in graph.nodes:
        written = written_by(node)
        if written is None:
            written = _nodes_in([*node.args, *node.kwargs.values()])
        out.update(base.get(w, w) for w in written)
    return out


def escaping_storages(graph: fx.Graph, base: dict[fx.Node, fx.Node]) -> set[fx.Node]:
    """The storages the caller receives: a graph output's, or that of what it is a view of."""
    output = next(n for n in graph.nodes if n.op == "output")
    return {base.get(n, n) for n in _nodes_in(output.args)}


_TIMES_ONE = {torch.ops.aten.mul.Tensor, torch.ops.aten.mul.Scalar}
_PLUS_ZERO = {torch.ops.aten.add.Tensor, torch.ops.aten.add.Scalar,
              torch.ops.aten.sub.Tensor, torch.ops.aten.sub.Scalar}


def _identity_input(node: fx.Node) -> fx.Node | None:
    """x when `node` computes x * 1, 1 * x, or x + 0 / x - 0 on an integer x, with x's dtype
    and shape (no promotion, no broadcast): a copy of x. Float `x + 0` is not one
    (-0.0 + 0 = +0.0)."""
    if node.op != "call_function" or node.target not in _TIMES_ONE | _PLUS_ZERO or len(node.args) != 2:
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    pairs = [node.args] if node.target in _PLUS_ZERO else [node.args, node.args[::-1]]
    for x, c in pairs:
        if not isinstance(x, fx.Node) or isinstance(c, bool) or not isinstance(c, (int, float)):
            continue
        tx, ty = x.meta.get("val"), node.meta.get("val")
        if not (isinstance(tx, torch.Tensor) and isinstance(ty, torch.Tensor)
                and tx.dtype == ty.dtype and tx.shape == ty.shape):
            continue
        if (node.target in _TIMES_ONE and c == 1) or (c == 0 and not tx.dtype.is_floating_point
                                                     and not tx.dtype.is_complex):
            return x
    return None


def _key(value: Any) -> Any:
    """A hashable stand-in for an argument; floats by their bits (0.0 ≠ -0.0, NaN = NaN)."""
    if isinstance(value, fx.Node):
        return ("node", id(value))
    if isinstance(value, float):
        return ("float", math.copysign(1.0, value), repr(value))
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple(sorted((k, _key(v)) for k, v in value.items())))
    if isinstance(value, (bool, int, str, type(None), torch.dtype, torch.device, torch.layout,
                          torch.memory_format)):
        return (type(value).__name__, value)
    raise TypeError  # unhashable or unknown argument: not merged


def eliminate_common_subexpressions(gm: fx.GraphModule,
                                    only: Callable[[fx.Node], bool] | None = None) -> int:
    """Merge repeated functional ops in `gm` (in place), those `only` accepts when given;
    returns how many nodes were removed. Recompiles `gm` when it changed."""
    graph = gm.graph
    base = storage_bases(graph)
    ever_written = written_storages(graph, base)
    escaping = escaping_storages(graph, base)  # two such must stay two
    seen: dict[Any, fx.Node] = {}
    reads: dict[Any, set[fx.Node]] = {}  # key -> storages its inputs alias
    removed = 0
    for node in list(graph.nodes):
        written = written_by(node)
        if written is None:  # opaque: forget everything
            seen.clear()
            reads.clear()
            continue
        if written:
            hit = {base.get(w, w) for w in written}
            for key in [k for k, r in reads.items() if r & hit]:
                del seen[key], reads[key]
            continue
        if not _is_pure(node) or base[node] in escaping or base[node] in ever_written:
            continue
        if only is not None and not only(node):
            continue
        same = _identity_input(node)
        if same is not None and base.get(same, same) not in ever_written:  # x is x all along
            node.replace_all_uses_with(same)
            graph.erase_node(node)
            removed += 1
            continue
        try:
            key = (node.target, _key(node.args), _key(dict(node.kwargs)))
        except TypeError:
            continue
        earlier = seen.get(key)
        if earlier is not None:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            removed += 1
            continue
        seen[key] = node
        reads[key] = {base.get(n, n) for n in _nodes_in(list(node.args) + list(node.kwargs.values()))}
        reads[key].add(base[node])
    if removed:
        graph.lint()
        gm.recompile()
    return removed


def merge_repeated_tables(gm: fx.GraphModule, params: Mapping[str, str]) -> int:
    """Before matching, merge repeats of what no weight goes into — positions, masks, RoPE
    tables (`params`: the placeholders that are weights) — and views taken twice (no launch
    either way). A RoPE written as a function called for q and for k that prepares its
    tables inside (GPT-J's `repeat_interleave` of sin and cos; `cos.unsqueeze(1)` per call)
    reads one value through two nodes, and q and k are paired by the cos/sin nodes they
    read (patterns/rope.py). Activations are left to the pass after the rewrite: merging
    them could give two sites one node. Returns how many nodes were removed."""
    weighted: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if _is_weight(node, params) or any(a in weighted for a in node.all_input_nodes):
            weighted.add(node)
    return eliminate_common_subexpressions(gm, only=lambda n: n.target in VIEW_OPS or n not in weighted)


# op -> the argument that is its weight (a GEMM's right-hand side, an embedding table)
_WEIGHT_ARG = {torch.ops.aten.mm.default: 1, torch.ops.aten.addmm.default: 2,
               torch.ops.aten.bmm.default: 1, torch.ops.aten.embedding.default: 0,
               torch.ops.aten.convolution.default: 1}


def _is_weight(node: fx.Node, params: Mapping[str, str]) -> bool:
    """A parameter or buffer of >= 2 dims that a GEMM reads as its weight or an embedding
    as its table (through views). RoPE's `inv_freq` (1-D, a bmm's left operand in
    `transformers`' outer product) and GPT-J's `embed_positions` (indexed) are not."""
    val = node.meta.get("val")
    if node.op != "placeholder" or node.name not in params or not (
            isinstance(val, torch.Tensor) and val.dim() >= 2):
        return False
    work = [(node, user) for user in node.users]
    while work:
        src, user = work.pop()
        arg = _WEIGHT_ARG.get(user.target)
        if arg is not None and len(user.args) > arg and user.args[arg] is src:
            return True
        if user.target in VIEW_OPS:
            work.extend((user, u) for u in user.users)
    return False
