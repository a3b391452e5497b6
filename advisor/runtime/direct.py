"""Call fused kernels directly from rewritten graphs, bypassing the custom-op layer.

Rewritten graphs are built with the `torch.ops.advisor.*` custom ops (their fake
implementations give every inserted node its shape, dtype and strides). But our runtime
runs the aten graph as Python, where the custom-op layer costs ~55 µs of host time per
call on top of the ~10 µs launcher. So once a graph is final, each custom-op node is
pointed at the kernel's launcher (or its reference where Triton cannot run): the same
function the custom op would have reached, minus the dispatch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import fx

from advisor.kernels.registry import KernelSpec, all_kernels
from advisor.kernels.space import decode


def _direct(spec: KernelSpec) -> Callable[..., Any]:
    """op(*operands, config) -> spec.launch(*operands, config=...) or spec.reference(*operands)."""

    def call(*args: Any) -> Any:
        *operands, config = args
        if spec.can_launch(*operands):
            return spec.launch(*operands, config=decode(config) or None)
        return spec.reference(*operands)

    call.__name__ = f"advisor_{spec.name}"
    return call


def direct_targets() -> dict[Any, Callable[..., Any]]:
    from advisor.kernels.merged_linear import merged_linear_impl

    targets: dict[Any, Callable[..., Any]] = {torch.ops.advisor.merged_linear.default: merged_linear_impl}
    for name, spec in all_kernels().items():
        op = getattr(torch.ops.advisor, name, None)
        if op is not None and name != "merged_linear":
            targets[op.default] = _direct(spec)
    return targets


def use_direct_calls(gm: fx.GraphModule) -> None:
    """Point custom-op nodes at their direct implementations (in place) and recompile."""
    targets = direct_targets()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = targets[node.target]
    gm.recompile()
