"""The graph as the patterns match it: the same passes for analysis (graph/capture.py) and
for the runtime's rewrite (runtime/rewrite.py), so both find the same sites."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from torch import fx

from advisor.graph.copies import drop_full_slices, drop_identity_copies
from advisor.graph.cse import merge_repeated_tables
from advisor.graph.head_products import head_products_as_matmuls
from advisor.graph.inplace import write_inputs_in_place
from advisor.graph.linear_forms import products_as_linears


@dataclass(frozen=True)
class Canonical:
    in_place_writes: int  # input (KV cache) updates put back in place
    identity_copies_dropped: int  # eval dropout's clones and cats of one value
    repeats_merged: int  # tables, positions, masks and views computed twice
    products_as_linears: int  # einsum's projections, now nn.Linear's mm(x, t(W))
    head_products: int  # einsum's products over heads (attention), now matmul's form


def canonicalize(gm: fx.GraphModule, params: Mapping[str, str]) -> Canonical:
    """Rewrite `gm` in place into the form the patterns expect (`params`: placeholder ->
    weight name); idempotent."""
    # a cache update: one small scatter, not two full copies
    in_place = write_inputs_in_place(gm)
    # before the view merge: a dropped copy's readers now read its input's views
    copies = drop_identity_copies(gm)
    drop_full_slices(gm)
    # before the merge: it tells a weight (what no repeat is merged into) by the GEMMs reading it
    products = products_as_linears(gm, dict(params))
    heads = head_products_as_matmuls(gm)
    return Canonical(in_place, copies, merge_repeated_tables(gm, params), products, heads)
