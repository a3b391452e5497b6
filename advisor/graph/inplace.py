"""Write mutated graph inputs in place again (a KV cache updated by `index_copy_`).

AOTAutograd functionalizes a forward before we see it: `k_cache.index_copy_(2, pos, k)`
becomes `new = index_copy(k_cache, 2, pos, k)` — a fresh copy of the whole cache — and a
trailing `copy_(k_cache, new)` writes it back (kept in the graph with
`keep_inference_input_mutations`). At decode that is two full passes over every layer's
cache per step for a one-token write: for the reference model at a 2048-token context
(4096 slots, 8 layers, k and v, bf16) 128 MiB copied twice, ~0.12 ms on the H200 against a
1.07 ms weight-read floor. torch.compile's inductor undoes it with its re-inplacing pass;
this is ours, for the scatter ops a cache update lowers to.

A write is put back in place only when nothing reads the old cache after it: every other
reader of the input (through views) comes earlier in the graph, shape queries aside.
"""

from __future__ import annotations

import torch
from torch import fx

from advisor.graph.capture import fake
from advisor.graph.cse import written_by
from advisor.graph.match import VIEW_OPS, aten, is_getitem, is_op, strip_views

# functional scatter -> its in-place form (same arguments, returns its first argument)
IN_PLACE = {
    aten.index_copy.default: aten.index_copy_.default,
    aten.index_put.default: aten.index_put_.default,
}
_SHAPE_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default,
                  aten.sym_storage_offset.default}


def _reads_after(src: fx.Node, pos: int, order: dict[fx.Node, int], skip: set[fx.Node]) -> bool:
    """Some op other than `skip` reads `src` (directly or through views) after `pos`."""
    for user in src.users:
        if user in skip or is_op(user, *_SHAPE_QUERIES):
            continue
        if is_op(user, *VIEW_OPS) or is_getitem(user):  # a split's pieces: views too
            if _reads_after(user, pos, order, skip):
                return True
        elif order.get(user, len(order)) > pos:  # a node inserted by this pass: after
            return True
    return False


def write_inputs_in_place(gm: fx.GraphModule) -> int:
    """Turn each `copy_(input, scatter(input, ...))` into `scatter_(input, ...)`; returns how
    many writes were put back in place. Mutates and recompiles `gm`."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    done = 0
    for copy in [n for n in gm.graph.nodes if is_op(n, aten.copy_.default)]:
        dst, new = copy.args[0], copy.args[1]
        if dst.op != "placeholder" or copy.kwargs or not is_op(new, *IN_PLACE):
            continue
        if new.args[0] is not dst:
            continue
        if _reads_after(dst, order[new], order, skip={new, copy}):
            continue
        with gm.graph.inserting_before(new):
            write = gm.graph.call_function(IN_PLACE[new.target], new.args, new.kwargs)
        write.meta = dict(new.meta)
        new.replace_all_uses_with(write)
        gm.graph.erase_node(copy)
        gm.graph.erase_node(new)
        done += 1
    if done:
        gm.graph.lint()
        gm.recompile()
    return done


def _written_between(dst: fx.Node, between: list[fx.Node]) -> bool:
    """Some node in `between` writes `dst` (through views), or may (an op we cannot see into)."""
    for node in between:
        written = written_by(node)
        if written is None or any(strip_views(w) is dst for w in written):
            return True
    return False


def batch_input_increments(gm: fx.GraphModule) -> int:
    """Turn the trailing `copy_(p, add(p, c))` writes of graph inputs (a StaticCache's
    per-layer position counters: two launches per layer, ~1.5 µs each inside a CUDA graph)
    into one `_foreach_add_(ps, c)` per constant c (and dtype, device) at the place of the
    last such copy.

    Only writes whose `add` feeds nothing but the copy, and only copies that come after
    every other reader of their input (they are the graph's write-back epilogue), so the
    increment reads the same value and lands at the same point. Returns how many inputs
    were batched (0 when fewer than two share a constant). Mutates and recompiles `gm`."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    nodes = list(gm.graph.nodes)
    groups: dict[tuple, list[fx.Node]] = {}
    for copy in [n for n in nodes if is_op(n, aten.copy_.default)]:
        dst, new = copy.args[0], copy.args[1]
        if (dst.op != "placeholder" or copy.kwargs or copy.users or not is_op(new, aten.add.Tensor)
                or new.kwargs or new.args[0] is not dst or len(new.users) != 1
                or not isinstance(new.args[1], (int, float)) or isinstance(new.args[1], bool)):
            continue
        t = fake(dst)
        value = new.args[1]
        # p += c in place must equal copy_(p, p + c): no type promotion (an int counter
        # with a float constant would be truncated by the copy but refused in place)
        if t is None or t.dtype == torch.bool or (isinstance(value, float) and not t.is_floating_point()):
            continue
        if _reads_after(dst, order[copy], order, skip={new, copy}):
            continue
        if _written_between(dst, nodes[order[new] + 1:order[copy]]):
            continue  # p + c was computed from a value a later write replaced
        groups.setdefault((t.dtype, t.device, type(value), value), []).append(copy)
    done = 0
    for (*_, value), copies in groups.items():
        if len(copies) < 2:
            continue
        last = max(copies, key=order.__getitem__)
        with gm.graph.inserting_after(last):
            gm.graph.call_function(aten._foreach_add_.Scalar, ([c.args[0] for c in copies], value))
        for copy in copies:
            new = copy.args[1]
            gm.graph.erase_node(copy)
            gm.graph.erase_node(new)
        done += len(copies)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
