"""Activation patterns: gated activations act(g)·u and bias + activation epilogues.

Activations are recognised by what they compute, not how they are written: aten.silu,
aten.gelu (approximate none/tanh) and aten.relu directly; any other chain of elementwise
ops of one tensor (`x·sigmoid(x)`, GPT-2's `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`,
`x·0.5·(1 + erf(x/√2))`, `clamp_min(x, 0)`, CLIP's `x·sigmoid(1.702·x)`, …) by evaluating
the chain on probe values and comparing with each activation the kernels implement
(`spelled_activation`). A gated activation is `act(g) · u` with g and u of one shape
(SwiGLU, GeGLU); bias+act is `act(x + b)` with b a (N,) parameter, including the
`addmm(b, x, W)` form nn.Linear lowers to.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from advisor.graph.capture import fake, module_path
from advisor.graph.match import CAST_OPS, Match, aten, is_op, other_arg, strip_casts, strip_views
from advisor.kernels.gated_act import ACTIVATIONS, activation_ref


def activation_of(node: Any) -> tuple[str, Any, list[fx.Node]] | None:
    """(name, input, nodes) if `node` computes a supported activation of one tensor;
    `nodes` are the ops computing it (the input read by nothing else among them). None
    where its one reader computes a longer one of the same input (relu(x)²: matched at the
    square, not at the relu)."""
    found = _activation_at(node)
    if found is not None and len(node.users) == 1:
        longer = _activation_at(next(iter(node.users)))
        if longer is not None and longer[1] is found[1]:
            return None
    return found


def _activation_at(node: Any) -> tuple[str, Any, list[fx.Node]] | None:
    if is_op(node, aten.silu.default):
        return "silu", node.args[0], [node]
    if is_op(node, aten.relu.default):
        return "relu", node.args[0], [node]
    if is_op(node, aten.gelu.default):
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return ("gelu_tanh" if approx == "tanh" else "gelu"), node.args[0], [node]
    return spelled_activation(node)


def reads_only(value: Any, nodes: list[fx.Node]) -> bool:
    """Every reader of `value` is one of `nodes` (replacing them leaves it unread)."""
    return isinstance(value, fx.Node) and all(u in nodes for u in value.users)


# --- activations spelled as elementwise chains --------------------------------------------

MAX_CHAIN = 24  # ops in one spelled activation (GPT-2's tanh GELU takes 9)
# Values the chain and each candidate are compared at: the range where activations differ
# (gelu vs its tanh form by up to ~2e-4 near |x| = 2), zero, and both tails.
_PROBE = torch.cat([torch.linspace(-8.0, 8.0, 161, dtype=torch.float64),
                    torch.tensor([-30.0, -1e-3, 1e-3, 30.0], dtype=torch.float64)])
_REFERENCES = {name: functools.partial(activation_ref, name) for name in ACTIVATIONS}
_SPELLED_RTOL = 1e-5  # float64 evaluation: a true spelling agrees to ~1e-9 (constants to 10 digits)
_CONSTANTS = {aten.scalar_tensor.default, aten.full.default}  # `where(x > 0, x, 0.0)`'s 0.0


def _pointwise(node: Any) -> bool:
    """An elementwise op, or a constant of literal sizes (no inputs) that one reads."""
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and (torch.Tag.pointwise in node.target.tags or node.target in CAST_OPS
                 or node.target in _CONSTANTS and not node.all_input_nodes))


def _chain(root: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """(x, ops) where the elementwise ops ending at `root` read one tensor x and nothing
    else (scalars aside), and nothing outside them reads their intermediates. Grown from
    the root upward, always taking the latest node still read: x precedes every op of the
    chain, so it is reached last, when it is the only value left."""
    order = _graph_order(root)
    ops, frontier = [root], set(root.all_input_nodes)
    while len(frontier) != 1:
        if not frontier or len(ops) >= MAX_CHAIN:
            return None
        latest = max(frontier, key=order)
        if not _pointwise(latest) or any(u not in ops for u in latest.users):
            return None
        frontier.discard(latest)
        ops.append(latest)
        frontier |= set(latest.all_input_nodes)
    (x,) = frontier
    return x, ops[::-1]  # taken latest first: reversed, they run in graph order


def _graph_order(node: fx.Node) -> Any:
    """A key ordering a graph's nodes as they run: fx's own sort key where torch keeps one
    (kept current as nodes are inserted), else positions counted once."""
    if hasattr(node, "_sort_key"):
        return lambda n: n._sort_key
    position = {n: i for i, n in enumerate(node.graph.nodes)}
    return position.__getitem__


def _evaluate(x: fx.Node, ops: list[fx.Node], probe: torch.Tensor) -> torch.Tensor | None:
    """The chain's output for x = probe, in float64 (casts inside the chain skipped)."""
    values: dict[fx.Node, Any] = {x: probe}
    try:
        for n in ops:
            args = fx.node.map_arg(n.args, lambda a: values[a])
            kwargs = fx.node.map_arg(n.kwargs, lambda a: values[a])
            if "device" in kwargs:  # constants made on the model's device: made here
                kwargs = {**kwargs, "device": "cpu"}
            if n.target in CAST_OPS:
                values[n] = args[0]
                continue
            out = n.target(*args, **kwargs)
            values[n] = out.double() if isinstance(out, torch.Tensor) and out.is_floating_point() else out
        out = values[ops[-1]]
    except Exception:  # an op that will not run on a plain CPU tensor: not an activation here
        return None
    return out if isinstance(out, torch.Tensor) and out.shape == probe.shape else None


def spelled_activation(root: Any) -> tuple[str, Any, list[fx.Node]] | None:
    """(name, x, ops) if the elementwise chain ending at `root` computes one of the
    activations the kernels implement (gated_act.ACTIVATIONS), with x's shape and dtype;
    else None. The shortest such chain: one that computes none (x² of a relu) grows by the
    one-input op before it (relu(x)²) while that op is the chain's alone."""
    if not _pointwise(root) or root.target in CAST_OPS:
        return None
    found = _chain(root)
    while found is not None:
        x, ops = found
        named = _named(x, ops, root)
        if named is not None:
            return named, x, ops
        if not (_pointwise(x) and len(x.all_input_nodes) == 1 and all(u in ops for u in x.users)):
            return None
        if len(ops) >= MAX_CHAIN or (x.target in CAST_OPS and strip_casts(x) is x):
            return None  # long enough; a narrowing cast rounds, which `_evaluate` does not model
        found = x.all_input_nodes[0], [x, *ops]
    return None


def _named(x: fx.Node, ops: list[fx.Node], root: fx.Node) -> str | None:
    """The activation the chain `ops` (x -> root) computes, if any."""
    tx, ty = fake(x), fake(root)
    if tx is None or ty is None or tx.shape != ty.shape or tx.dtype != ty.dtype or not tx.is_floating_point():
        return None
    if not any(n.target not in CAST_OPS and n.target not in (aten.mul.Tensor, aten.add.Tensor)
               for n in ops):
        return None  # only products and sums of x: affine or polynomial, never an activation
    with unset_fake_temporarily():  # patterns also run inside a compiler's fake mode
        y = _evaluate(x, ops, _PROBE.clone())
        if y is None or not bool(torch.isfinite(y).all()):
            return None
        for name, want in _expected().items():
            if bool(((y - want).abs() <= _SPELLED_RTOL * (1.0 + want.abs())).all()):
                return name
    return None


@functools.cache
def _expected() -> dict[str, torch.Tensor]:
    return {name: ref(_PROBE) for name, ref in _REFERENCES.items()}


def _view_chain(top: fx.Node, bottom: fx.Node) -> list[fx.Node]:
    """The view nodes from `bottom` up to `top` (inclusive of top, exclusive of bottom)."""
    chain = []
    while top is not bottom:
        chain.append(top)
        top = top.args[0]
    return chain[::-1]


def find_gated(gm: fx.GraphModule) -> list[Match]:
    found = []
    for node in gm.graph.nodes:
        if not is_op(node, aten.mul.Tensor):
            continue
        for a in node.args[:2]:
            act = activation_of(a)
            up = other_arg(node, a)
            if act is None or not isinstance(up, fx.Node) or len(a.users) != 1:
                continue
            name, gate, nodes = act
            tg, tu, ta = fake(gate), fake(up), fake(a)
            if tg is None or tu is None or tg.shape != tu.shape or tg.dtype != tu.dtype:
                continue
            if name == "relu2" and (ta is None or ta.dtype == torch.float16):
                # relu(g)² stored in fp16 overflows from g = 256 where the kernels' fp32
                # product act(g)·u need not: eager's inf (or NaN) is what the model computes
                continue
            operands = {"gate": gate, "up": up, "activation": name}
            found.append(Match("gated_act", "gated_act", module_path(node), (*nodes, node),
                               operands, {"y": node}))
            break
    return found


def find_bias_act(gm: fx.GraphModule, params: dict[str, str]) -> list[Match]:
    found = []
    for node in gm.graph.nodes:
        act = activation_of(node)
        if act is None or not reads_only(act[1], act[2]):
            continue  # the act's input is read elsewhere too: it must stay as it is
        name, pre, nodes = act
        src = strip_views(pre)
        if is_op(src, aten.addmm.default) and len(src.users) == 1:
            bias = src.args[0]
            if isinstance(bias, fx.Node) and bias.name in params:
                views = _view_chain(pre, src)
                operands = {"addmm": src, "x_view": pre, "bias": bias, "activation": name}
                found.append(Match("bias_act", "bias_act", module_path(node), (src, *views, *nodes),
                                   operands, {"y": node}))
            continue
        if is_op(pre, aten.add.Tensor):
            bias = next((a for a in pre.args[:2] if isinstance(a, fx.Node) and a.name in params), None)
            x = other_arg(pre, bias) if bias is not None else None
            tb, tx = fake(bias), fake(x)
            if tb is None or tx is None or tb.dim() != 1 or int(tb.shape[0]) != int(tx.shape[-1]):
                continue
            operands = {"x": x, "bias": bias, "activation": name}
            found.append(Match("bias_act", "bias_act", module_path(node), (pre, *nodes),
                               operands, {"y": node}))
    return found
