"""Copies that change nothing: dropped before matching, and seen through by the patterns.

Two spellings of "the same values again" cost a launch and a full read and write of an
activation each, and stand between ops the patterns fuse:

- `nn.Dropout` in eval mode traces to `clone(x)`. Phi-3 has one after o_proj and one after
  down_proj, between each GEMM and its residual add, so `linear_residual` and the add+norm
  fusions downstream did not match (4 launches per layer of a tiny Phi-3, session 25).
- Partial rotary written for any rotary width, `cat(rope(x[..., :r]), x[..., r:])`, keeps
  its cat when r is the whole head dim and the pass-through part is empty (Phi-3's default).
  The cat is then a copy of the rotation, and stood between the RoPE and the attention
  that reads it, so `attention_rope` did not match.

- Functionalised in-place ops reshape to (B·T, N) and back (`F.silu(g, inplace=True)`):
  view(view(x, (B·T, N)), (B, T, N)) holds x's values again.

`copied_value` names them. `drop_identity_copies` removes those whose result also has its
input's layout (dtype, sizes, strides): readers cannot tell them apart. `through_copies`
lets a pattern look through the others (a cat's result is contiguous where the rotation it
copies is not) when the fused kernel does not care about its operand's layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from advisor.graph.capture import fake
from advisor.graph.cse import escaping_storages, storage_bases, written_storages
from advisor.graph.dce import settle
from advisor.graph.match import RESHAPE_OPS, aten, is_op, known, same_sizes


def _empty(node: Any) -> bool:
    t = fake(node)
    return t is not None and known(t.numel() == 0)


def copied_value(node: Any) -> fx.Node | None:
    """The node whose values `node` reproduces unchanged (same dtype and sizes; the
    layout may differ): `clone(x)` and `cat` of x with operands that are all empty."""
    out = fake(node)
    if out is None:
        return None
    src = None
    if is_op(node, aten.clone.default) and set(node.kwargs) <= {"memory_format"}:
        src = node.args[0]
    elif is_op(node, aten.cat.default) and isinstance(node.args[0], (list, tuple)):
        full = [t for t in node.args[0] if not _empty(t)]
        src = full[0] if len(full) == 1 else None
    elif is_op(node, *RESHAPE_OPS):
        src = _reshaped_back(node, out)
    t = fake(src)
    if not isinstance(src, fx.Node) or t is None or t.dtype != out.dtype or not same_sizes(t, out):
        return None
    return src


def _reshaped_back(node: fx.Node, out: torch.Tensor) -> Any:
    """The value a chain of reshapes ending at `node` started from where it has node's
    sizes again (a reshape keeps row order: the same values). Functionalised in-place ops
    leave such round trips: `F.silu(g, inplace=True); g.mul_(u)` on (B, T, N) reads
    view(view(silu, (B·T, N)), (B, T, N)), which stood between the activation's ops."""
    cur = node.args[0]
    while isinstance(cur, fx.Node):
        t = fake(cur)
        if t is not None and same_sizes(t, out):
            return cur
        if not is_op(cur, *RESHAPE_OPS):
            return None
        cur = cur.args[0]
    return None


def through_copies(node: Any) -> tuple[Any, list[fx.Node]]:
    """(the value `node` is a copy of, the copies in the order they run) walking back
    through `copied_value`s that each have one reader; (node, []) when it is no copy."""
    copies: list[fx.Node] = []
    while isinstance(node, fx.Node) and len(node.users) == 1 and (src := copied_value(node)) is not None:
        copies.append(node)
        node = src
    return node, copies[::-1]


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same strides wherever a dim may hold more than one element, and the same storage
    offset (a copy starts at 0): every address a reader forms — `as_strided` too — reads
    the same element in either."""
    return same_sizes(a, b) and known(a.storage_offset() == b.storage_offset()) and all(
        known(size == 1) or known(sa == sb) for size, sa, sb in zip(a.shape, a.stride(), b.stride()))


def is_full_slice(node: Any) -> bool:
    """x[:, ...] spelled out, step 1 to the end: a view of all of x (dynamic-shape traces
    keep these; a static trace folds them)."""
    if not is_op(node, aten.slice.Tensor):
        return False
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (0, None) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62))


def drop_full_slices(gm: fx.GraphModule) -> int:
    """Read x where a full slice of x was read (one value; patterns compare operands by
    node): GPT-J's `q[:, :, :, :rotary_dim]` traced with dynamic shapes is a full slice of
    dim 1 too, so its RoPE read x through two nodes and was not matched. A slice the caller
    receives is kept (it must not be the input itself). Returns how many."""
    escaping = escaping_storages(gm.graph, {})

    def source(node: fx.Node) -> fx.Node | None:
        full = is_full_slice(node) and node not in escaping and isinstance(node.args[0], fx.Node)
        return node.args[0] if full else None
    return _replace_each(gm, source)


def _replace_each(gm: fx.GraphModule, source: Callable[[fx.Node], fx.Node | None]) -> int:
    """Read `source(node)` wherever a node it names one for was read; returns how many."""
    removed = 0
    for node in list(gm.graph.nodes):
        src = source(node)
        if src is not None:
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            removed += 1
    return settle(gm, removed)  # and what only the dropped copies read (a round trip's first view)


def drop_identity_copies(gm: fx.GraphModule) -> int:
    """Replace each copy whose result has its input's layout by its input; returns how many.
    Kept: a copy the caller receives (it must not alias another output or an input), and
    one whose input or result is written in place somewhere in the graph (a KV cache)."""
    base = storage_bases(gm.graph)
    written = written_storages(gm.graph, base)
    escaping = escaping_storages(gm.graph, base)

    def source(node: fx.Node) -> fx.Node | None:
        src = copied_value(node)
        if src is None or not _same_layout(fake(src), fake(node)):
            return None
        if base[node] in escaping or base[node] in written or base.get(src, src) in written:
            return None
        return src
    return _replace_each(gm, source)
