"""RoPE + KV-cache write: rotate q and k, and write the rotated k and v into the cache, in
one launch (kernels/rope.py `rope_qk_cache`).

Matched on graphs whose cache update is in place again (graph/inplace.py):

    q_rot, k_rot = rope(q, k, cos, sin)          # a rope_qk site (patterns/rope.py)
    index_copy_(k_cache, 2, pos, k_rot)          # k_rot read by nothing else (or by a
                                                 # copy of it: graph/copies.py)
    index_copy_(v_cache, 2, pos, v)              # same positions, v shaped like k

with both caches graph inputs (B, Hkv, S, D). This is what `transformers`' StaticCache and
hand-written static caches do at every decode step; the fused op saves the k write/read
round trip and two launches per layer. Readers of the updated caches read the cache
inputs themselves after the fused op (it writes them in place).
"""

from __future__ import annotations

from typing import Any

from torch import fx

from advisor.graph.capture import fake, hint, module_path
from advisor.graph.copies import through_copies
from advisor.graph.match import Match, aten, is_op


def _writes_by_position(gm: fx.GraphModule) -> dict[fx.Node, list[fx.Node]]:
    """positions -> in-place `index_copy_(cache, 2, positions, source)` nodes into graph inputs."""
    out: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        if is_op(n, aten.index_copy_.default) and n.args[1] in (2, -2) and n.args[0].op == "placeholder":
            out.setdefault(n.args[2], []).append(n)
    return out


def _same_shape(a: Any, b: Any) -> bool:
    ta, tb = fake(a), fake(b)
    return ta is not None and tb is not None and ta.shape == tb.shape and ta.dtype == tb.dtype


def find(gm: fx.GraphModule, ropes: list[Match]) -> list[Match]:
    by_pos = _writes_by_position(gm)
    # the rotated k each write stores, through copies of it (graph/copies.py)
    stored = {w: through_copies(w.args[3]) for ws in by_pos.values() for w in ws}
    found = []
    for r in ropes:
        if "pairs" in r.operands or "seq_dim" in r.operands:  # operands the rope emitter prepares
            continue
        k_rot = r.outputs["k"]
        k_write = next((w for w, (src, _) in stored.items() if src is k_rot), None)
        if k_write is None or len(k_rot.users) != 1:
            continue
        k_copies = stored[k_write][1]
        writes = by_pos[k_write.args[2]]
        pos, k_cache = k_write.args[2], k_write.args[0]
        tc = fake(k_cache)
        # v: written at the same positions into another cache of the same shape, shaped like k
        v_write = next((w for w in writes if w.args[0] is not k_cache and _same_shape(w.args[0], k_cache)
                        and _same_shape(w.args[3], r.operands["k"])), None)
        if v_write is None or tc is None or tc.dim() != 4:
            continue
        operands = {**r.operands, "v": v_write.args[3], "k_cache": k_cache, "v_cache": v_write.args[0],
                    "cache_position": pos, "slots": hint(tc.shape[2])}
        found.append(Match("rope_kv_cache", "rope_qk_cache", r.module or module_path(k_write),
                           (*r.nodes, *k_copies, k_write, v_write), operands,
                           {"q": r.outputs["q"], "k_cache": k_write, "v_cache": v_write}))
    return found
