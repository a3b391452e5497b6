"""Large outputs computed after a CUDA-graph replay into fresh memory, instead of cloned.

A replayed graph writes its outputs into static buffers, so `cudagraph.py` clones each one
out: a later replay would overwrite what the caller holds. For a prefill's logits that
copy is as large as a GEMM's worth of traffic: (T, vocab) bf16 at T = 512 and a 128256
vocabulary is 131 MB written, then read and written again by the clone (~87 µs of an H100
at 3.0 TB/s; ~350 µs at T = 2048). torch.compile's reduce-overhead mode pays nothing there:
it hands out its static buffers (and fails a later read of an overwritten one).

Here the op producing such an output (a matmul, or one of our kernels with a single
fresh output: the final norm fused into lm_head; with the views after it) is cut out of
the captured graph. `move_large_outputs(gm)` replaces the chain by one call of a small graph
module of its own (`outside_graph`). Outside a capture that call just runs the chain.
While `GraphCache` captures (`Deferred.active`), it records the chain, its inputs (tensors
the graph keeps writing on every replay) and returns a placeholder of the output's layout
instead of recording any kernel. After each replay `Deferred.resolve` runs the chain
eagerly into memory the caller owns: no copy, one launch outside the graph, whose host
time overlaps the replay's GPU work.

A placeholder must only ever reach the caller, and a cut op must read what it read in the
graph. So a chain whose inputs the graph writes later (a trailing `copy_` into an input)
is never cut, and a capture is redone without cutting unless it is `sound`: every
placeholder came back in the outputs, one rewritten graph ran, and every output is that
graph's or an input (a graph break, or eager code after the graph, could have read one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch.utils._pytree import tree_flatten, tree_map

from advisor.graph.capture import nbytes

aten = torch.ops.aten

# Outputs of at least this many bytes (at the trace's example length) are computed outside
# the graph. The clone it saves costs 2·bytes of traffic (2.8 µs for 4 MiB at 3 TB/s),
# about what an eager launch queued behind a replay costs; below it (a decode step's
# (1, vocab) logits: 256 KB) the kernel stays in the graph, under PDL with its neighbours.
MIN_BYTES = 4 << 20

MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
           aten.matmul.default, aten.linear.default}


def _producer(node: fx.Node) -> bool:
    """An op whose one result is fresh memory it writes whole, with no other effect: a
    matmul, or an `advisor::` kernel returning a single tensor and writing no argument
    (their fake implementations give the layout on the meta device)."""
    target = node.target
    if target in MATMULS:
        return True
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "advisor":
        return False
    schema = target._schema
    return len(schema.returns) == 1 and not any(
        a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


# Views after the producer (the slice: a fused op's column block of its result).
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.t.default,
         aten.transpose.int, aten.permute.default, aten.unsqueeze.default, aten.squeeze.dim,
         aten.squeeze.default, aten.alias.default, aten.slice.Tensor}


def _storages(tree: Any) -> set[int]:
    """Addresses of the storages of the tensors in a pytree."""
    return {t.untyped_storage().data_ptr() for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor)}


def _layout(t: torch.Tensor) -> tuple:
    return t.size(), t.stride(), t.storage_offset()


def _empty_laid_out(like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """An uninitialised tensor with `like`'s dtype and layout in a storage of its size (a
    slice keeps its offset into it)."""
    storage = torch.empty(like.untyped_storage().nbytes() // like.element_size(),
                          dtype=like.dtype, device=device)
    return storage.as_strided(*_layout(like))


@dataclass
class _Cut:
    """One chain cut out of a capture: its graph module, the graph-owned tensors it reads
    (rewritten by every replay) and the placeholder handed back in its place."""

    sub: fx.GraphModule
    inputs: tuple[Any, ...]
    placeholder: torch.Tensor


@dataclass
class Deferred:
    """What one CUDA-graph capture left to run after each replay."""

    cuts: list[_Cut] = field(default_factory=list)
    graphs_entered: int = 0
    returned: set[int] = field(default_factory=set)  # storages the rewritten graphs returned

    @contextmanager
    def active(self) -> Iterator[Deferred]:
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)

    def sound(self, out: Any, inputs: list[Any] = ()) -> bool:
        """Whether every placeholder reached the outputs and nothing else could read one:
        a single rewritten graph ran, each placeholder's storage is among `out`'s, and
        every tensor of `out` is one that graph returned or an input (a tensor made by
        eager code after the graph, e.g. a function dynamo skips, could have read a
        placeholder)."""
        if not self.cuts:
            return True
        storages = _storages(out)
        return self.graphs_entered == 1 and storages <= self.returned | _storages(list(inputs)) and all(
            c.placeholder.untyped_storage().data_ptr() in storages for c in self.cuts)

    def resolve(self, out: Any) -> Any:
        """`out` (the captured outputs, just replayed) with each placeholder, or a view of
        one, replaced by its chain's fresh result; every other tensor cloned out."""
        by_ptr = {c.placeholder.untyped_storage().data_ptr(): c for c in self.cuts}
        fresh: dict[int, torch.Tensor] = {}

        def leaf(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            ptr = t.untyped_storage().data_ptr()
            cut = by_ptr.get(ptr)
            if cut is None:
                return t.clone()
            if ptr not in fresh:
                fresh[ptr] = _laid_out_as(cut.sub(*cut.inputs), cut.placeholder)
            f = fresh[ptr]
            return f if _layout(t) == _layout(f) else f.as_strided(*_layout(t))

        return tree_map(leaf, out)


_ACTIVE: ContextVar[Deferred | None] = ContextVar("advisor_outside_graph", default=None)


def entered(forward: Callable[..., Any]) -> Callable[..., Any]:
    """`forward` (a rewritten graph's) counting its runs inside an active capture."""

    def call(*args: Any) -> Any:
        active = _ACTIVE.get()
        if active is None:
            return forward(*args)
        active.graphs_entered += 1
        result = forward(*args)
        active.returned |= _storages(result)
        return result

    return call


def _laid_out_as(fresh: torch.Tensor, placeholder: torch.Tensor) -> torch.Tensor:
    """`fresh` itself when it has the placeholder's layout (the fake implementation's, as
    it should); else a copy laid out so (a kernel whose fake layout is off costs a copy,
    never a wrong view)."""
    if _layout(fresh) == _layout(placeholder):
        return fresh
    return _empty_laid_out(placeholder, fresh.device).copy_(fresh)


def _meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device="meta")
    return x


def outside_graph(sub: fx.GraphModule) -> Callable[..., Any]:
    """The call replacing a cut chain: runs it, or inside a capture records it (above)."""

    def call(*inputs: Any) -> Any:
        active = _ACTIVE.get()
        if active is None:
            return sub(*inputs)
        like = sub(*[_meta(x) for x in inputs])  # the output's layout, no kernel
        device = next(x.device for x in inputs if isinstance(x, torch.Tensor))
        placeholder = _empty_laid_out(like, device)  # as the fresh result will be laid out
        active.cuts.append(_Cut(sub, inputs, placeholder))
        return placeholder

    call.__name__ = "advisor_outside_graph"
    return call


def _chain(out: fx.Node, output_node: fx.Node) -> list[fx.Node] | None:
    """[producer, views...] ending at graph output `out`, each node used only by the next
    (the last only by the output node); None when `out` is not such a chain."""
    chain, node, user = [], out, output_node
    while True:
        if node.op != "call_function" or set(node.users) != {user}:
            return None
        chain.append(node)
        if _producer(node):
            return chain[::-1]
        if node.target not in VIEWS or not isinstance(node.args[0], fx.Node):
            return None
        node, user = node.args[0], node


def _base(node: Any) -> Any:
    """The node whose memory `node` views (through ops returning an alias of their first
    argument), or `node` itself."""
    while (isinstance(node, fx.Node) and node.op == "call_function"
           and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.returns
           and node.target._schema.returns[0].alias_info is not None
           and not node.target._schema.returns[0].alias_info.is_write and node.args):
        node = node.args[0]
    return node


def _written(graph: fx.Graph) -> set[fx.Node]:
    """Nodes (view bases) whose memory some op of the graph writes in place: a KV cache's
    scatter, a trailing `copy_` of an input, a kernel writing its arguments."""
    out = set()
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        schema = node.target._schema
        for i, a in enumerate(schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                value = node.args[i] if i < len(node.args) else node.kwargs.get(a.name)
                for v in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(v, fx.Node):
                        out.add(_base(v))
    return out


def _extract(chain: list[fx.Node]) -> tuple[fx.GraphModule, list[fx.Node]]:
    """The chain as a graph module of its own; returns it and the outer nodes it reads."""
    graph, env, outer = fx.Graph(), {}, []

    def arg(a: fx.Node) -> fx.Node:
        if a not in env:
            outer.append(a)
            env[a] = graph.placeholder(f"in_{len(outer)}")
        return env[a]

    for node in chain:
        env[node] = graph.node_copy(node, arg)
    graph.output(env[chain[-1]])
    return fx.GraphModule(torch.nn.Module(), graph), outer


def move_large_outputs(gm: fx.GraphModule, min_bytes: int | None = None) -> int:
    """Cut every graph output made by a producer (+ views) of >= min_bytes out of CUDA-graph
    captures (see the module docstring); returns how many. Rewrites `gm` in place (before
    `use_direct_calls`: custom-op nodes are still `torch.ops.advisor.*`)."""
    min_bytes = MIN_BYTES if min_bytes is None else min_bytes
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    outs = [a for a in tree_flatten(output_node.args)[0] if isinstance(a, fx.Node)]
    written = _written(gm.graph)
    moved = 0
    for out in dict.fromkeys(outs):
        chain = _chain(out, output_node)
        if chain is None or nbytes(chain[0]) < min_bytes:
            continue
        sub, outer = _extract(chain)
        if any(_base(a) in written for a in outer):  # run after the replay, it would read
            continue  # what the graph wrote there later, not what the chain read
        with gm.graph.inserting_before(out):
            call = gm.graph.call_function(outside_graph(sub), tuple(outer))
        call.meta.update(out.meta)
        out.replace_all_uses_with(call)
        for node in reversed(chain):
            gm.graph.erase_node(node)
        moved += 1
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved
