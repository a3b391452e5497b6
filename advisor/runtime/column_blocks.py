"""Where a site's inputs live once the GEMMs producing them are merged: column blocks.

A merge (qkv_merge, gate_up_merge: one GEMM over [W_q; W_k; W_v]) and a norm folded into
several projections (rmsnorm_linear, layernorm_linear) write one (M, ΣN) result, and each former output is a
column block of it (runtime/emit.py `_slice_columns`): whatever reads q, k, v or gate, up
then reads a strided view (row stride ΣN, not N). Eager elementwise kernels lose their
contiguous, vectorised path there, and a fused kernel's loads may change too, so a site's
saving depends on whether its producers are merged. H100, session 21, 512 tokens: the merge
of gate/up measured alone (unfused SwiGLU reading the blocks) −0.051 ms, inside the plan
(our SwiGLU kernel reading them) +0.095 ms; SwiGLU's own saving 0.074 ms alone and 0.249 ms
left out of the plan: the eager act·mul on blocks costs ~0.15 ms more over 8 layers.

The site probe (runtime/site_probe.py) times such sites a second time with those inputs
as column blocks of one random (M, ΣN) buffer per producer, through the same views the
graph takes from the GEMM's output to the site (a view, a head split, a transpose).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from advisor.graph.capture import fake, hint
from advisor.graph.cse import view_chain
from advisor.graph.match import Match

# kernels whose emitter returns column blocks of one (M, ΣN) result (runtime/emit.py)
COLUMN_BLOCK_KERNELS = ("merged_linear", "rmsnorm_linear", "layernorm_linear")


@dataclass(frozen=True)
class ColumnBlock:
    """A GEMM output (M, cols) that the families in `by` turn into columns
    [start, start + cols) of one (M, width) result; `group` names the merged result (its
    first member's node), so the blocks of one merge share a buffer."""

    by: tuple[str, ...]
    group: str
    width: int
    start: int
    cols: int


def column_blocks(matches: Iterable[Match]) -> dict[fx.Node, ColumnBlock]:
    """GEMM output node -> its block, for every site of a column-block kernel among
    `matches` with two or more members (one member writes a plain result)."""
    out: dict[fx.Node, ColumnBlock] = {}
    for m in matches:
        weights = m.operands.get("weights") or []
        outs = [m.outputs.get(f"out{i}") for i in range(len(weights))]
        if m.kernel not in COLUMN_BLOCK_KERNELS or len(weights) < 2 or None in outs:
            continue
        cols = [int(fake(w).shape[0]) for w in weights]
        start = 0
        for node, n in zip(outs, cols):
            old = out.get(node)
            by = tuple(sorted({m.family, *(old.by if old else ())}))
            out[node] = ColumnBlock(by, outs[0].name, sum(cols), start, n)
            start += n
    return out


def blocks_read(inputs: list[fx.Node], bases: dict[fx.Node, fx.Node],
                blocks: dict[fx.Node, ColumnBlock]) -> dict[int, ColumnBlock]:
    """Indices of a site's inputs that are (views of) a producer's column block, with it;
    an input reached from the GEMM's output through anything but views is left out."""
    out = {}
    for i, n in enumerate(inputs):
        base = bases.get(n, n)
        if base in blocks and view_chain(n, base) is not None:
            out[i] = blocks[base]
    return out


def as_in_block(node: fx.Node, base: fx.Node, block: ColumnBlock, buffer: torch.Tensor) -> torch.Tensor:
    """`node`'s value read from its column block of `buffer` ((M, width)): the block as a
    strided (M, cols) view, then the views the graph takes from the GEMM's output to `node`
    replayed on it. Raises where a view cannot take the strided block."""
    value, prev = buffer[:, block.start:block.start + block.cols], base
    for v in view_chain(node, base) or []:
        args = [value if a is prev else _concrete(a) for a in v.args]
        value, prev = v.target(*args, **{k: _concrete(a) for k, a in v.kwargs.items()}), v
    return value


def _concrete(a: Any) -> Any:
    """An argument with its sizes made concrete (SymInt nodes and values: their hints)."""
    if isinstance(a, fx.Node):
        val = a.meta.get("val")
        if isinstance(val, (int, torch.SymInt)):
            return hint(val)
        raise ValueError(f"view argument {a.name} is not a size")
    if isinstance(a, (list, tuple)):
        return type(a)(_concrete(x) for x in a)
    return hint(a) if isinstance(a, torch.SymInt) else a
