"""Capture a model's whole forward as aten-level FX graphs (TorchDynamo + AOTAutograd).

Dynamo traces unmodified models (hand-written or `transformers`); AOTAutograd lowers each
traced piece to aten ops, where equivalent Python spellings already look alike
(`x.pow(2)`, `torch.pow(x, 2)` -> `aten.pow.Tensor_Scalar`; `nn.Linear` -> `t` + `mm`).
Nodes keep `meta["val"]` (fake tensors: shapes, dtypes) and `meta["nn_module_stack"]`
(module paths). The same capture serves `analyze` (candidates) and `apply` (rewrite).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from advisor.loader import Inputs, call


@dataclass
class GraphPart:
    """One dynamo graph (a graph break starts another), lowered to aten.

    gm:      the aten GraphModule; its placeholders are the dynamo graph's inputs in order.
    params:  placeholder name -> parameter/buffer FQN in the model (others are activations).
    """

    gm: fx.GraphModule
    params: dict[str, str] = field(default_factory=dict)


@dataclass
class Captured:
    parts: list[GraphPart]

    def nodes(self) -> list[tuple[GraphPart, fx.Node]]:
        return [(p, n) for p in self.parts for n in p.gm.graph.nodes]

def _param_names(model: torch.nn.Module) -> dict[int, str]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(dict(model.named_buffers(remove_duplicate=False)))
    return {id(t): name for name, t in named.items()}


def aten_backend(
    model: torch.nn.Module,
    on_graph: Callable[[fx.GraphModule, dict[str, str], list[Any]], Callable[..., Any]],
) -> Callable[..., Any]:
    """A dynamo backend that lowers each graph to aten and hands it to `on_graph`.

    `on_graph(gm, params, example_inputs)` returns the callable to run in its place. Dynamo
    passes parameters as graph inputs (real tensors), so identity maps them to names.
    """
    from torch._dynamo.backends.common import aot_autograd

    ids = _param_names(model)

    def backend(dynamo_gm: fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        names = [ids.get(id(x)) if isinstance(x, torch.Tensor) else None for x in example_inputs]

        def fw_compiler(gm: fx.GraphModule, aot_inputs: list[Any]) -> Callable[..., Any]:
            placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
            params = {}
            if len(placeholders) == len(names):
                params = {p.name: nm for p, nm in zip(placeholders, names) if nm is not None}
            return on_graph(gm, params, list(aot_inputs))

        # Input mutations (a KV cache written in place) stay in the graph as trailing
        # `copy_`s, which graph/inplace.py puts back in place (for analysis and runtime
        # alike), instead of AOTAutograd's wrapper copying them back outside the graph.
        return aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)(
            dynamo_gm, example_inputs)

    return backend


def capture(model: torch.nn.Module, inputs: Inputs) -> Captured:
    """Trace one forward of `model(*inputs)` and return its aten graphs (not executed
    faster: the graphs are run as-is)."""
    from advisor.graph.canonical import canonicalize  # imports graph.match, which imports us

    parts: list[GraphPart] = []

    def keep(gm: fx.GraphModule, params: dict[str, str], _ex: list[Any]) -> Callable[..., Any]:
        canonicalize(gm, params)  # the graph the runtime rewrites (runtime/rewrite.py)
        parts.append(GraphPart(gm=gm, params=params))
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model, backend=aten_backend(model, keep), dynamic=False)
    try:
        with torch.inference_mode():
            call(compiled, inputs)
    finally:
        torch._dynamo.reset()
    return Captured(parts=parts)


# the traced frame's locals: the module itself (`self`; `model` in apply's entry, which
# calls it; `fn` where dynamo traces a module without a forward of its own code, as
# nn.Sequential at the top) or the arguments it was handed
_PREFIX = re.compile(r"^L\['(?:self|model|fn|args|kwargs)'\](?:\[\d+\]|\['[^']*'\])?\.?")
_INDEX = re.compile(r"\[(\d+)\]")
_MODULES = re.compile(r"_modules\['([^']+)'\]")


def clean_path(raw: str) -> str:
    """`L['args'][0].model.layers[0].mlp` / `L['self']._modules['layers']...` -> `model.layers.0.mlp`."""
    path = _PREFIX.sub("", raw)
    path = _MODULES.sub(r"\1", path)
    path = _INDEX.sub(r".\1", path)
    return re.sub(r"\.+", ".", path).strip(".")


def module_path(node: fx.Node) -> str:
    """The innermost module that produced `node` ("" at the top level)."""
    stack: Mapping[str, Any] | None = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    raw = list(stack.values())[-1]
    raw = raw[0] if isinstance(raw, tuple) else raw
    return clean_path(str(raw))


def common_module(paths: list[str]) -> str:
    """Deepest common module path of several sites (`a.b.q`, `a.b.k` -> `a.b`)."""
    if not paths:
        return ""
    split = [p.split(".") if p else [] for p in paths]
    out = []
    for parts in zip(*split):
        if len(set(parts)) != 1:
            break
        out.append(parts[0])
    return ".".join(out)


def fake(node: Any) -> torch.Tensor | None:
    """The fake tensor a node produces, if it is a single tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val if isinstance(val, torch.Tensor) else None


def hint(size: Any) -> int:
    """A concrete example value for a (possibly symbolic) size. Never int() a SymInt: that
    installs a guard specialising the graph to this length (a recompile per length)."""
    if isinstance(size, torch.SymInt):
        return int(size.node.hint)
    return int(size)


def nbytes(node: Any) -> int:
    t = fake(node)
    if t is None:
        return 0
    return hint(t.numel()) * t.element_size()


def new_node(graph: fx.Graph, target: Any, args: tuple, kwargs: dict | None = None) -> fx.Node:
    return infer_meta(graph.call_function(target, args, kwargs or {}))


def infer_meta(node: fx.Node, like: fx.Node | None = None) -> fx.Node:
    """Give an inserted node what captured nodes have: its fake value (shape, dtype,
    strides, computed under the graph's fake mode) and the module path of `like`."""
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: n.meta.get("val"))
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(tensors)
    if mode is not None and callable(node.target):
        with mode:
            node.meta["val"] = node.target(*args, **kwargs)
    if like is not None and "nn_module_stack" in like.meta:
        node.meta["nn_module_stack"] = like.meta["nn_module_stack"]
    return node
