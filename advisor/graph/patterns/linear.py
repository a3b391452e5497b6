"""Linear-layer patterns: horizontal merges, norm→projection prologues, and activation
epilogues.

`nn.Linear` lowers to `mm(view(x, [M, K]), t(W))` (or `addmm(b, ...)` with a bias). Linears
that read the same activation with weights of the same K can run as one GEMM over the
concatenated weights (Q/K/V, gate/up): one read of x and one launch instead of n.
A norm whose output is read only by projections can be folded into their GEMM prologue;
an activation that is a linear's only reader (GPT-style MLPs: gelu(x·Wᵀ + b)) into its
epilogue, so the pre-activation never reaches memory; likewise the residual add a
projection feeds (o_proj, down_proj: h = r + x·Wᵀ).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from advisor.graph.capture import common_module, fake, module_path
from advisor.graph.match import RESHAPE_OPS, VIEW_OPS, Match, aten, is_op, known, strip_views
from advisor.graph.patterns.activation import activation_of, reads_only


@dataclass(frozen=True)
class Linear:
    """mm/addmm node with its activation source (before views), weight and bias."""

    node: fx.Node
    x: fx.Node          # the activation as produced upstream (e.g. the norm output)
    x2d: fx.Node        # the (M, K) view the mm reads
    weight: fx.Node     # (N, K) parameter placeholder, or t(W) of a W stored (K, N)
    bias: Any           # (N,) parameter placeholder or None
    # the weight is t(W) of a parameter stored (K, N) (GPT-2's Conv1D, so rewritten by
    # graph/linear_forms.py): strides (1, N), never a row slice of a merged (ΣN, K) buffer
    transposed_view: bool = False


def linear_at(node: fx.Node, params: dict[str, str]) -> Linear | None:
    if is_op(node, aten.mm.default):
        bias, x2d, wt = None, node.args[0], node.args[1]
    elif is_op(node, aten.addmm.default) and not node.kwargs:
        bias, x2d, wt = node.args[0], node.args[1], node.args[2]
    else:
        return None
    if not _transposed(wt):
        return None
    w = wt.args[0]
    if _transposed(w) and w.args[0].name in params:  # t(t(W)): W stored (K, N)
        return Linear(node, strip_views(x2d), x2d, w, bias, True) if bias_ok(bias, _rows(w), params) else None
    if not isinstance(w, fx.Node) or w.name not in params or not bias_ok(bias, _rows(w), params):
        return None
    return Linear(node, strip_views(x2d), x2d, w, bias)


def _rows(w: fx.Node) -> Any:
    """N of an (N, K) weight node, or None."""
    t = fake(w)
    return t.shape[0] if t is not None and t.dim() == 2 else None


def _transposed(n: Any) -> bool:
    """n is t(P) or permute(P, [1, 0]) of a 2-D node P."""
    return (is_op(n, aten.t.default) or is_op(n, aten.permute.default) and list(n.args[1]) == [1, 0]) \
        and isinstance(n.args[0], fx.Node)


def bias_ok(bias: Any, n: Any, params: dict[str, str]) -> bool:
    """No bias, or an (n,) parameter: what the GEMM epilogues add (addmm would also
    broadcast a (1, n) or (1,) one)."""
    if bias is None:
        return True
    tb = fake(bias)
    return (isinstance(bias, fx.Node) and bias.name in params and tb is not None and tb.dim() == 1
            and n is not None and known(tb.shape[0] == n))


def find_linears(gm: fx.GraphModule, params: dict[str, str]) -> list[Linear]:
    """Every linear whose weight a merged (ΣN, K) buffer can hold (no transposed view)."""
    return [lin for n in gm.graph.nodes
            if (lin := linear_at(n, params)) is not None and not lin.transposed_view]


def _role(group: list[Linear], gated_inputs: set[fx.Node]) -> str:
    feeds_gate = sum(1 for lin in group if any(_reaches(lin.node, g) for g in gated_inputs))
    if len(group) == 2 and feeds_gate == 2:
        return "gate_up_merge"
    if len(group) == 3:
        return "qkv_merge"
    return "linear_merge"


def _reaches(node: fx.Node, target: fx.Node) -> bool:
    """node is target, or target is a view chain of node."""
    return strip_views(target) is node


def find_merges(gm: fx.GraphModule, params: dict[str, str], gated: list[Match]) -> list[Match]:
    """Groups of >= 2 linears reading the same activation, with equal K and dtype."""
    groups: dict[fx.Node, list[Linear]] = defaultdict(list)
    for lin in find_linears(gm, params):
        groups[lin.x].append(lin)
    gated_inputs = {m.operands[k] for m in gated for k in ("gate", "up") if k in m.operands}
    fused_gated = getattr(getattr(torch.ops, "advisor", None), "gated_act", None)
    gated_inputs |= {a for n in gm.graph.nodes if fused_gated is not None
                     and n.target == fused_gated.default for a in n.args[:2]}
    found = []
    for x, group in groups.items():
        if len(group) < 2 or len({lin.bias is None for lin in group}) != 1:
            continue
        shapes = [fake(lin.weight) for lin in group]
        if any(s is None for s in shapes) or len({(s.shape[1], s.dtype) for s in shapes}) != 1:
            continue
        family = _role(group, gated_inputs)
        nodes = tuple(n for lin in group for n in (lin.x2d, lin.node.args[-1], lin.node))
        operands = {"x": x, "weights": [lin.weight for lin in group],
                    "biases": [lin.bias for lin in group]}
        outputs = {f"out{i}": lin.node for i, lin in enumerate(group)}
        site = common_module([module_path(lin.node) for lin in group])
        found.append(Match(family, "merged_linear", site, tuple(dict.fromkeys(nodes)), operands, outputs))
    return found


def _linear_of(node: Any, params: dict[str, str],
               inside: Collection[fx.Node] = ()) -> tuple[Linear, list[fx.Node]] | None:
    """The bias-free linear whose output `node` is (through views), with those views. Each
    of them may be read only along the chain or by `inside` (the activation's own nodes:
    SiLU spelled g·sigmoid(g) reads the gate twice)."""
    views: list[fx.Node] = []

    def private(n: fx.Node) -> bool:
        return all(u in inside or (views and u is views[-1]) for u in n.users)

    while is_op(node, *VIEW_OPS) and private(node):
        views.append(node)
        node = node.args[0]
    lin = linear_at(node, params) if isinstance(node, fx.Node) else None
    if lin is None or lin.bias is not None or not private(node):
        return None
    return lin, views


def find_swiglu_projections(gated: list[Match], params: dict[str, str]) -> list[Match]:
    """act(x·W_gᵀ)·(x·W_uᵀ): a gated activation whose gate and up are bias-free linears of
    the same activation x — one GEMM with two accumulators (kernels/linear_swiglu.py)."""
    found = []
    for m in gated:
        inside = set(m.nodes)
        g, u = (_linear_of(m.operands[k], params, inside) for k in ("gate", "up"))
        if g is None or u is None or g[0].x is not u[0].x or g[0].node is u[0].node:
            continue  # silu(g)·g is one projection, not two to merge
        if g[0].transposed_view or u[0].transposed_view:
            continue  # one (2N, K) buffer of both weights: rows of (N, K) parameters
        tg, tu = fake(g[0].weight), fake(u[0].weight)
        if tg is None or tu is None or tg.shape != tu.shape or tg.dtype != tu.dtype:
            continue
        nodes = [n for lin, views in (g, u) for n in (lin.x2d, lin.node.args[-1], lin.node, *views)]
        operands = {"x": g[0].x, "weights": [g[0].weight, u[0].weight],
                    "activation": m.operands["activation"]}
        found.append(Match("gate_up_swiglu", "linear_swiglu", m.module,
                           tuple(dict.fromkeys([*nodes, *m.nodes])), operands, dict(m.outputs)))
    return found


def find_norm_projections(norms: list[Match], gm: fx.GraphModule, params: dict[str, str],
                          epilogues: list[Match] = ()) -> list[Match]:
    """Norm sites whose normalised output is read only by linears (GEMM-prologue fusion).
    A LayerNorm read by one projection whose activation is an `epilogues` site (fc1 →
    GELU/ReLU of GPT-style MLPs) takes that activation into the same kernel's epilogue.
    A projection whose weight is stored (K, N) (GPT-2's Conv1D: c_attn, c_fc) is read
    through its transposed view, alone: no (ΣN, K) buffer can hold it beside others."""
    by_x: dict[fx.Node, list[Linear]] = defaultdict(list)
    for node in gm.graph.nodes:
        if (lin := linear_at(node, params)) is not None:
            by_x[lin.x].append(lin)
    found = []
    for m in norms:
        y = m.outputs["y"]
        readers = by_x.get(y, [])
        stored_kn = any(lin.transposed_view for lin in readers)
        if stored_kn and len(readers) > 1:
            continue
        # a linear may read y itself (OPT's MLP on (B·T, D) rows: no view between)
        between = _views_to(y, {lin.x2d for lin in readers}, {lin.node for lin in readers if lin.x2d is y})
        if not readers or between is None or not all(_every_row(lin.x2d, y) for lin in readers):
            continue
        gemms = (n for lin in readers for n in (lin.x2d, lin.node.args[-1], lin.node))
        nodes = tuple(dict.fromkeys((*m.nodes, *between, *gemms)))
        operands = {**m.operands, "weights": [lin.weight for lin in readers]}
        outputs = {f"out{i}": lin.node for i, lin in enumerate(readers)}
        kernel = None
        if m.family in ("rms_norm", "add_rms_norm") and m.operands.get("weight") is not None \
                and not stored_kn:
            kernel = "rmsnorm_linear"  # the projections' biases (Qwen2's Q/K/V) in its epilogue
            operands["biases"] = [lin.bias for lin in readers]
        if m.family in ("layer_norm", "add_layer_norm") and _one_dtype(m, readers):
            # OPT, GPT-NeoX, Phi, Falcon, BLOOM: the projections' biases in its epilogue
            kernel = "layernorm_linear"
            operands.update(biases=[lin.bias for lin in readers], activation="none", out_shape=None)
            act = _activation_site(readers, epilogues)
            if act is not None:
                nodes = tuple(dict.fromkeys((*nodes, *act.nodes)))
                operands.update(activation=act.operands["activation"], out_shape=act.operands["out_shape"])
                outputs = {"out0": act.outputs["y"]}
        if "residual" in m.outputs:
            # The residual sum is the residual stream: it stays a plain add, and the
            # fused GEMM normalises it (the add node is left out of the replaced nodes).
            add = m.outputs["residual"]
            nodes = tuple(n for n in nodes if n is not add)
            operands["x"] = add
        # a weightless RMSNorm's projections: analysis only, a family of their own (one
        # family's sites share a kernel; rmsnorm_linear scales by a weight)
        family = m.family if m.operands.get("weight") is not None or "rms" not in m.family \
            or m.family.endswith("_no_weight") else f"{m.family}_no_weight"
        found.append(Match(f"{family}_linear", kernel, m.module, nodes, operands, outputs))
    return found


def _every_row(x2d: fx.Node, y: fx.Node) -> bool:
    """The linear's (M, K) input holds every element of the norm's output y (the fused GEMM
    computes all rows of y; `lm_head(h[:, -1:])` reads the last one only)."""
    tx, ty = fake(x2d), fake(y)
    return tx is not None and ty is not None and known(tx.numel() == ty.numel())


def _activation_site(readers: list[Linear], epilogues: list[Match]) -> Match | None:
    """The linear_bias_act site of the only projection in `readers`, if there is one."""
    if len(readers) != 1:
        return None
    return next((e for e in epilogues if e.family == "linear_bias_act" and readers[0].node in e.nodes), None)


def _one_dtype(m: Match, readers: list[Linear]) -> bool:
    """The norm's input, its output and every projection's weight share one dtype: the
    fused GEMM reads x and writes in x's dtype (a norm upcast to fp32 ahead of 16-bit
    projections is no such site)."""
    tensors = [m.operands["x"], m.outputs["y"], *(lin.weight for lin in readers)]
    dtypes = {t.dtype if t is not None else None for t in map(fake, tensors)}
    return len(dtypes) == 1 and None not in dtypes


def find_norm_swiglus(norm_projections: list[Match], swiglus: list[Match]) -> list[Match]:
    """RMSNorm → gate and up projections → act(gate)·up: a norm-projection site whose two
    linears are exactly a gate_up_swiglu site's — one GEMM with the norm in its prologue
    and SwiGLU in its epilogue (kernels/rmsnorm_swiglu.py)."""
    found = []
    for np_ in norm_projections:
        linears = list(np_.outputs.values())
        if np_.kernel != "rmsnorm_linear" or len(linears) != 2 \
                or any(b is not None for b in np_.operands["biases"]):
            continue  # (gemm_swiglu's gate and up have no bias)
        for sw in swiglus:
            if not all(lin in sw.nodes for lin in linears):
                continue
            operands = {**np_.operands, "weights": list(sw.operands["weights"]),  # [gate, up]
                        "activation": sw.operands["activation"]}
            found.append(Match(np_.family.replace("_linear", "_swiglu"), "rmsnorm_swiglu", np_.module,
                               tuple(dict.fromkeys([*np_.nodes, *sw.nodes])), operands, dict(sw.outputs)))
    return found


# Views that keep the elements they read in row order: what may stand between a norm and
# the (M, K) rows its projections read (a transpose or permute would order them otherwise
# than the kernel's x.reshape(-1, K)). A slice or select may read some rows only:
# `_every_row` keeps those that read all (`hidden[:, -1:]` before lm_head at one token).
_ROW_VIEWS = (*RESHAPE_OPS, aten.alias.default, aten.detach.default, aten.unsqueeze.default,
              aten.squeeze.dim, aten.squeeze.default, aten.slice.Tensor, aten.select.int)


def _views_to(y: fx.Node, x2ds: set[fx.Node], direct: Collection[fx.Node] = ()) -> list[fx.Node] | None:
    """The view nodes between `y` and the linears' (M, K) inputs `x2ds` when every reader of
    `y` leads, through row-order views only, to one of them (e.g. the `alias` a full-range
    `hidden[:, -0:]` before lm_head lowers to) or is one of the linears in `direct` (which
    read `y` as their (M, K) input); None when something else reads `y`."""
    between: list[fx.Node] = []
    for user in y.users:
        if user in x2ds or user in direct:
            continue
        if not is_op(user, *_ROW_VIEWS):
            return None
        deeper = _views_to(user, x2ds)
        if deeper is None:
            return None
        between += [user, *deeper]
    return between


def _sole_viewed_linear(pre: Any, params: dict[str, str]) -> Linear | None:
    """The linear whose (M, N) output `pre` views back to the input's leading dims, where
    that view is the linear's only reader (the caller checks who reads the view)."""
    if not (is_op(pre, aten.view.default, aten._unsafe_view.default)
            and isinstance(pre.args[0], fx.Node)):
        return None
    lin = linear_at(pre.args[0], params)
    return lin if lin is not None and len(lin.node.users) == 1 else None


def find_epilogues(gm: fx.GraphModule, params: dict[str, str]) -> list[Match]:
    """act(x·Wᵀ (+ b)) with the activation the linear's only reader, through the one `view`
    back to the input's leading dims (or directly, where the input is already (M, K) rows:
    OPT's MLP): one GEMM with the bias and activation in its epilogue (kernels/gemm.py
    `gemm_epilogue`); the result is viewed back with the same sizes. A bias-free
    projection whose activation is one factor of a product is left to the gated forms
    (act(g)·u: gated_act, gate_up_swiglu); without a product it is MPT's MLP, gelu(x·Wᵀ)."""
    found = []
    for node in gm.graph.nodes:
        act = activation_of(node)
        if act is None or not reads_only(act[1], act[2]):  # the act's ops alone read its input
            continue
        name, pre, nodes = act
        lin, view = _sole_viewed_linear(pre, params), [pre]
        if lin is None:
            lin, view = linear_at(pre, params), []  # the activation reads the (M, N) GEMM
        if lin is None or (lin.bias is None and _gates(node)):
            continue
        operands = {"x": lin.x2d, "weight": lin.weight, "bias": lin.bias, "activation": name,
                    "out_shape": pre.args[1] if view else None}
        found.append(Match("linear_bias_act", "gemm_epilogue", module_path(node),
                           (lin.node.args[-1], lin.node, *view, *nodes), operands, {"y": node}))
    return found


def _gates(act: fx.Node) -> bool:
    """act's value (through views) is one factor of a product of two tensors: act(g)·u."""
    for user in act.users:
        if is_op(user, *VIEW_OPS) and _gates(user):
            return True
        if is_op(user, aten.mul.Tensor) and all(isinstance(a, fx.Node) for a in user.args[:2]):
            return True
    return False


def find_residual_epilogues(gm: fx.GraphModule, params: dict[str, str]) -> list[Match]:
    """r + x·Wᵀ (+ b), the linear's output (through one view) read only by the add, r of the
    add's own shape and dtype (no broadcast): attention's o_proj and the MLP's down_proj
    writing into the residual stream. One GEMM that adds r in its epilogue
    (kernels/gemm.py `gemm_epilogue`, r read as (M, N) rows); the result is viewed back
    with the captured sizes. The add's other readers (the next add+norm) read the result."""
    found = []
    for node in gm.graph.nodes:
        if not is_op(node, aten.add.Tensor) or node.kwargs or len(node.args) != 2:
            continue
        for side in (0, 1):
            pre, r = node.args[side], node.args[1 - side]
            lin = _sole_viewed_linear(pre, params) if reads_only(pre, [node]) else None
            ty, tr = fake(node), fake(r) if isinstance(r, fx.Node) else None
            if lin is None or ty is None or tr is None or tr.shape != ty.shape or tr.dtype != ty.dtype:
                continue
            operands = {"x": lin.x2d, "weight": lin.weight, "bias": lin.bias, "activation": "none",
                        "residual": r, "out_shape": pre.args[1]}
            found.append(Match("linear_residual", "gemm_epilogue", module_path(lin.node),
                               (lin.node.args[-1], lin.node, pre, node), operands, {"y": node}))
            break
    return found


def find_gated_projections(gated: list[Match], params: dict[str, str],
                           residual_epilogues: list[Match]) -> list[Match]:
    """act(g)·u read only by one projection (through a reshape to (M, K)), with the
    residual add of its output when there is one: the MLP's down_proj. One op computes the
    product in the projection's prologue (kernels/gemm.py `gated_linear`) — at decode the
    GEMV reads g and u itself, and the product never reaches memory or costs a launch."""
    by_x2d = {e.operands["x"]: e for e in residual_epilogues}
    found = []
    for g in gated:
        y = g.outputs["y"]
        if len(y.users) != 1:
            continue
        x2d = next(iter(y.users))
        if not is_op(x2d, aten.view.default, aten._unsafe_view.default, aten.reshape.default):
            continue
        lins = [lin for u in x2d.users if (lin := linear_at(u, params)) is not None and lin.x2d is x2d]
        if len(lins) != 1 or len(x2d.users) != 1:
            continue
        lin = lins[0]
        operands = {**{k: g.operands[k] for k in ("gate", "up", "activation")},
                    "weight": lin.weight, "bias": lin.bias}
        e = by_x2d.get(x2d)
        if e is not None:  # ... + r: the add's value
            operands.update(residual=e.operands["residual"], out_shape=e.operands["out_shape"])
            nodes, outputs = (*g.nodes, x2d, *e.nodes), dict(e.outputs)
        else:  # the projection's (M, N) output itself
            operands.update(residual=None)
            nodes, outputs = (*g.nodes, x2d, lin.node.args[-1], lin.node), {"y": lin.node}
        found.append(Match("gated_act_linear", "gated_linear", module_path(lin.node), nodes,
                           operands, outputs))
    return found
