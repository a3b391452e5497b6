"""Compute once what a graph derives from sizes alone: shape-only subgraphs, memoised.

A `transformers` decoder builds its causal mask from sizes: at prefill, the packed-sequence
mask is `arange`, `sub`, `cat`, `ne`, `cumsum`, `new_ones`, four `index`es, `le`, two
`bitwise_and`s, `eq`, `where` and two `scalar_tensor`s — ~17 launches at the start of every
forward whose values depend only on the sequence length (benchmarks/NOTES.md, session 11;
in decode, removing 5 such launches gained ~50 µs of a 1.5 ms step, session 6). Inductor
constant-folds part of this; our runtime runs the aten graph as it is, so this pass does it:

  shape-only node  a functional aten op (no argument written, not random, not an
                   uninitialised allocation) with a tensor value, whose inputs are all
                   shape-only nodes, graph constants (`get_attr`) or integers (SymInt
                   placeholders, `sym_size`, SymInt arithmetic);
  frontier         shape-only nodes read by a node that is not shape-only.

The shape-only region is cut out into a small graph of its own, with the integers it reads
as inputs and the frontier as outputs, and replaced by one call of a `ShapeMemo`: the first
call with given integer values runs the graph and keeps the outputs; later calls return
the kept tensors — zero launches. A kept output whose values are the causal mask is marked
(kernels/masks.py) so that attention reads it as `causal=True`.

Kept values must never change, so a node whose storage anything in the graph writes (by
base: a view written in place counts) is not shape-only, nor is one the graph returns (the
caller may write it). Memoised tensors live as long as the graph: a CUDA graph captured on
them reads their addresses, so they are never evicted; a byte budget and a key count bound
what is kept (past them, values are recomputed each call), and nothing is kept while a
CUDA graph is being captured (the memo's own first run would then be part of the capture).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from advisor.graph.capture import hint
from advisor.graph.cse import _is_pure, _nodes_in, storage_bases, written_by
from advisor.graph.match import launches
from advisor.kernels.masks import mark_if_causal

aten = torch.ops.aten

# Allocations whose values are undefined until written: never "the same" on a later call.
_UNINITIALISED = {
    aten.empty.memory_format, aten.empty_like.default, aten.new_empty.default,
    aten.empty_strided.default, aten.new_empty_strided.default,
}
_INT_TYPES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)

MEMO_BYTES = 256 << 20  # per memo: a 8192-token bool mask is 64 MiB
MEMO_KEYS = 64  # distinct integer tuples kept per memo (lengths of one bucket)


class ShapeMemo:
    """`fn(*ints)` -> tuple of tensors, computed once per tuple of integer values."""

    LAUNCHES_PER_CALL = 0  # graph.match.launches: a memo hit issues no kernel

    def __init__(self, fn: Callable[..., Any], n_outputs: int, launches_saved: int,
                 max_bytes: int = MEMO_BYTES, max_keys: int = MEMO_KEYS) -> None:
        self.fn, self.n_outputs, self.launches_saved = fn, n_outputs, launches_saved
        self.max_bytes, self.max_keys = max_bytes, max_keys
        self.values: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.bytes = 0
        self.__name__ = "advisor_shape_memo"

    def __call__(self, *ints: Any) -> tuple[torch.Tensor, ...]:
        key = tuple(ints)
        hit = self.values.get(key)
        if hit is not None:
            return hit
        out = tuple(self.fn(*ints))
        size = sum(t.untyped_storage().nbytes() for t in out)
        if (len(self.values) < self.max_keys and self.bytes + size <= self.max_bytes
                and not _capturing(out)):
            if any(t.is_cuda for t in out):
                # Kept values are read from any stream later (a CUDA graph's capture
                # stream): they must be complete before anyone else reads them.
                torch.cuda.current_stream().synchronize()
            for t in out:  # a causal mask, kept: its readers may take `causal=True` instead
                mark_if_causal(t)
            self.values[key] = out
            self.bytes += size
        return out

    def __repr__(self) -> str:
        return f"ShapeMemo(outputs={self.n_outputs}, launches={self.launches_saved}, kept={len(self.values)})"


def _capturing(out: tuple[torch.Tensor, ...]) -> bool:
    return any(t.is_cuda for t in out) and torch.cuda.is_current_stream_capturing()


def _is_int_like(node: fx.Node) -> bool:
    return isinstance(node.meta.get("val"), _INT_TYPES)


def shape_only_region(graph: fx.Graph) -> dict[fx.Node, None]:
    """The shape-only nodes (module docstring), in graph order; get_attr constants included
    when they are read only as shape-only inputs' sources (they launch nothing)."""
    base = storage_bases(graph)
    written: set[fx.Node] = set()
    for node in graph.nodes:
        w = written_by(node)
        if w is None:  # opaque call: anything it is given may be written
            w = _nodes_in([*node.args, *node.kwargs.values()])
        written |= {base.get(n, n) for n in w}
    output = next(n for n in graph.nodes if n.op == "output")
    escaping = {base.get(n, n) for n in _nodes_in(output.args)}
    region: dict[fx.Node, None] = {}
    for node in graph.nodes:
        if base[node] in written or base[node] in escaping:
            continue
        if node.op == "get_attr":
            if isinstance(getattr_path(graph, node.target), torch.Tensor):
                region[node] = None
            continue
        if not _is_pure(node) or node.target in _UNINITIALISED or not _tensor_valued(node):
            continue
        if all(a in region or _is_int_like(a) for a in node.all_input_nodes):
            region[node] = None
    return region


def _tensor_valued(node: fx.Node) -> bool:
    """A tensor, or a tuple of tensors read only by `getitem` (a fused op returning
    (cos, sin), `aten.max.dim`): the tuple's items are then region nodes of their own, so
    a fused site derived from sizes alone is kept as its unfused ops are."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return True
    return (isinstance(val, (tuple, list)) and bool(val)
            and all(isinstance(v, torch.Tensor) for v in val)
            and all(u.op == "call_function" and u.target is operator.getitem for u in node.users))


def _cut(region: dict[fx.Node, None],
         outputs: list[fx.Node]) -> tuple[list[fx.Node], list[fx.Node], fx.Graph]:
    """What `outputs` need of the region (a region node nothing they read is dead), in
    graph order; the integer nodes those read; and a graph of them taking the integers as
    placeholders and returning `outputs` (a tuple)."""
    needed: dict[fx.Node, None] = {}
    work = list(outputs)
    while work:
        n = work.pop()
        if n in needed or n not in region:
            continue
        needed[n] = None
        work.extend(n.all_input_nodes)
    order = {n: i for i, n in enumerate(outputs[0].graph.nodes)}
    nodes = sorted(needed, key=order.__getitem__)
    ints = sorted({a for n in nodes for a in n.all_input_nodes if a not in needed}, key=order.__getitem__)
    sub, env = fx.Graph(), {}
    for a in ints:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for n in nodes:
        env[n] = sub.node_copy(n, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    return nodes, ints, sub


def shape_only_value(node: fx.Node, region: dict[fx.Node, None] | None = None) -> torch.Tensor | None:
    """The value a shape-only node (module docstring) has at the sizes its graph was traced
    at, computed now, outside any fake mode; None for any other node. Marked when it is the
    causal mask and the runtime would keep it (a memo keeps at most MEMO_BYTES), as a kept
    value is. `region`: the graph's `shape_only_region`, when the caller has it."""
    graph = node.graph
    region = shape_only_region(graph) if region is None else region
    if node not in region or node.op == "get_attr":
        return None
    _, ints, sub = _cut(region, [node])
    (value,) = fx.GraphModule(graph.owning_module, sub)(*(_concrete(a.meta["val"]) for a in ints))
    if value.untyped_storage().nbytes() <= MEMO_BYTES:
        mark_if_causal(value)
    return value


def shape_only_key(node: fx.Node, region: dict[fx.Node, None], memo: dict[fx.Node, Any]) -> Any:
    """What a shape-only node computes, as a hashable structure (op, then its arguments'
    keys; anything outside the region by name): two nodes built alike (a decoder's per-layer
    copies of one causal mask) share a key, a mask built differently (a sliding window)
    does not. `memo` caches the keys of a graph's nodes."""
    if node in memo:
        return memo[node]
    if node not in region or node.op == "get_attr":
        key: Any = ("input", node.name)
    else:
        def of(v: Any) -> Any:
            if isinstance(v, fx.Node):
                return shape_only_key(v, region, memo)
            if isinstance(v, (list, tuple)):
                return tuple(of(x) for x in v)
            return repr(v)
        key = (str(node.target), of(node.args), tuple(sorted((k, of(v)) for k, v in node.kwargs.items())))
    memo[node] = key
    return key


def _concrete(v: Any) -> Any:
    """A symbolic scalar's example value (an int stays an int, a float a float)."""
    if isinstance(v, torch.SymInt):
        return hint(v)
    return v.node.hint if isinstance(v, (torch.SymFloat, torch.SymBool)) else v


def getattr_path(graph: fx.Graph, target: str) -> Any:
    obj: Any = graph.owning_module
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return obj


@dataclass(frozen=True)
class _Memo:
    """What `memoize_shape_only` cuts out: the region's nodes the frontier needs, the
    integers they read, the frontier, its sub-graph, the launches saved, and the node
    before which the memo's call goes."""

    nodes: list[fx.Node]
    ints: list[fx.Node]
    frontier: list[fx.Node]
    sub: fx.Graph
    saved: int
    first_user: fx.Node
    hoist: list[fx.Node]  # integer arithmetic after first_user that the memo reads: moved before it


def _memo_of(graph: fx.Graph, region: dict[fx.Node, None]) -> _Memo | None:
    """The memo `memoize_shape_only` would build, or None where it builds none."""
    frontier = [n for n in region if n.op != "get_attr" and isinstance(n.meta.get("val"), torch.Tensor)
                and any(u not in region for u in n.users)]
    if not frontier:
        return None
    nodes, ints, sub = _cut(region, frontier)
    saved = sum(launches(n) for n in nodes if n.op == "call_function")
    if saved == 0:
        return None
    order = {n: i for i, n in enumerate(graph.nodes)}
    needed = set(nodes)
    first_user = min((u for n in frontier for u in n.users if u not in needed),
                     key=order.__getitem__)
    hoist = _late_integers(ints, first_user, order)
    if hoist is None:
        return None  # an integer read of a tensor computed after a frontier value is first read
    return _Memo(nodes, ints, frontier, sub, saved, first_user, hoist)


def _late_integers(ints: list[fx.Node], first_user: fx.Node,
                   order: dict[fx.Node, int]) -> list[fx.Node] | None:
    """The integer nodes at or after `first_user` that `ints` need (GPT-2: `T + past`, traced
    after the position embedding reads the memo's first output), in graph order, when all
    of them are integer arithmetic on placeholders and earlier nodes (pure, so they may move
    up); None where one reads anything else."""
    late: dict[fx.Node, None] = {}
    work = [a for a in ints if order[a] >= order[first_user]]
    while work:
        n = work.pop()
        if n in late:
            continue
        if n.op != "call_function" or not _is_int_like(n) or not (
                _is_pure(n) or getattr(n.target, "__module__", None) in ("_operator", "operator")):
            return None  # a Python operator on sizes (`T + past`) computes nothing else
        late[n] = None
        work += [a for a in n.all_input_nodes if order[a] >= order[first_user]]
    return sorted(late, key=order.__getitem__)


def memoized_region(graph: fx.Graph) -> dict[fx.Node, None]:
    """The shape-only nodes the runtime computes once per length (`memoize_shape_only`):
    the region, or nothing where it builds no memo or its outputs together are past the
    byte budget (then `ShapeMemo` keeps none of them and they are recomputed each call)."""
    region = shape_only_region(graph)
    memo = _memo_of(graph, region)
    if memo is None or sum(_storage_bytes(n) for n in memo.frontier) > MEMO_BYTES:
        return {}
    return {n: None for n in memo.nodes}


def _storage_bytes(node: fx.Node) -> int:
    """What keeping the node's value holds (its storage: an expanded view is its base)."""
    t = node.meta.get("val")
    return hint(t.untyped_storage().nbytes()) if isinstance(t, torch.Tensor) else 0


def memoize_shape_only(gm: fx.GraphModule) -> int:
    """Replace `gm`'s shape-only region by one `ShapeMemo` call (in place); returns the
    launches it takes off every call after the first (0: nothing changed)."""
    graph = gm.graph
    cut = _memo_of(graph, shape_only_region(graph))
    if cut is None:
        return 0
    nodes, ints, frontier, first_user = cut.nodes, cut.ints, cut.frontier, cut.first_user
    for n in cut.hoist:  # in graph order: each after what it reads
        first_user.prepend(n)
    needed = set(nodes)
    memo = ShapeMemo(fx.GraphModule(gm, cut.sub), len(frontier), cut.saved)
    with graph.inserting_before(first_user):
        call = graph.call_function(memo, tuple(ints))
        call.meta["val"] = tuple(n.meta["val"] for n in frontier)
        for i, n in enumerate(frontier):
            got = graph.call_function(operator.getitem, (call, i))
            got.meta = dict(n.meta)
            n.replace_all_uses_with(got, delete_user_cb=lambda u: u not in needed)
    for n in reversed(nodes):
        if not n.users:
            graph.erase_node(n)
    graph.lint()
    gm.recompile()
    return cut.saved
