"""Attention and KV-cache patterns (analysis candidates; kernels come with the deep-fusion work).

Attention is SDPA in any of aten's lowered forms, or written out as
matmul → (scale) → (+ mask) → softmax → matmul. It is "attention_rope" when q and k come
straight from a RoPE site (RoPE can be applied as q/k are loaded). KV-cache writes are
index_copy/index_put into a cache buffer, "rope_kv_cache" when the written k is rotated.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from advisor.graph.capture import module_path
from advisor.graph.match import Match, aten, is_getitem, is_op, strip_views

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
    """matmul → [mul/div scale] → [add mask] → softmax → matmul, as nodes; else None."""
    chain, node = [softmax], softmax.args[0]
    while is_op(node, aten.mul.Tensor, aten.div.Tensor, aten.add.Tensor, *_VIEWS):
        chain.append(node)
        node = node.args[0]
    if not is_op(node, *MATMUL_OPS):
        return None
    out = next((u for u in softmax.users if is_op(u, *MATMUL_OPS)), None)
    return (node, *reversed(chain), out) if out is not None else None


_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.expand.default)


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
        if q is not None and strip_views(q) in rope_of:
            family, rope_nodes = "attention_rope", rope_of[strip_views(q)].nodes
        found.append(Match(family, None, module_path(node), (*rope_nodes, *nodes), {},
                           {"y": nodes[-1]}))
    return found


def find_cache_writes(gm: fx.GraphModule, ropes: list[Match]) -> list[Match]:
    rotated = {o for m in ropes for o in m.outputs.values()}
    found = []
    for node in gm.graph.nodes:
        if is_op(node, aten.index_copy.default, aten.index_copy_.default,
                 aten.index_put.default, aten.index_put_.default):
            src = node.args[3] if "index_copy" in str(node.target) else node.args[2]
            family = "rope_kv_cache" if strip_views(src) in rotated else "kv_cache_write"
            found.append(Match(family, None, module_path(node), (node,), {}, {"y": node}))
    return found
