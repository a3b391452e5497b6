"""Emit the fused op for one match into an aten graph (insert the call, reroute users).

Each kernel's operand order is data (`KERNEL_ARGS`); the config string is its last arg.
Merged linears and the addmm form of bias+act need a little graph surgery of their own.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from advisor.graph.capture import fake, hint, new_node
from advisor.graph.cse import written_by
from advisor.graph.match import VIEW_OPS, Match, aten, is_getitem, is_op

# kernel id -> (operand names in call order, output names in result order)
KERNEL_ARGS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "rms_norm": (("x", "weight", "eps", "weight_offset"), ("y",)),
    "add_rms_norm": (("x", "residual", "weight", "eps", "weight_offset"), ("y", "residual")),
    "layer_norm": (("x", "weight", "bias", "eps"), ("y",)),
    "add_layer_norm": (("x", "residual", "weight", "bias", "eps"), ("y", "residual")),
    "gated_act": (("gate", "up", "activation"), ("y",)),
    "bias_act": (("x", "bias", "activation"), ("y",)),
    "rope_qk": (("q", "k", "cos", "sin", "interleaved"), ("q", "k")),
    "linear_swiglu": (("x", "weights", "activation"), ("y",)),
    "attention": (("q", "k", "v", "cos", "sin", "mask", "causal", "scale", "interleaved", "q_pos",
                   "softcap", "sinks"), ("y",)),
    "rmsnorm_linear": (("x", "weight", "weights", "biases", "eps", "weight_offset"), ("y",)),  # own emitter
    "layernorm_linear": (("x", "weight", "bias", "weights", "biases", "eps", "activation"),
                         ("y",)),  # own emitter
    "rmsnorm_swiglu": (("x", "weight", "weights", "eps", "weight_offset", "activation"), ("y",)),
    "gemm_epilogue": (("x", "weight", "bias", "residual", "activation"), ("y",)),  # own emitter
    "gated_linear": (("gate", "up", "weight", "bias", "residual", "activation"), ("y",)),  # own emitter
    "rope_table": (("a", "b", "cos_scale", "sin_scale", "dup", "dtype"), ("cos", "sin")),  # own emitter
}


# may be None (the op takes Tensor?)
OPTIONAL_OPERANDS = {"weight", "bias", "cos", "sin", "mask", "q_pos", "sinks"}


class EmitError(Exception):
    """The match cannot be emitted here (ordering, missing operand); the site stays unfused."""


def _position(graph: fx.Graph) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(graph.nodes)}


def _insert_point(graph: fx.Graph, m: Match, operands: list[Any]) -> fx.Node:
    """Right after the last operand; must precede every outside reader of an output. An
    operand that is a view taken after that reader (partial rotary applied per tensor:
    q's `cat(rotated, passed)` reads q's rotation before k's slice is taken) moves up."""
    pos = _position(graph)
    deps = [a for a in pytree.tree_leaves(list(operands)) if isinstance(a, fx.Node)]
    inside = set(m.nodes)
    readers = [u for o in m.outputs.values() for u in o.users if u not in inside]
    if readers:
        first = min(readers, key=pos.__getitem__)
        late = _views_to_hoist(deps, first, pos, inside)
        for n in late or ():
            first.prepend(n)
        pos = _position(graph) if late else pos
    last = max(deps, key=pos.__getitem__)
    if readers and pos[last] >= min(pos[u] for u in readers):
        raise EmitError("operands are produced after an output is read")
    return last


_MULTI_VIEWS = {aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int}


def _views_to_hoist(deps: list[fx.Node], before: fx.Node, pos: dict[fx.Node, int],
                    inside: set[fx.Node]) -> list[fx.Node] | None:
    """The nodes at or after `before` that the operands need, in graph order, when all of
    them are views (metadata only: moving one earlier changes no value); None otherwise."""
    need: dict[fx.Node, None] = {}

    def visit(n: fx.Node) -> bool:
        if pos[n] < pos[before] or n in need:
            return True
        view = n.op == "call_function" and not n.kwargs and n not in inside and (
            (n.target in VIEW_OPS and n.target not in _MULTI_VIEWS)
            or (n.target is operator.getitem and getattr(n.args[0], "target", None) in _MULTI_VIEWS))
        if not view or not all(visit(a) for a in n.all_input_nodes):
            return False
        need[n] = None
        return True

    if not all(visit(d) for d in deps):
        return None
    if not need:
        return []  # the common case: every operand precedes the reader
    # The fused op now reads those views before `before`: nothing from there to the site's
    # last node may write memory (a cache written in place in between would be read stale).
    end = max((pos[n] for n in inside), default=pos[before])
    span = [n for n, i in pos.items() if pos[before] <= i <= end]
    if any(_may_write(n) for n in span):
        return None
    return sorted(need, key=pos.__getitem__)


def _may_write(node: fx.Node) -> bool:
    """Whether the node may write a tensor (size arithmetic on SymInts writes nothing)."""
    writes = written_by(node)
    return bool(writes) or (writes is None and isinstance(node.meta.get("val"), torch.Tensor))


def _same_layout(want: torch.Tensor, got: torch.Tensor | None) -> bool:
    """Same strides at the example sizes (hints: comparing symbolic strides would guard)."""
    if got is None:
        return want.is_contiguous()
    return [hint(s) for s in want.stride()] == [hint(s) for s in got.stride()]


def _reroute(out: fx.Node, new: fx.Node, inside: set[fx.Node]) -> fx.Node:
    """Point the outside readers of `out` at `new`. Where the fused op's result has other
    strides than the captured value (later views in the graph were traced against them),
    it is first copied into that layout."""
    val, got = fake(out), fake(new)
    if val is not None and got is not None and got.dim() > val.dim():
        # the kernel kept x's leading dims where the site's output flattened them (a MoE
        # block's experts read hidden states as (B·T, D)): view it as (-1, *rest)
        rest = list(val.shape[1:])
        if not all(isinstance(d, int) for d in rest):
            raise EmitError(f"cannot view the fused result {tuple(got.shape)} as {tuple(val.shape)}")
        with new.graph.inserting_after(new):
            new = new_node(new.graph, aten.view.default, (new, [-1, *rest]))
        got = fake(new)
    if val is not None and not _same_layout(val, got):
        # Dense layout with the captured dim order (static even when sizes are symbolic):
        # permute to that order, make contiguous, permute back.
        order = sorted(range(val.dim()), key=lambda i: -hint(val.stride()[i]))
        inverse = sorted(range(val.dim()), key=order.__getitem__)
        graph = new.graph
        with graph.inserting_after(new):
            perm = new_node(graph, aten.permute.default, (new, order))
        with graph.inserting_after(perm):
            dense = new_node(graph, aten.clone.default, (perm,), {"memory_format": torch.contiguous_format})
        with graph.inserting_after(dense):
            new = new_node(graph, aten.permute.default, (dense, inverse))
    out.replace_all_uses_with(new, delete_user_cb=lambda user: user not in inside)
    return new


def _emit_kernel(graph: fx.Graph, m: Match, config: str,
                 result_view: Callable[[fx.Node], fx.Node] | None = None) -> dict[fx.Node, fx.Node]:
    """The fused op on the match's operands, its results (through `result_view`, inserted
    after each) read where the match's outputs were."""
    names, results = KERNEL_ARGS[m.kernel]
    args = [m.operands.get(n) for n in names]
    if any(a is None for a, n in zip(args, names) if n not in OPTIONAL_OPERANDS):
        raise EmitError("an operand of the fused op is missing")
    op = getattr(torch.ops.advisor, m.kernel).default
    after = _insert_point(graph, m, args)
    inside = set(m.nodes)
    with graph.inserting_after(after):
        call = new_node(graph, op, (*args, config))
    if len(results) == 1:
        out = result_view(call) if result_view else call
        return {m.outputs[results[0]]: _reroute(m.outputs[results[0]], out, inside)}
    cursor, replaced = call, {}
    for i, name in enumerate(results):
        with graph.inserting_after(cursor):
            cursor = new_node(graph, operator.getitem, (call, i))
        if result_view:
            cursor = result_view(cursor)
        replaced[m.outputs[name]] = _reroute(m.outputs[name], cursor, inside)
    return replaced


def _emit_prepared_rope(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """A RoPE matched on (re, im) pairs or on (B, T, H, D) (patterns/rope.py: `seq_dim`,
    `pairs`), alone or folded into the attention. The kernel's operands are made first: a
    complex table's real and imaginary parts (views); a 4-D table squeezed to (1|B, T, ·);
    sin negated for a rotation the other way (`pairs` "neg", "halves_neg"); each per-pair
    or per-half value repeated twice (a small copy of the table, the same for every
    layer, which CSE leaves one of); q and k transposed to (B, H, T, D) (views). rope_qk's
    results are transposed back."""
    ops, seq_dim = dict(m.operands), m.operands.get("seq_dim", 2)

    def after(node: fx.Node, target: Any, *args: Any) -> fx.Node:
        with graph.inserting_after(node):
            return new_node(graph, target, (node, *args))

    pairs = m.operands.get("pairs")
    for i, name in enumerate(("cos", "sin")):
        table = ops[name]
        if pairs == "complex":  # cos, sin = F.real, F.imag (views)
            table = after(after(table, aten.view_as_real.default), aten.select.int, -1, i)
        if fake(table).dim() == 4 and (pairs or seq_dim == 1):  # (1|B, T, 1, ·) or (1|B, 1, T, ·)
            table = after(table, aten.squeeze.dim, 3 - seq_dim)  # -> (1|B, T, ·)
        if name == "sin" and pairs in ("halves_neg", "neg"):  # a rotation the other way: -sin
            table = after(table, aten.neg.default)
        if pairs in ("halves", "halves_neg"):  # (…, R/2) -> [t, t]
            table = after(table, aten.repeat.default, [1] * (fake(table).dim() - 1) + [2])
        elif pairs and pairs != "neg":  # one value per (re, im) pair -> each repeated twice
            table = after(table, aten.repeat_interleave.self_int, 2, -1)
        ops[name] = table
    transpose = None
    if seq_dim == 1:
        for name in ("q", "k"):
            ops[name] = after(ops[name], aten.transpose.int, 1, 2)
        if m.kernel == "rope_qk":  # rotated q and k back to (B, T, H, D); attention's y is (B, H, T, D)
            transpose = lambda n: after(n, aten.transpose.int, 1, 2)  # noqa: E731
    return _emit_kernel(graph, dataclasses.replace(m, operands=ops), config, transpose)


def _additive_mask(graph: fx.Graph, m: Match) -> Match:
    """An attention whose scores are dropped where a bool cond says (masked_fill(cond, v),
    or where(cond, s, v) keeping where cond is True; v is -inf or `attention.DROPPED`) and
    maybe also masked additively: the kernel adds one fp32 mask, made here right after the
    later of cond and mask. A mask added before the drop is replaced where it drops:
    where(cond, v, mask | 0) (or where(cond, mask | 0, v)); one added after it adds to the
    dropped scores too (GPT-Neo: a padding key causally dropped is -inf there): mask +
    where(cond, v, 0). fp32 either way: fp32's min in a bf16 mask is -inf."""
    ops = dict(m.operands)
    cond, keeps, value = ops.pop("drop"), ops.pop("drop_keeps"), ops.pop("drop_value")
    after, add = ops.pop("mask_after_drop"), ops.get("mask")
    insert = _inserter(graph, cond, add)
    if add is not None:
        add = _fp32(insert, add)
    if add is None or after:
        mask = insert(aten.where.Scalar, cond, *((0.0, value) if keeps else (value, 0.0)))
        if add is not None:
            mask = insert(aten.add.Tensor, add, mask)
    elif keeps:
        mask = insert(aten.where.ScalarOther, cond, add, value)
    else:
        mask = insert(aten.where.ScalarSelf, cond, value, add)
    return dataclasses.replace(m, operands={**ops, "mask": mask})


def _heads_bias(graph: fx.Graph, m: Match) -> Match:
    """baddbmm's bias b (B·H, 1|Tq, Tk) (BLOOM's ALiBi) as the kernel's mask: b viewed
    (B, H, 1|Tq, Tk), plus the site's additive mask if it has one, in fp32 (eager adds
    both to the scores before the softmax; fp32's min in a bf16 mask is -inf). Made right
    after the later of the two."""
    ops = dict(m.operands)
    bias, add = ops.pop("heads_bias"), ops.get("mask")
    insert = _inserter(graph, bias, add)
    mask = insert(aten.unflatten.int, bias, 0, [-1, int(fake(ops["q"]).shape[1])])
    if add is not None:
        mask = insert(aten.add.Tensor, _fp32(insert, mask), _fp32(insert, add))
    return dataclasses.replace(m, operands={**ops, "mask": mask})


def _fp32(insert: Callable[..., fx.Node], x: fx.Node) -> fx.Node:
    return x if fake(x).dtype == torch.float32 else insert(aten._to_copy.default, x, dtype=torch.float32)


def _inserter(graph: fx.Graph, *after: Any) -> Callable[..., fx.Node]:
    """insert(target, *args, **kwargs): a new node after the last of `after`'s nodes (then
    after the node inserted before it)."""
    pos = _position(graph)
    cursor = max((n for n in after if isinstance(n, fx.Node)), key=pos.__getitem__)

    def insert(target: Any, *args: Any, **kwargs: Any) -> fx.Node:
        nonlocal cursor
        with graph.inserting_after(cursor):
            cursor = new_node(graph, target, args, kwargs)
        return cursor
    return insert


def _emit_bias_act_addmm(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """addmm(b, x, Wᵀ) → view → act  becomes  mm(x, Wᵀ) → view → bias_act(·, b)."""
    addmm, x_view = m.operands["addmm"], m.operands["x_view"]
    with graph.inserting_before(addmm):
        mm = new_node(graph, aten.mm.default, (addmm.args[1], addmm.args[2]))
    mm.meta = dict(addmm.meta)
    addmm.replace_all_uses_with(mm)
    x_view = mm if x_view is addmm else x_view  # a 2-D input: the act reads the addmm itself
    with graph.inserting_after(x_view):
        call = new_node(graph, torch.ops.advisor.bias_act.default,
                    (x_view, m.operands["bias"], m.operands["activation"], config))
    m.outputs["y"].replace_all_uses_with(call)
    return {addmm: mm, m.outputs["y"]: call}


def _emit_merged_linear(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """n linears reading x → one merged_linear (M, ΣN) and n column slices of it."""
    outs = [m.outputs[f"out{i}"] for i in range(len(m.outputs))]
    x2d = outs[0].args[1] if outs[0].target == aten.addmm.default else outs[0].args[0]
    weights, biases = m.operands["weights"], m.operands["biases"]
    after = _insert_point(graph, m, [x2d, *weights, *[b for b in biases if b is not None]])
    with graph.inserting_after(after):
        call = new_node(graph, torch.ops.advisor.merged_linear.default, (x2d, weights, biases))
    return _slice_columns(graph, call, outs, weights)


def _emit_norm_linear(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """norm(x) read by n linears → rmsnorm_linear / layernorm_linear (x as (M, K), the
    norm's operands, [W…] (, [b…])) and n column slices of its (M, ΣN) result (the linears'
    outputs are 2-D)."""
    x, weights = m.operands["x"], m.operands["weights"]
    names = KERNEL_ARGS[m.kernel][0][1:]  # after x
    rest = [m.operands.get(name) for name in names]
    shape = m.operands.get("out_shape")
    after = _insert_point(graph, m, [x, *rest, shape])
    k = int(fake(weights[0]).shape[1])
    with graph.inserting_after(after):  # reshape: x may be a transposed view (conv features)
        x2d = new_node(graph, aten.reshape.default, (x, [-1, k]))
    with graph.inserting_after(x2d):
        call = new_node(graph, getattr(torch.ops.advisor, m.kernel).default, (x2d, *rest, config))
    if m.operands.get("activation", "none") != "none":  # one projection, its activation's value
        y = call
        if shape is not None:  # the activation read the GEMM viewed back to x's leading dims
            with graph.inserting_after(call):
                y = new_node(graph, aten.view.default, (call, shape))
        return {m.outputs["out0"]: _reroute(m.outputs["out0"], y, set(m.nodes))}
    return _slice_columns(graph, call, [m.outputs[f"out{i}"] for i in range(len(weights))], weights)


def _slice_columns(graph: fx.Graph, call: fx.Node, outs: list[fx.Node],
                   weights: list[fx.Node]) -> dict[fx.Node, fx.Node]:
    """Point each output at its column block [start, start + N_i) of `call`'s result."""
    start, cursor, replaced = 0, call, {}
    for out, w in zip(outs, weights):
        rows = int(fake(w).shape[0])
        with graph.inserting_after(cursor):
            cursor = new_node(graph, aten.slice.Tensor, (call, 1, start, start + rows))
        out.replace_all_uses_with(cursor)
        _reshape_where_viewed(cursor)
        replaced[out] = cursor
        start += rows
    return replaced


def _reshape_where_viewed(node: fx.Node) -> None:
    """`node` holds its values in other strides than the graph was traced with (a column
    block of a merged projection: rows ΣN apart, not N). Views below it that the trace
    spelled `view` may now fail (GPT-J's or an MHA Llama's eager attention reads v as
    (B·H, T, D); batch 2 at one token crashed): they become `reshape`, which is the same
    view where the strides allow one and a copy where they do not."""
    stack, seen = [node], set()
    while stack:
        for user in stack.pop().users:
            if user in seen or not (is_op(user, *VIEW_OPS) or is_getitem(user)):
                continue
            seen.add(user)
            if is_op(user, aten.view.default, aten._unsafe_view.default):
                user.target = aten.reshape.default
            stack.append(user)


def _emit_linear_epilogue(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """view(mm/addmm(x, Wᵀ)) → act  becomes  view(gemm_epilogue(x, W, b, act)) with the
    captured view's sizes (symbolic sizes are nodes defined before the view; no view where
    the act read the (M, N) GEMM itself); with a residual, view(mm(x, Wᵀ)) + r  becomes
    view(gemm_epilogue(x, W, b, reshape(r, (-1, N))))."""
    x, w, b, shape = m.operands["x"], m.operands["weight"], m.operands["bias"], m.operands["out_shape"]
    r = m.operands.get("residual")  # linear_residual: r (..., N), read as (M, N) rows
    after = _insert_point(graph, m, [x, w, b, r, shape])
    with graph.inserting_after(after):
        r2 = None if r is None else new_node(graph, aten.reshape.default, (r, [-1, int(fake(w).shape[0])]))
    with graph.inserting_after(r2 if r2 is not None else after):
        call = new_node(graph, torch.ops.advisor.gemm_epilogue.default,
                    (x, w, b, r2, m.operands["activation"], config))
    y = call
    if shape is not None:
        with graph.inserting_after(call):
            y = new_node(graph, aten.view.default, (call, shape))
    return {m.outputs["y"]: _reroute(m.outputs["y"], y, set(m.nodes))}


def _emit_gated_linear(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """act(g)·u → view (M, K) → mm(·, Wᵀ) [→ view + r]  becomes  gated_linear(g, u, W, b, r):
    (..., N), viewed as the mm's (M, N) or, with the residual, as the add's captured sizes."""
    names = KERNEL_ARGS["gated_linear"][0]
    args = [m.operands.get(n) for n in names]
    r, shape = m.operands.get("residual"), m.operands.get("out_shape")
    after = _insert_point(graph, m, [*args, shape])
    with graph.inserting_after(after):
        call = new_node(graph, torch.ops.advisor.gated_linear.default, (*args, config))
    n = int(fake(m.operands["weight"]).shape[0])
    with graph.inserting_after(call):
        y = new_node(graph, aten.view.default, (call, shape if r is not None else [-1, n]))
    return {m.outputs["y"]: _reroute(m.outputs["y"], y, set(m.nodes))}


_ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)


def _arange_to(node: Any, t: Any) -> bool:
    """node is arange(t), arange(0, t) or arange(0, t, 1) (t: an int or the same SymInt)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _ARANGES):
        return False
    bounds = list(node.args) if node.target is not aten.arange.default else [0, *node.args]
    return (len(bounds) in (2, 3) and bounds[0] == 0 and bounds[2:] in ([], [1])
            and str(bounds[1]) == str(t))


def _counter_of(position: Any, t: Any) -> fx.Node | None:
    """p where position = p + arange(T) (either order) and p is one integer: the cache
    write then reads p itself (kernels/rope.py `slots`) and the add leaves the graph —
    transformers' StaticCache computes it per layer from each layer's own counter."""
    if not (isinstance(position, fx.Node) and position.target is aten.add.Tensor
            and len(position.args) == 2 and position.kwargs.get("alpha", 1) == 1):
        return None
    for a, p in (position.args, position.args[::-1]):
        val = fake(p) if isinstance(p, fx.Node) else None
        if _arange_to(a, t) and val is not None and val.numel() == 1 and not val.dtype.is_floating_point:
            return p
    return None


def _emit_rope_cache(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """rope_qk + index_copy_(k_cache) + index_copy_(v_cache) → rope_qk_cache, which writes
    both caches in place and returns the rotated q. Readers of the two writes' results
    (aliases of the caches) read the cache inputs, after the fused op; the writes are
    removed here (DCE keeps in-place ops). Positions `p + arange(T)` pass as p."""
    names = ("q", "k", "v", "cos", "sin", "k_cache", "v_cache", "cache_position", "interleaved")
    args = [m.operands[n] for n in names]
    q = fake(m.operands["q"])
    counter = _counter_of(m.operands["cache_position"], q.shape[2]) if q is not None else None
    if counter is not None:
        args[names.index("cache_position")] = counter
    after = _insert_point(graph, m, args)
    inside = set(m.nodes)
    with graph.inserting_after(after):
        call = new_node(graph, torch.ops.advisor.rope_qk_cache.default, (*args, config))
    replaced = {m.outputs["q"]: _reroute(m.outputs["q"], call, inside)}
    for name in ("k_cache", "v_cache"):
        write = m.outputs[name]
        write.replace_all_uses_with(m.operands[name])
        graph.erase_node(write)
        replaced[write] = m.operands[name]
    return replaced


def _emit_rope_table(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """cos/sin of [cat(f, f) | f], f = transposes(a · b)  becomes  rope_table(a', b', …):
    each factor's views replayed on its uncast source (the kernel casts on load), then the
    transposes applied to both (a bmm's (B, H, 1) and (B, 1, T) operands become (B, 1, H)
    and (B, T, 1))."""
    factors = {}
    for name in ("a", "b"):
        node = m.operands[name]
        for view in m.operands.get(f"{name}_views", ()):
            with graph.inserting_after(view):  # after its sizes too (symbolic ones are nodes)
                node = new_node(graph, view.target, (node, *view.args[1:]), dict(view.kwargs))
        for d0, d1 in m.operands["transposes"]:
            with graph.inserting_after(node):
                node = new_node(graph, aten.transpose.int, (node, d0, d1))
        factors[name] = node
    return _emit_kernel(graph, dataclasses.replace(m, operands={**m.operands, **factors}), config)


def emit(graph: fx.Graph, m: Match, config: str) -> dict[fx.Node, fx.Node]:
    """Insert the fused op for `m`; returns {replaced node: its new value}. The replaced
    nodes become dead (the caller runs DCE)."""
    if m.kernel == "merged_linear":
        return _emit_merged_linear(graph, m, config)
    if m.kernel in ("rmsnorm_linear", "layernorm_linear"):
        return _emit_norm_linear(graph, m, config)
    if m.kernel == "bias_act" and "addmm" in m.operands:
        return _emit_bias_act_addmm(graph, m, config)
    if m.kernel == "rope_qk_cache":
        return _emit_rope_cache(graph, m, config)
    if m.kernel == "gemm_epilogue":
        return _emit_linear_epilogue(graph, m, config)
    if m.kernel == "gated_linear":
        return _emit_gated_linear(graph, m, config)
    if m.kernel == "rope_table":
        return _emit_rope_table(graph, m, config)
    if m.kernel == "attention" and m.operands.get("heads_bias") is not None:
        m = _heads_bias(graph, m)
    if m.kernel == "attention" and m.operands.get("drop") is not None:
        m = _additive_mask(graph, m)
    if m.kernel in ("rope_qk", "attention") and ("pairs" in m.operands or "seq_dim" in m.operands):
        return _emit_prepared_rope(graph, m, config)
    if m.kernel in KERNEL_ARGS:
        return _emit_kernel(graph, m, config)
    raise EmitError(f"no emitter for kernel {m.kernel!r}")
