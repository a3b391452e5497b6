"""Attention and KV-cache patterns.

Attention is SDPA in any of aten's lowered forms, or written out as
matmul → (scale) → (softcap) → (+ mask | masked_fill) → softmax → matmul (transformers'
eager attention, Gemma 2, hand-written models): `find_fusable` reads both as one site of
the attention kernel (`_sdpa_site`, `_explicit_site`). It is "attention_rope" when q and k
come straight from a RoPE site (RoPE can be applied as q/k are loaded). KV-cache writes are
index_copy/index_put into a cache buffer, "rope_kv_cache" when the written k is rotated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.experimental.symbolic_shapes import statically_known_true

from advisor.graph.capture import fake, hint, module_path
from advisor.graph.copies import is_full_slice, through_copies
from advisor.graph.match import CAST_OPS, Match, aten, is_getitem, is_op, known, strip_views
from advisor.kernels.masks import MASKED_BIAS

SDPA_OPS = tuple(
    getattr(aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
        "scaled_dot_product_attention",
    )
    if hasattr(aten, name)
)
MATMUL_OPS = (aten.bmm.default, aten.mm.default, aten.matmul.default)


def _explicit_attention(softmax: fx.Node) -> tuple[fx.Node, ...] | None:
    """matmul → [mul/div scale] → [softcap: div, tanh, mul] → [+ mask, masked_fill, where]
    → [cast] → softmax → [cast] → matmul, as nodes; else None. On 4-D tensors `@` is expand
    → view → bmm on both sides of the softmax."""
    chain, node = [softmax], softmax.args[0]
    while is_op(node, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, aten.sub.Tensor,
                aten.tanh.default, aten.masked_fill.Scalar, aten.cat.default, *_FLOORS,
                *_WHERE, *_VIEWS, *CAST_OPS):
        chain.append(node)
        node = scores_in(node)
    if not is_op(node, *MATMUL_OPS, aten.baddbmm.default):
        return None
    after, cur = [], softmax
    while (out := next((u for u in cur.users if is_op(u, *MATMUL_OPS)), None)) is None:
        if len(cur.users) != 1 or not is_op(nxt := next(iter(cur.users)), *_VIEWS, *CAST_OPS,
                                            aten.clone.default, aten.slice.Tensor):
            return None
        after.append(nxt)
        cur = nxt
    return (node, *reversed(chain), *after, out)


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.expand.default)


def scores_in(node: fx.Node) -> Any:
    """The scores an op of the chain reads: where(cond, scores, fill)'s second argument,
    cat([scores, sinks])'s first tensor, the first argument of any other."""
    if is_op(node, *_WHERE):
        return node.args[1]
    if is_op(node, aten.cat.default):
        return node.args[0][0] if node.args[0] else None
    return node.args[0]


def find(gm: fx.GraphModule, ropes: list[Match]) -> list[Match]:
    rope_of = {o: m for m in ropes for o in m.outputs.values()}
    found: list[Match] = []
    for node in gm.graph.nodes:
        nodes: tuple[Any, ...] | None = None
        if is_op(node, *SDPA_OPS):
            nodes = (node, *[u for u in node.users if is_getitem(u)])
            q = node.args[0]
        elif is_op(node, aten._softmax.default, aten.softmax.int):
            nodes = _explicit_attention(node)
            q = None
        if not nodes:
            continue
        family, rope_nodes = "attention", ()
        q_src, q_copies = through_copies(strip_views(q))
        if q is not None and q_src in rope_of:
            family, rope_nodes = "attention_rope", (*rope_of[q_src].nodes, *q_copies)
        found.append(Match(family, None, module_path(node), (*rope_nodes, *nodes), {},
                           {"y": nodes[-1]}))
    return found


def find_cache_writes(gm: fx.GraphModule, ropes: list[Match], fusable: Sequence[Match] = ()) -> list[Match]:
    """Cache writes no runnable match (patterns/cache.py, in `fusable`) already holds."""
    rotated = {o for m in ropes for o in m.outputs.values()}
    held = {n for m in fusable for n in m.nodes}
    found = []
    for node in gm.graph.nodes:
        if node not in held and is_op(node, aten.index_copy.default, aten.index_copy_.default,
                                      aten.index_put.default, aten.index_put_.default):
            src = node.args[3] if "index_copy" in str(node.target) else node.args[2]
            family = "rope_kv_cache" if through_copies(strip_views(src))[0] in rotated else "kv_cache_write"
            found.append(Match(family, None, module_path(node), (node,), {}, {"y": node}))
    return found


def sdpa_args(node: fx.Node) -> dict[str, Any]:
    """An SDPA node's arguments by schema name (query, key, value, attn_mask | attn_bias,
    dropout_p, is_causal, scale), whichever of aten's SDPA forms the backend chose."""
    return bind_args(node.target, node.args, node.kwargs)


def positional_names(op: Any) -> list[str]:
    """An aten op's positional argument names, in order."""
    return [a.name for a in op._schema.arguments if not a.kwarg_only]


def bind_args(op: Any, args: tuple, kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """An aten op's call arguments (nodes or values) by schema name, defaults filled in."""
    out = {a.name: a.default_value for a in op._schema.arguments if a.has_default_value()}
    out.update(zip(positional_names(op), args))
    out.update(kwargs)
    return out


def _full_slice(node: Any) -> bool:
    return is_full_slice(node) and len(node.users) == 1


def unrepeat_kv(node: Any) -> tuple[Any, list[fx.Node]]:
    """GQA's repeat_kv, as traced: view(clone(expand(unsqueeze(x, 2), (B, Hkv, n, T, D))),
    (B, Hkv·n, T, D)), with no-op slices anywhere below the clone. From one kv head (MQA,
    e.g. Gemma-2B) the view of the expand needs no copy and the clone is not there.
    Returns (x, chain nodes), or (node, []) when not repeated."""
    chain, cur = [], node
    for ops in ((aten.view.default, aten._unsafe_view.default), (aten.clone.default,),
                (aten.expand.default,), (aten.unsqueeze.default,)):
        while chain and _full_slice(cur):
            chain.append(cur)
            cur = cur.args[0]
        if ops == (aten.clone.default,) and is_op(cur, aten.expand.default):
            continue  # no copy: the view reads the expand (one kv head)
        if not is_op(cur, *ops) or (chain and len(cur.users) != 1):
            return node, []
        chain.append(cur)
        cur = cur.args[0]
    if chain[-1].args[1] != 2 or not _merges_heads(chain):  # unsqueeze(x, 2)
        return node, []
    while _full_slice(cur):
        chain.append(cur)
        cur = cur.args[0]
    return cur, chain


def _merges_heads(chain: list[fx.Node]) -> bool:
    """The chain's view makes (B, Hkv·n, T, D) of its (B, Hkv, n, T, D) expand: each kv
    head's n copies side by side, as repeat_kv lays them out (unknown shapes: trusted)."""
    expand = next(n for n in chain if is_op(n, aten.expand.default))
    out, big = fake(chain[0]), fake(expand)
    if out is None or big is None:
        return True
    if out.dim() != 4 or big.dim() != 5:
        return False
    b, hkv, n, t, d = (hint(s) for s in big.shape)
    return tuple(hint(s) for s in out.shape) == (b, hkv * n, t, d)


# Ops that keep a tensor's elements in order and only add, drop or broadcast size-1 dims
# (and reshape): the positions read through them are the positions in (batch, query) order.
_ORDER_KEEPING = (aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                  aten.unsqueeze.default, aten.expand.default, aten.squeeze.dim,
                  aten.squeeze.default, aten.alias.default)
# The positions' side takes no expand: its elements must be the score rows' own, in order.
_POSITION_VIEWS = tuple(op for op in _ORDER_KEEPING if op is not aten.expand.default)
_ARANGE = (aten.arange.default, aten.arange.start, aten.arange.start_step)
_WHERE = tuple(getattr(aten.where, o) for o in ("self", "ScalarSelf", "ScalarOther", "Scalar")
               if hasattr(aten.where, o))


def _through(node: Any, ops: tuple) -> tuple[Any, list[fx.Node]]:
    """Follow `ops` (and no-op slices, which dynamic-shape traces keep) to their source."""
    chain = []
    while is_op(node, *ops) or _full_slice(node):
        chain.append(node)
        node = node.args[0]
    return node, chain


def _constant(node: Any) -> tuple[float | None, list[fx.Node]]:
    """A python number, or a `scalar_tensor` / `full` of one, or a one-element tensor
    constant made in forward (and the nodes)."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return float(node), []
    if is_op(node, aten.scalar_tensor.default):
        value = node.args[0]
    elif is_op(node, aten.full.default):
        value = node.args[1]
    elif is_op(node, aten.lift_fresh_copy.default) and isinstance(node.args[0], fx.Node) \
            and node.args[0].op == "get_attr":  # torch.tensor(x) in forward (GPT-Neo's mask value)
        held = getattr(node.graph.owning_module, str(node.args[0].target), None)
        if not isinstance(held, torch.Tensor) or held.numel() != 1 or held.is_meta:
            return None, []
        with unset_fake_temporarily():  # matching may run inside the tracer's fake mode
            value = held.item()
    else:
        return None, []
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None, []
    dtype = node.kwargs.get("dtype")
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:  # as the graph holds it:
        with unset_fake_temporarily():  # GPT-2's full([], √20, dtype=bf16) is 4.46875
            value = torch.tensor(value, dtype=dtype).item()
    return float(value), [node]


def _same(a: Any, b: Any) -> bool:
    """a == b for every size the graph may see (symbolic sizes compared without a guard)."""
    a, b = (x.meta.get("val") if isinstance(x, fx.Node) else x for x in (a, b))
    if not all(isinstance(x, (int, torch.SymInt)) for x in (a, b)):
        return False
    return bool(statically_known_true(a == b)) if isinstance(a == b, torch.SymBool) else a == b


def _key_index(node: Any, tk: Any) -> list[fx.Node] | None:
    """node = views of arange(Tk) (+ 0): each key's own index along the last dim."""
    base, chain = _through(node, _ORDER_KEEPING)
    t = fake(node)
    if t is None or t.dim() < 1 or not _same(t.shape[-1], tk) or not _same(t.numel(), tk):
        return None
    if is_op(base, aten.add.Tensor) and base.args[1] == 0:
        chain.append(base)
        base = base.args[0]
    if not is_op(base, *_ARANGE):
        return None
    start, end, step = ((0, base.args[0], 1) if base.target is aten.arange.default else
                        (*base.args[:2], base.args[2] if len(base.args) > 2 else 1))
    return [*chain, base] if _same(start, 0) and _same(end, tk) and _same(step, 1) else None




def _position_mask(mask: Any, b: Any, tq: Any, tk: Any) -> tuple[fx.Node, list[fx.Node]] | None:
    """A static KV cache's causal mask, computed from integer positions P: key j visible to
    query i iff j <= P[b, i] — bool, or as where(visible, 0, bias <= MASKED_BIAS). Returns
    (P, the mask's nodes) when `mask` is exactly that, else None."""
    nodes: list[fx.Node] = []
    tm = fake(mask)
    if tm is None:
        return None
    if is_op(mask, *_WHERE):
        (keep, k_nodes), (drop, d_nodes) = _constant(mask.args[1]), _constant(mask.args[2])
        if keep != 0.0 or drop is None or not tm.dtype.is_floating_point or drop > MASKED_BIAS:
            return None
        nodes, mask = [mask, *k_nodes, *d_nodes], mask.args[0]
    elif tm.dtype != torch.bool:
        return None
    cmp, views = _through(mask, _ORDER_KEEPING)
    nodes += views
    if is_op(cmp, aten.le.Tensor):
        keys, pos = cmp.args[:2]
    elif is_op(cmp, aten.ge.Tensor):
        pos, keys = cmp.args[:2]
    else:
        return None
    key_nodes = _key_index(keys, tk)
    base, pos_views = _through(pos, _POSITION_VIEWS)
    tp, tb = fake(pos), fake(base)
    if key_nodes is None or tp is None or tb is None or tb.dtype not in (torch.int32, torch.int64):
        return None
    # one position per score row, broadcast along heads and keys: (B|1, 1, Tq, 1)
    shape = tp.shape
    if len(shape) != 4 or not (_same(shape[1], 1) and _same(shape[3], 1) and _same(shape[2], tq)) \
            or not (_same(shape[0], 1) or _same(shape[0], b)):
        return None
    return base, [*nodes, cmp, *key_nodes, *pos_views]


# _safe_softmax: SDPA's math backend as traced (a row with every score -inf gives 0, as
# the kernel's does)
SOFTMAX_OPS = (aten._softmax.default, aten.softmax.int,
               *((aten._safe_softmax.default,) if hasattr(aten, "_safe_softmax") else ()))


@dataclass
class _Scores:
    """What an attention does to its scores between q·kᵀ and the softmax."""

    scale: float | None = None  # None: 1/√D (SDPA's default)
    softcap: float = 0.0        # cap·tanh(s / cap) (Gemma 2), 0: none
    mask: Any = None            # additive mask node
    drop: Any = None            # bool node where scores are dropped (masked_fill, where)
    keeps: bool = False         # drop's True marks the scores kept (where(cond, s, v))
    drop_value: float = 0.0     # what a dropped score becomes: -inf, or DROPPED for a finite fill
    mask_after_drop: bool = False  # the mask is added to dropped scores too (GPT-Neo)
    sinks: Any = None           # (Hq,) node: a logit per head with no value (GPT-OSS)
    heads_bias: Any = None      # (B·H, 1|Tq, Tk) node added to q·kᵀ·scale first (BLOOM's ALiBi)
    # constants read (a fill value, a scale made as a tensor): in the site, so confirmation
    # runs them as they are, and kept for any other reader
    constants: list[fx.Node] = field(default_factory=list)
    side: list[fx.Node] = field(default_factory=list)  # nodes beside the chain (a row max)


@dataclass(frozen=True)
class _Site:
    """One attention, however spelled: its inputs as read (k, v maybe repeated for GQA),
    what it does to the scores, its own nodes and its output y (B, Hq, Tq, D)."""

    q: fx.Node
    k: fx.Node
    v: fx.Node
    causal: bool
    scores: _Scores
    nodes: tuple[fx.Node, ...]
    y: fx.Node


def _sdpa_site(node: fx.Node) -> _Site | None:
    """An SDPA node that the kernel computes: no dropout, only its first output read."""
    a = sdpa_args(node)
    items = [u for u in node.users if is_getitem(u)]
    y = next((u for u in items if u.args[1] == 0), None)
    if a.get("dropout_p", 0.0) or y is None or any(u.users for u in items if u is not y):
        return None
    scores = _Scores(scale=a.get("scale"), mask=a.get("attn_mask", a.get("attn_bias")))
    return _Site(a["query"], a["key"], a["value"], bool(a.get("is_causal", False)), scores,
                 (node, *items), y)


def _bmm_source(node: Any) -> tuple[Any, list[fx.Node]]:
    """A batched matmul's operand back to the 4-D (B, H, T, D) tensor it was made of: `@` on
    4-D tensors reads [expand] → [clone] → view (B·H, T, D) of it (nothing, for a matmul
    not decomposed). (None, []) when the operand is not that."""
    chain = []
    for ops in ((aten.view.default, aten._unsafe_view.default, aten.reshape.default),
                (aten.clone.default,), (aten.expand.default,)):
        t = fake(node)
        if is_op(node, *ops) and (ops[0] is not aten.view.default or (t is not None and t.dim() == 3)):
            if ops[0] is aten.view.default:
                if (t4 := fake(node.args[0])) is None or t4.dim() != 4 or not all(
                        _same(a, b) for a, b in zip(t.shape, (t4.shape[0] * t4.shape[1], *t4.shape[2:]))):
                    return None, []  # (B, H·T, D) or another grouping: no (B·H)-row view
            chain.append(node)
            node = node.args[0]
    t = fake(node)
    return (node, chain) if t is not None and t.dim() == 4 else (None, [])


def _number(node: Any) -> float | None:
    return float(node) if isinstance(node, (int, float)) and not isinstance(node, bool) else None


def _explicit_site(softmax: fx.Node) -> _Site | None:
    """softmax(cap(q·kᵀ · scale) + mask) · v written out (transformers' eager attention,
    Gemma 2's soft-capping, GPT-Neo's and GPT-J's where(causal, s, min), MPT's bias then
    masked_fill, hand-written models): matmul → view → ops on the scores → [casts] →
    softmax over the last dim → [casts] → matmul → view (B, H, Tq, D). The ops, in any order
    that computes the same (`_read_scores`): casts; mul/div by numbers (the scale); div c →
    tanh → mul c (the softcap); + an additive mask; one drop by masked_fill(cond, v) or
    where(cond, s, v); GPT-OSS's sinks as a last column (cat, minus the row max, dropped by
    [..., :-1] after the softmax). q and k upcast to fp32 from the output's dtype are read
    before the cast (exact: the kernel multiplies them with fp32 accumulation)."""
    nodes = _explicit_attention(softmax)
    t = fake(softmax)
    if nodes is None or t is None or t.dim() not in (3, 4) or softmax.args[1] not in (-1, t.dim() - 1):
        return None
    if t.dim() == 3 and not (is_op(nodes[0], aten.bmm.default) and is_op(nodes[-1], aten.bmm.default)):
        return None  # (B·H, Tq, Tk) scores: bmm of (B·H)-row operands on both sides
    if any(scores_in(n) is not prev for prev, n in zip(nodes, nodes[1:])):
        return None  # a chain op that reads the scores as another operand (mask + scores)
    mm1, mm2 = nodes[0], nodes[-1]
    scores = _read_scores(list(nodes[1:nodes.index(softmax)]))
    if scores is None:
        return None
    post = nodes[nodes.index(softmax) + 1:-1]  # between the softmax and P·V
    dropped = [n for n in post if is_op(n, aten.slice.Tensor)]
    if len(dropped) != (scores.sinks is not None) or any(not _drops_last_column(n) for n in dropped):
        return None  # the sink's column is dropped after the softmax, and nothing else is
    y = mm2
    if is_op(mm2, aten.bmm.default):
        views = [u for u in mm2.users if is_op(u, aten.view.default, aten._unsafe_view.default)]
        if len(mm2.users) != 1 or not views:
            return None
        y = views[0]
    qk_operands = mm1.args[:2]  # q and kᵀ as the first product reads them
    if is_op(mm1, aten.baddbmm.default):
        if not _read_baddbmm(mm1, scores):
            return None
        qk_operands = mm1.args[1:3]
    q_rows, c_rows, rows_own = _peel_rows(qk_operands[0])  # a scale, an upcast of 3-D q rows
    (q, q_chain), (kt, kt_chain) = _bmm_source(q_rows), _bmm_source(qk_operands[1])
    v, v_chain = _bmm_source(mm2.args[1])
    k_direct = _transposed_rows(qk_operands[1]) if kt is None else None  # kᵀ of (B·H, T, D) rows
    if k_direct is not None:
        kt, kt_chain, ck_rows = k_direct
        c_rows *= ck_rows
    if q is None or kt is None or v is None:
        return None
    (q, cq, q_scale), (kt, ck, k_scale) = _scaled(q), _scaled(kt)
    cq *= c_rows
    q_chain = [*rows_own, *q_chain]
    if k_direct is None and not _swaps_last_two(kt):
        return None
    if scores.heads_bias is not None and not _same(fake(scores.heads_bias).shape[0],
                                                    fake(q).shape[0] * fake(q).shape[1]):
        return None  # the bias must be one (1|Tq, Tk) slice per batch and head
    if t.dim() == 3 and not _masks_of_rows(scores, nodes, fake(q)):
        return None  # a per-(B·H) mask on 3-D scores is no (B|1, H|1, Tq, Tk) one
    scores.scale *= cq * ck
    product = y  # P·V as (B, H, Tq, D)
    down = _downcast(y)  # the math backend's fp32 result, cast back to q's dtype
    y = down[0] if down else y
    k, ty = (kt if k_direct is not None else kt.args[0]), fake(y)
    (q, q_up), (k, k_up), (v, v_up) = (_before_upcast(x, ty) for x in (q, k, v))
    tq, tv = fake(q), fake(v)
    if ty is None or tq is None or tv is None or not _same_heads(q, y) \
            or not known(ty.shape[-1] == tv.shape[-1]) or not ty.dtype == tq.dtype == tv.dtype:
        return None  # out is (B, H, Tq, Dv): q's rows, v's head dim
    own = (*q_up, *q_scale, *q_chain, *k_up, *([] if k_direct else [kt]), *k_scale, *kt_chain,
           *nodes, *v_up, *v_chain,
           *([product] if product is not mm2 else []), *down, *scores.side, *scores.constants)
    return _Site(q, k, v, False, scores, tuple(dict.fromkeys(own)), y)


def _masks_of_rows(scores: _Scores, chain: tuple[fx.Node, ...], tq: Any) -> bool:
    """Whether the mask and the drop of (B·H, Tq, Tk) scores mean the same against the
    (B, H, Tq, Tk) ones the kernel computes, read through a view that broadcasts one along
    the rows (`m.unsqueeze(0).expand(B·H, Tq, Tk)`: the (1, Tq, Tk) before the expand kept in
    `scores`; an expand other nodes read too, as CSE leaves one shared by layers, is no
    site: the site would have to own it). A mask
    is that when it is heads-free, or when it is applied to a 4-D view of the scores with q's
    (B, H) as its leading dims (BART-style: `s.view(B, H, Tq, Tk) + mask`, viewed back)."""
    for name in ("mask", "drop"):
        x = getattr(scores, name)
        if x is None:
            continue
        at = next((n for n in chain if x in n.args), None)
        ts = fake(at) if at is not None else None
        if ts is not None and ts.dim() == 4 and tq is not None and tq.dim() == 4 \
                and _same(ts.shape[0], tq.shape[0]) and _same(ts.shape[1], tq.shape[1]):
            continue  # a (B|1, H|1, Tq, Tk) mask of the 4-D scores
        source, views = x, []
        while is_op(source, aten.expand.default) and len(source.users) == 1:
            views.append(source)  # the broadcast along the rows; what it broadcasts must be
            source = source.args[0]  # (1, Tq|1, Tk|1) or <= 2-D: unsqueeze(1) of (B·H, Tk) is not
        if not _heads_free(source):
            return False
        setattr(scores, name, source)  # the kernel reads the rows' mask, not its broadcast
        scores.side += views  # the site's own: nothing else reads them
    return True


def _heads_free(x: Any) -> bool:
    """x (a mask of (B·H, Tq, Tk) scores) is None or broadcast along B·H: at most 2-D, or
    (1, Tq|1, Tk|1) — it then means the same against (B, H, Tq, Tk)."""
    t = fake(x) if isinstance(x, fx.Node) else None
    return x is None or (t is not None and (t.dim() <= 2 or (t.dim() == 3 and known(t.shape[0] == 1))))


def _read_baddbmm(mm: fx.Node, scores: _Scores) -> bool:
    """baddbmm(b, q, kᵀ, beta=1, alpha=α) = b + α·q·kᵀ (BLOOM: b its ALiBi, (B·H, 1, Tk);
    GPT-NeoX-Japanese: zeros) into `scores`: α joins the scale; b, unless zeros, is the
    `heads_bias` added before anything else. False where the kernel would compute otherwise:
    beta ≠ 1 on a bias, a scale or cap after it (it would scale the bias), a drop (the bias
    is not read where it drops)."""
    b = mm.args[0]
    beta, alpha = mm.kwargs.get("beta", 1), mm.kwargs.get("alpha", 1)
    if not isinstance(alpha, (int, float)) or not isinstance(beta, (int, float)) or alpha == 0:
        return False
    scale_after, scores.scale = scores.scale, scores.scale * alpha
    if is_op(b, aten.zeros.default) or (is_op(b, aten.full.default) and _constant(b)[0] == 0.0):
        scores.constants.append(b)  # confirmation runs it as it is (CSE shares one)
        return True
    tb = fake(b)
    if (beta != 1 or tb is None or tb.dim() != 3 or scale_after != 1.0 or scores.softcap
            or scores.drop is not None):
        return False
    scores.heads_bias = b
    return True


def _transposed_rows(kt: Any) -> tuple[fx.Node, list[fx.Node], float] | None:
    """kᵀ as `k.reshape(B·H, T, D).transpose(-1, -2)` (BLOOM, XGLM), the rows maybe scaled
    or upcast (`_peel_rows`): (the 4-D k, the nodes between, the scale), else None."""
    t = fake(kt)
    if not is_op(kt, aten.transpose.int) or t is None or t.dim() != 3 \
            or sorted(int(d) % 3 for d in kt.args[1:]) != [1, 2] or len(kt.users) != 1:
        return None
    rows, c, peeled = _peel_rows(kt.args[0])
    k, chain = _bmm_source(rows)
    return (k, [kt, *peeled, *chain], c) if k is not None else None


def _peel_rows(x: Any) -> tuple[Any, float, list[fx.Node]]:
    """(B·H, T, D) rows of q or k before a product by a constant and an upcast to fp32 from
    fp16/bf16, in either order (`q3 * d**-0.5`, `q3.float()`): (the rows, the constant, the
    nodes). The upcast is exact to drop: the kernel multiplies 16-bit q and k with fp32
    accumulation (the output dtype is checked against q's after)."""
    c, nodes = 1.0, []
    for _ in range(2):
        t = fake(x)
        if t is None or t.dim() != 3:
            break
        src, cx, scaled = _scaled(x)
        if scaled:
            x, c, nodes = src, c * cx, [*nodes, *scaled]
            continue
        ts = fake(x.args[0]) if is_op(x, *CAST_OPS) else None
        if ts is None or len(x.users) != 1 or t.dtype != torch.float32 \
                or ts.dtype not in (torch.float16, torch.bfloat16):
            break
        nodes.append(x)
        x = x.args[0]
    return x, c, nodes


def _scaled(x: Any) -> tuple[Any, float, list[fx.Node]]:
    """x · c (or x / c) by a constant, read only there: SDPA's math backend scales q and kᵀ
    by √scale each before their product. (x, c, [the op, its constant's nodes]), or
    (x, 1.0, []) when x is not so scaled."""
    if is_op(x, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar) and len(x.users) == 1:
        c, nodes = _constant(x.args[1])
        if c is not None and c != 0 and math.isfinite(c):
            return x.args[0], c if is_op(x, aten.mul.Tensor, aten.mul.Scalar) else 1 / c, [x, *nodes]
    return x, 1.0, []


def _downcast(y: fx.Node) -> tuple[fx.Node, ...]:
    """(the cast, the view between) when y's only reader casts an fp32 y to fp16/bf16 (through
    one view): the attention computed in fp32 from upcast inputs, rounded once; else ()."""
    chain, node = [], y
    if len(node.users) == 1 and is_op(nxt := next(iter(node.users)), *_VIEWS):
        chain, node = [nxt], nxt
    cast = next(iter(node.users)) if len(node.users) == 1 else None
    t, tc = fake(y), fake(cast) if cast is not None else None
    if not is_op(cast, *CAST_OPS) or t is None or tc is None or t.dtype != torch.float32 \
            or tc.dtype not in (torch.float16, torch.bfloat16):
        return ()
    return (cast, *chain)


def _read_scores(ops: list[fx.Node]) -> _Scores | None:
    """What the ops between q·kᵀ and the softmax (in order) do to the scores; None where
    the kernel computes something else: a scale or a cap after an additive mask (it would
    scale the mask), a cap after a drop (cap(-inf) = -cap keeps the score) or after another
    cap, two masks or two drops, a scale, cap or mask after the sinks' column, anything
    else."""
    out = _Scores(scale=1.0)
    i = 0
    while i < len(ops):
        n = ops[i]
        if is_op(n, *_VIEWS, *CAST_OPS):
            i += 1
            continue
        if (stable := _minus_row_max(n)) is not None:  # softmax(x - max x) = softmax(x)
            out.side += stable
            i += 1
            continue
        if is_op(n, *_FLOORS):  # max(s, finfo.min) (XGLM), s.clamp(min=…): masked scores floored
            floor, f_nodes = _constant(n.args[1]) if len(n.args) > 1 else (None, [])
            if floor is None or floor > MASKED_FLOOR or n.kwargs or (
                    is_op(n, aten.clamp.default) and len(n.args) > 2 and n.args[2] is not None):
                return None  # no floor, one that changes real scores, or a ceiling too
            # a row whose every key is masked is then all floor: uniform. So it is in the
            # kernel for a finite mask and for a drop by DROPPED, not for a -inf mask
            if out.mask is not None and not _finite_values(out.mask):
                return None
            if out.drop is not None:
                out.drop_value = DROPPED
            out.constants += f_nodes
            i += 1
            continue
        if out.sinks is not None:
            return None  # a scale, cap or mask after the sink's column would change it
        if is_op(n, aten.cat.default):
            found = _sink_column(n)
            if found is None:
                return None
            out.sinks, views = found
            out.side += views
            i += 1
            continue
        # a number, or a scalar_tensor / full of one (GPT-2's / torch.full([], √d))
        c, c_nodes = _constant(n.args[1]) if is_op(n, aten.mul.Tensor, aten.div.Tensor) else (None, [])
        if is_op(n, aten.div.Tensor) and i + 2 < len(ops) and is_op(ops[i + 1], aten.tanh.default):
            back = _number(ops[i + 2].args[1]) if is_op(ops[i + 2], aten.mul.Tensor) else None
            if (c is None or back is None or c <= 0 or abs(back - c) > 1e-6 * c or out.softcap
                    or out.mask is not None or out.drop is not None):
                return None
            out.softcap, i = c, i + 3
            continue
        if c is not None:
            if out.mask is not None or out.softcap or c == 0 or (out.drop is not None and c < 0):
                return None  # the mask scaled, the cap bent, a dropped score brought back
            out.scale *= c if n.target == aten.mul.Tensor else 1 / c
            out.constants += c_nodes
        elif (is_op(n, aten.add.Tensor) and isinstance(n.args[1], fx.Node) and out.mask is None
              and n.kwargs.get("alpha", 1) == 1):
            out.mask, out.mask_after_drop = n.args[1], out.drop is not None
        elif out.drop is None and (dropped := _drop_cond(n)) is not None:
            out.drop, value, v_nodes = dropped
            out.keeps = is_op(n, *_WHERE)
            # a positive scale after it leaves -inf -inf and a finite value far below s
            out.drop_value = value if value == float("-inf") else DROPPED
            out.constants += v_nodes
        else:
            return None
        i += 1
    return out


def _finite_values(x: Any, depth: int = 0, into: Any = None) -> bool:
    """Whether x's values are finite by construction: a constant, zeros / ones / full of
    one, where / masked_fill choosing between such values (HF's additive masks: where(keep,
    0, finfo.min)), through views and casts that do not narrow the range — each constant
    within the range of the dtype it is written in (`into`: the reader's, for a where's
    scalars: fp32's finfo.min written into fp16 is -inf)."""
    t = fake(x) if isinstance(x, fx.Node) else None
    dtypes = [d for d in (t.dtype if t is not None else None, into)
              if isinstance(d, torch.dtype) and d.is_floating_point]

    def fits(c: Any) -> bool:
        c = _number(c) if not isinstance(c, fx.Node) else _constant(c)[0]
        return c is not None and math.isfinite(c) and all(abs(c) <= torch.finfo(d).max for d in dtypes)

    if depth > 12:
        return False
    if is_op(x, aten.zeros.default, aten.ones.default, aten.zeros_like.default, aten.ones_like.default):
        return True
    if not isinstance(x, fx.Node) or is_op(x, aten.scalar_tensor.default, aten.lift_fresh_copy.default):
        return fits(x)
    if is_op(x, aten.full.default):
        return fits(x.args[1])
    if is_op(x, *CAST_OPS):
        src = fake(x.args[0])
        return (src is not None and t is not None and src.dtype.is_floating_point
                and t.dtype.is_floating_point and torch.finfo(src.dtype).max <= torch.finfo(t.dtype).max
                and _finite_values(x.args[0], depth + 1))
    if is_op(x, *_VIEWS, aten.unsqueeze.default, aten.slice.Tensor, aten.clone.default,
             aten.reshape.default, aten.triu.default, aten.tril.default):  # values of x, or 0
        return _finite_values(x.args[0], depth + 1)
    if is_op(x, aten.where.self):
        return all(_finite_values(a, depth + 1, t.dtype if t is not None else into) for a in x.args[1:3])
    if is_op(x, aten.masked_fill.Scalar):
        return fits(x.args[2]) and _finite_values(x.args[0], depth + 1)
    return False


# max(s, c) (or a clamp with min c) with c at most this (fp32's and bf16's finfo.min) leaves
# every score a model computes and floors only masked ones, which add nothing to a softmax;
# a row of only masked keys is then all c in eager, and all c in the kernel too, since
# s + c rounds to c in fp32. fp16's finfo.min (-65504) does not swamp s in the kernel's fp32
# (eager's fp16 rounds it away): no site
MASKED_FLOOR = -1e30
_FLOORS = (aten.maximum.default, aten.clamp_min.default, aten.clamp.default)


# What a finite drop (finfo.min, -1e9, fp16's -65504; scaled after the drop or not) becomes
# in the kernel's mask: eager gives every dropped score exactly that value, so a row with
# every key dropped averages v; the kernel adds the mask to s·scale, and only a value that
# leaves nothing of s (fp32 ulp at 1e38 is 1e31) makes such rows uniform too (a review's
# case: -1e5 left softmax(s) there). Finite, above the kernel's -2e38 floor.
DROPPED = -1e38


def _minus_row_max(n: fx.Node) -> list[fx.Node] | None:
    """sub(x, max(x, -1, keepdim=True)) (max.dim's values, or amax): the max's nodes."""
    if not is_op(n, aten.sub.Tensor) or n.kwargs.get("alpha", 1) != 1 or not isinstance(n.args[1], fx.Node):
        return None
    x, m = n.args[0], n.args[1]
    if is_getitem(m) and m.args[1] == 0 and is_op(m.args[0], aten.max.dim):
        top, nodes = m.args[0], [m, m.args[0]]
        dims, keep = [top.args[1]], top.args[2] if len(top.args) > 2 else top.kwargs.get("keepdim")
    elif is_op(m, aten.amax.default):
        top, nodes = m, [m]
        dims, keep = list(m.args[1]), m.args[2] if len(m.args) > 2 else m.kwargs.get("keepdim")
    else:
        return None
    t = fake(x)
    ok = top.args[0] is x and keep and t is not None and [int(d) % t.dim() for d in dims] == [t.dim() - 1]
    return nodes if ok and all(len(u.users) == 1 for u in nodes) else None


def _sink_column(cat: fx.Node) -> tuple[Any, list[fx.Node]] | None:
    """cat([scores, sinks viewed (1, Hq, 1, 1) and expanded (B, Hq, Tq, 1)], -1): (the
    (Hq,) sinks, the views between)."""
    parts, dim = cat.args[0], cat.args[1] if len(cat.args) > 1 else 0
    t = fake(cat)
    if len(parts) != 2 or t is None or int(dim) % t.dim() != t.dim() - 1:
        return None
    src, views = parts[1], []
    while is_op(src, aten.expand.default, aten.view.default, aten.reshape.default,
                aten._unsafe_view.default, aten.unsqueeze.default) and len(src.users) == 1:
        views.append(src)
        src = src.args[0]
    ts, tc = fake(src), fake(parts[1])
    if ts is None or tc is None or ts.dim() != 1 or not _same(tc.shape[-1], 1) \
            or not _same(ts.shape[0], t.shape[1]):
        return None
    return src, views


def _drops_last_column(n: fx.Node) -> bool:
    """probs[..., :-1]: the sink's column dropped."""
    t = fake(n.args[0])
    dim, start = int(n.args[1]) if len(n.args) > 1 else 0, n.args[2] if len(n.args) > 2 else 0
    end = n.args[3] if len(n.args) > 3 else None
    if t is None or dim % t.dim() != t.dim() - 1 or start not in (0, None):
        return False
    return end == -1 or (end is not None and _same(end, t.shape[-1] - 1))


def _drop_cond(n: fx.Node) -> tuple[Any, float, list[fx.Node]] | None:
    """(the bool cond, v, v's nodes) of masked_fill(s, cond, v) or where(cond, s, v) with v ≤ MASKED_BIAS
    (a dropped score), else None. A finite v is kept: a row with every score dropped
    averages v in eager (all scores equal), where -inf gives 0 here and NaN there."""
    if is_op(n, aten.masked_fill.Scalar):
        cond, (value, nodes) = n.args[1], (_number(n.args[2]), [])
    elif is_op(n, *_WHERE):
        cond, (value, nodes) = n.args[0], _constant(n.args[2])
    else:
        return None
    t = fake(cond)
    ok = value is not None and value <= MASKED_BIAS and t is not None and t.dtype == torch.bool
    return (cond, value, nodes) if ok else None


def _before_upcast(x: Any, like: Any) -> tuple[Any, list[fx.Node]]:
    """x, or what x upcast to fp32 from `like`'s dtype (and the cast)."""
    src = x.args[0] if is_op(x, *CAST_OPS) else None
    t, ts = fake(x), fake(src) if src is not None else None
    if like is not None and t is not None and ts is not None and t.dtype == torch.float32 \
            and ts.dtype == like.dtype and ts.dtype in (torch.float16, torch.bfloat16):
        return src, [x]
    return x, []


def find_fusable(gm: fx.GraphModule, ropes: list[Match]) -> list[Match]:
    """SDPA sites the attention kernel can replace: with the RoPE that feeds q and k folded
    in ("attention_rope", deeper) and without it ("attention"); GQA k/v un-repeated; a
    static cache's causal mask read as the positions it is computed from (`q_pos`: the
    mask is never built or read, keys past the position are never loaded)."""
    rope_of = {o: m for m in ropes for o in m.outputs.values()}

    def rotated(node: Any) -> tuple[Any, list[fx.Node]]:
        """(the value the kernel may rotate on load, the nodes between): through copies of
        a rotation (a partial rotary's cat with nothing passed), and the transpose from a
        RoPE done in (B, T, H, D) (gpt-fast, Meta's reference)."""
        src, copies = through_copies(node)
        inner = src.args[0] if _swaps_dims_1_2(src) and len(src.users) == 1 else None
        if inner in rope_of and rope_of[inner].operands.get("seq_dim") == 1:
            return inner, [*copies, src]
        return src, copies

    found = []
    for node in gm.graph.nodes:
        if is_op(node, *SDPA_OPS) and node.target != aten.scaled_dot_product_attention.default:
            site = _sdpa_site(node)
        elif is_op(node, *SOFTMAX_OPS):
            site = _explicit_site(node)
        else:
            continue
        if site is None:
            continue
        sc = site.scores
        mask = sc.mask
        tq, tk = fake(site.q), fake(site.k)
        if tq is None or tk is None:
            continue
        if site.causal and not known(tq.shape[2] == tk.shape[2]):
            continue  # SDPA's is_causal aligns top-left (query i sees keys j <= i), the kernel's
            # causal bottom-right (j <= i + Tk - Tq, a KV cache's): the same only when Tq == Tk
        # the static cache's causal mask: the kernel bounds each row's keys by its position
        positions = None if mask is None or sc.drop is not None else _position_mask(
            mask, tq.shape[0], tq.shape[2], tk.shape[2])
        q_pos, mask_nodes = positions if positions is not None else (None, [])
        tm = fake(mask) if positions is None and mask is not None else None
        if tm is not None and tm.dtype == torch.bool:  # SDPA's keep-where-True masks: the
            continue  # kernel adds biases (a written-out drop is made one at emit)
        mask = None if positions is not None else mask
        y = site.y
        k, k_chain = unrepeat_kv(site.k)
        v, v_chain = unrepeat_kv(site.v)
        # v's head dim may differ from k's (MLA: DeepSeek-V2/V3, MiniCPM3; DiffLlama's doubled v)
        if not _same_heads(k, v):  # one repeated and the other not (DiffLlama's v): both as read
            (k, k_chain), (v, v_chain) = (site.k, []), (site.v, [])
        if not _same_heads(k, v):
            continue
        scale = sc.scale or 1.0 / math.sqrt(int(tq.shape[-1]))
        base = (*mask_nodes, *k_chain, *v_chain, *site.nodes)
        common = {"v": v, "mask": mask, "causal": site.causal, "scale": float(scale),
                  "interleaved": False, "q_pos": q_pos, "softcap": sc.softcap, "sinks": sc.sinks,
                  # made one additive mask with `mask` at emit (emit.py `_additive_mask`)
                  **({"drop": sc.drop, "drop_keeps": sc.keeps, "drop_value": sc.drop_value,
                      "mask_after_drop": sc.mask_after_drop} if sc.drop is not None else {}),
                  # (B·H, 1|Tq, Tk), added to the mask at emit (emit.py `_heads_bias`)
                  **({"heads_bias": sc.heads_bias} if sc.heads_bias is not None else {})}
        if q_pos is not None:  # confirmation draws positions among the keys (rewrite.py)
            common["keys"] = hint(tk.shape[2])
        # the kernel rotates q and k as it loads them: the RoPE's operands are the site's
        (q_rot, q_copies), (k_rot, k_copies) = rotated(site.q), rotated(k)
        rm = rope_of.get(q_rot)
        seq_dim = rm.operands.get("seq_dim", 2) if rm is not None else 2
        if (rm is not None and rm.outputs.get("q") is q_rot and rm.outputs.get("k") is k_rot
                and (seq_dim == 1) == bool(q_copies and _swaps_dims_1_2(q_copies[-1]))
                and (seq_dim == 1) == bool(k_copies and _swaps_dims_1_2(k_copies[-1]))):
            operands = {**common, **{n: rm.operands[n] for n in ("q", "k", "cos", "sin", "interleaved")},
                        # per-pair tables, (B, T, H, D): the emitter prepares them (emit.py)
                        **{n: rm.operands[n] for n in ("pairs", "seq_dim") if n in rm.operands}}
            found.append(Match("attention_rope", "attention", module_path(node),
                               (*rm.nodes, *q_copies, *k_copies, *base), operands, {"y": y},
                               (*rm.shared, *mask_nodes, *sc.constants)))
        operands = {**common, "q": site.q, "k": k, "cos": None, "sin": None}
        found.append(Match("attention", "attention", module_path(node), base, operands, {"y": y},
                           (*mask_nodes, *sc.constants)))
    return found


def _same_heads(k: Any, v: Any) -> bool:
    """k (B, H, T, D) and v (B, H, T, Dv) agree in all but the head dim (or q and out)."""
    tk, tv = fake(k), fake(v)
    return (tk is not None and tv is not None and tk.dim() == tv.dim() == 4
            and all(known(a == b) for a, b in zip(tk.shape[:3], tv.shape[:3])))


def _swaps(node: Any, a: int, b: int) -> bool:
    """`x.transpose(a, b)` or the permute that swaps dims a < b of a 4-D x."""
    t = fake(node)
    if t is None or t.dim() != 4:
        return False
    if is_op(node, aten.transpose.int):
        return sorted(int(d) % 4 for d in node.args[1:]) == [a, b]
    order = [0, 1, 2, 3]
    order[a], order[b] = b, a
    return is_op(node, aten.permute.default) and [int(d) % 4 for d in node.args[1]] == order


def _swaps_dims_1_2(node: Any) -> bool:
    """`x.transpose(1, 2)` or `x.permute(0, 2, 1, 3)`: (B, T, H, D) <-> (B, H, T, D)."""
    return _swaps(node, 1, 2)


def _swaps_last_two(node: Any) -> bool:
    """`x.transpose(-2, -1)` or `x.permute(0, 1, 3, 2)`: kᵀ."""
    return _swaps(node, 2, 3)


def not_covered(analysis: list[Match], fusable: list[Match]) -> list[Match]:
    """Analysis-only attention sites the kernel cannot take (bool masks, dropout, explicit
    forms it does not read): those whose SDPA or softmax node no fusable match holds."""
    held = {n for m in fusable for n in m.nodes if is_op(n, *SDPA_OPS, *SOFTMAX_OPS)}
    return [m for m in analysis if not held & set(m.nodes)]
