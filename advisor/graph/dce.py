"""Dead-code elimination that does not depend on where it runs.

`fx.Graph.eliminate_dead_code` keeps random ops (`nondeterministic_seeded`: SDPA's flash
and efficient kernels, which take a dropout) as side effects, except inside a dynamo
tracing context, where it follows inductor's `fallback_random` and drops them. The
runtime rewrites inside `torch.compile`'s backend, the site probe outside it, so the same
fused attention site lost its dead SDPA (and repeat_kv's copies) in a forward but ran it
beside our kernel in the probe: attention was priced as a loss (H100, session 21: −8.7 µs
per layer at 1 token, where the family alone measured a gain of 1.5 µs). Here a dead node
is erased unless it writes something or has a registered effect; drawing random numbers
nobody reads is not kept (inference: only the generator's state would differ).
"""

from __future__ import annotations

import torch
from torch import fx


def removable(node: fx.Node) -> bool:
    """Nobody reads `node` and running it has no effect but its (random) result."""
    if node.op != "call_function" or node.users:
        return False
    try:
        return not node.is_impure(impure_random=False)
    except TypeError:  # a torch whose is_impure takes no argument (before ~2.9)
        pass
    target = node.target
    if (isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable
            and torch.Tag.nondeterministic_seeded in target.tags):
        return True
    return not node.is_impure()


def eliminate_dead(graph: fx.Graph) -> int:
    """Erase every `removable` node, readers before what they read; returns how many."""
    erased = 0
    for node in reversed(graph.nodes):
        if removable(node):
            graph.erase_node(node)
            erased += 1
    return erased


def settle(gm: fx.GraphModule, changed: int) -> int:
    """After a rewriting pass that changed `changed` things (0: nothing is done): erase what
    nobody reads any more, check the graph and regenerate its code. Returns `changed`."""
    if changed:
        eliminate_dead(gm.graph)
        gm.graph.lint()
        gm.recompile()
    return changed
