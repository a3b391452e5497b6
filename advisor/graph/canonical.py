"""The graph as the patterns match it: the same passes for analysis (graph/capture.py) and
for the runtime's rewrite (runtime/rewrite.py), so both find the same sites."""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from advisor.graph.copies import drop_identity_copies
from advisor.graph.cse import merge_repeated_views
from advisor.graph.inplace import write_inputs_in_place


@dataclass(frozen=True)
class Canonical:
    in_place_writes: int  # input (KV cache) updates put back in place
    identity_copies_dropped: int  # eval dropout's clones and cats of one value
    views_merged: int  # one view of one tensor taken twice


def canonicalize(gm: fx.GraphModule) -> Canonical:
    """Rewrite `gm` in place into the form the patterns expect; idempotent."""
    # a cache update: one small scatter, not two full copies
    in_place = write_inputs_in_place(gm)
    # before the view merge: a dropped copy's readers now read its input's views
    copies = drop_identity_copies(gm)
    return Canonical(in_place, copies, merge_repeated_views(gm))
