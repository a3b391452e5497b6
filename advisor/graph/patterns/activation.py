"""Activation patterns: gated activations act(g)·u and bias + activation epilogues.

Activations are recognised through spellings: aten.silu or g·sigmoid(g) (SiLU),
aten.gelu with approximate none/tanh, aten.relu. A gated activation is `act(g) · u` with
g and u of one shape (SwiGLU, GeGLU); bias+act is `act(x + b)` with b a (N,) parameter,
including the `addmm(b, x, W)` form nn.Linear lowers to.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from advisor.graph.capture import fake, module_path
from advisor.graph.match import Match, aten, is_op, other_arg, strip_views


def activation_of(node: Any) -> tuple[str, Any, list[fx.Node]] | None:
    """(name, input, nodes) if `node` computes a supported activation of one tensor."""
    if is_op(node, aten.silu.default):
        return "silu", node.args[0], [node]
    if is_op(node, aten.relu.default):
        return "relu", node.args[0], [node]
    if is_op(node, aten.gelu.default):
        approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
        return ("gelu_tanh" if approx == "tanh" else "gelu"), node.args[0], [node]
    if is_op(node, aten.mul.Tensor):  # g * sigmoid(g)
        for sig in node.args[:2]:
            if is_op(sig, aten.sigmoid.default) and other_arg(node, sig) is sig.args[0]:
                return "silu", sig.args[0], [sig, node]
    return None


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
            tg, tu = fake(gate), fake(up)
            if tg is None or tu is None or tg.shape != tu.shape or tg.dtype != tu.dtype:
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
        if act is None or act[0] == "silu" and len(act[2]) == 2:
            continue  # hand-written silu reads its input twice: leave to gated/other fusions
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
        if is_op(pre, aten.add.Tensor) and len(pre.users) == 1:
            bias = next((a for a in pre.args[:2] if isinstance(a, fx.Node) and a.name in params), None)
            x = other_arg(pre, bias) if bias is not None else None
            tb, tx = fake(bias), fake(x)
            if tb is None or tx is None or tb.dim() != 1 or int(tb.shape[0]) != int(tx.shape[-1]):
                continue
            operands = {"x": x, "bias": bias, "activation": name}
            found.append(Match("bias_act", "bias_act", module_path(node), (pre, *nodes),
                               operands, {"y": node}))
    return found
