"""Per-aten-op FLOPs and bytes of one forward, from a TorchDispatchMode pass.

Which ops are recorded: the ops that reach the Python dispatch key under
``torch.inference_mode``. Inference mode skips the Autograd keys, so CompositeImplicitAutograd
ops (``aten::linear``, ``aten::scaled_dot_product_attention``, ``aten::reshape``) arrive
*undecomposed* -- exactly the profiler's top-level aten ops, with the same names
("aten::linear"), so trace rows join on (module, op, index). A composite op's cost is the
sum over its decomposition (``linear`` -> ``t`` + ``mm``), found by re-entering the mode
around ``func.decompose`` as FlopCounterMode does; a backend op's internals (``aten::mean``
calling ``aten::sum``) are not seen, as they launch no kernel of their own.

Costs per op:

* ``flops``: ``torch.utils.flop_counter``'s formula registry for matmul / conv /
  attention (2·M·N·K for ``mm``); the CPU SDPA op, absent from that registry, uses
  4·B·H·Tq·Tk·D (QKᵀ and PV, causal masking ignored, as the registry does); 1 FLOP per
  output element for pointwise ops and per input element for reductions / norms; else 0.
* ``bytes``: memory touched by the tensor inputs plus the tensor outputs, each counted
  as its strided span (so a broadcast ``expand`` input costs its storage, not its
  logical size), capped at ``numel·itemsize``.
* views (any op whose outputs alias an input without writing it: ``view``, ``t``,
  ``transpose``, ``expand``, ``slice``, ``_unsafe_view``, ...) cost 0 FLOPs, 0 bytes and
  ``launches=0``.

Example::

    >>> import torch
    >>> from advisor.profile.costs import op_costs
    >>> lin = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    >>> [(c.op, c.module, c.flops) for c in op_costs(lin, (torch.randn(8, 64),)) if c.flops]
    [('aten::linear', '0', 32768.0)]
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from advisor.loader import Inputs, call

__all__ = ["OpCost", "op_costs", "module_hooks"]

# Reductions and norms: ~1 FLOP per element read. Data, not code (HTA style).
_REDUCTIONS = frozenset({
    "sum", "mean", "amax", "amin", "max", "min", "prod", "var", "std", "var_mean", "std_mean",
    "norm", "linalg_vector_norm", "_softmax", "_log_softmax", "softmax", "log_softmax",
    "logsumexp", "cumsum", "argmax", "argmin", "any", "all", "native_layer_norm",
    "native_group_norm", "_native_batch_norm_legit_no_training", "_fused_rms_norm", "rms_norm",
})

# Data movement that is tagged pointwise but computes nothing.
_COPIES = frozenset({"copy_", "clone", "_to_copy", "fill_", "zero_", "lift_fresh_copy"})


@dataclass(frozen=True)
class OpCost:
    """Cost of one call of one aten op in one forward."""

    op: str  # profiler spelling: "aten::mm"
    module: str  # innermost module path, "layers.0.attention.wq"; "" at the top
    index: int  # occurrence of `op` within `module`, in call order, from 0
    flops: float  # floating-point operations
    bytes: int  # bytes touched: tensor inputs + tensor outputs
    dtype: str  # dtype of the first tensor output ("float32"), else of the first input
    launches: int  # 1 for a computing op, 0 for a view (no kernel, no traffic)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside nested tuples / lists / dicts, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item)


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches for `t`: its strided span, capped at numel·itemsize."""
    if t.numel() == 0:
        return 0
    try:
        span = 1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1)
    except (RuntimeError, NotImplementedError):  # layouts without strides (sparse, nested)
        span = t.numel()
    return min(span, t.numel()) * t.element_size()


def _storage(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None


def _is_view(func: Any, ins: list[torch.Tensor], outs: list[torch.Tensor]) -> bool:
    """Outputs alias an input and nothing is written (schema or storage sharing)."""
    rets = func._schema.returns
    if any(r.alias_info is not None and r.alias_info.is_write for r in rets):
        return False  # in-place / out= op: it writes memory
    if rets and all(r.alias_info is not None for r in rets):
        return True
    in_storages = {_storage(t) for t in ins} - {None, 0}
    return bool(outs) and all(_storage(t) in in_storages for t in outs)


def _sdpa_flops(args: tuple[Any, ...]) -> float:
    """4·B·H·Tq·Tk·D for an attention op taking (query, key, value, ...), (B, H, T, D)."""
    q, k, v = args[0], args[1], args[2]
    rows = math.prod(q.shape[:-1])  # B·H·Tq
    return float(2 * rows * k.shape[-2] * q.shape[-1] + 2 * rows * k.shape[-2] * v.shape[-1])


def _flops(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any,
           ins: list[torch.Tensor], outs: list[torch.Tensor]) -> float:
    from torch.utils.flop_counter import flop_registry

    formula = flop_registry.get(func._overloadpacket)
    if formula is not None:
        try:
            return float(formula(*args, **kwargs, out_val=out))
        except Exception:  # a formula that does not fit this overload: count nothing
            return 0.0
    name = func._schema.name.split("::")[-1]
    if "scaled_dot_product" in name and "attention" in name and "backward" not in name:
        return _sdpa_flops(args)
    if torch.Tag.pointwise in func.tags and outs and name not in _COPIES:
        return float(outs[0].numel())
    if name in _REDUCTIONS and ins:
        return float(ins[0].numel())
    return 0.0


class _CostMode(TorchDispatchMode):
    """Records one OpCost per op that reaches the Python dispatch key.

    Under inference_mode, CompositeImplicitAutograd ops (``aten::linear``,
    ``aten::scaled_dot_product_attention``, ``aten::reshape``) arrive undecomposed, as the
    profiler's top-level ops do. Their cost is the sum over their decomposition (what
    actually runs), found by re-entering this mode around ``func.decompose`` -- the same
    device FlopCounterMode uses.
    """

    def __init__(self, where: list[str]) -> None:
        super().__init__()
        self.where = where  # module path stack, maintained by forward hooks
        self.counts: dict[tuple[str, str], int] = defaultdict(int)
        self.costs: list[OpCost] = []
        self.nested: list[list[tuple[float, int, int]]] = []  # sub-op costs per open op

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None):
        from torch.utils.flop_counter import flop_registry

        kwargs = kwargs or {}
        if getattr(func, "_schema", None) is None:  # not an aten overload (higher-order op)
            return func(*args, **kwargs)
        out: Any = NotImplemented
        self.nested.append([])
        try:
            if func._overloadpacket not in flop_registry:
                with self:
                    out = func.decompose(*args, **kwargs)
            subs = self.nested[-1]
        finally:
            self.nested.pop()
        if out is NotImplemented:  # a leaf: it has its own kernel
            out = func(*args, **kwargs)
            cost = _leaf_cost(func, args, kwargs, out)
        else:  # composite: flops, bytes and launches of its decomposition
            flops, nbytes, launches = (sum(col) for col in zip(*subs, strict=True)) if subs else (
                0.0, 0, 0)
            cost = (float(flops), int(nbytes), int(launches))
        if self.nested:
            self.nested[-1].append(cost)
        else:
            self._record(func, args, kwargs, out, cost)
        return out

    def _record(self, func: Any, args: Any, kwargs: Any, out: Any,
                cost: tuple[float, int, int]) -> None:
        op, module = func._schema.name, self.where[-1]
        index = self.counts[(module, op)]
        self.counts[(module, op)] += 1
        first = next(_tensors(out), None)
        first = first if first is not None else next(_tensors((args, kwargs)), None)
        self.costs.append(OpCost(
            op=op, module=module, index=index, flops=cost[0], bytes=cost[1],
            dtype=str(first.dtype).removeprefix("torch.") if first is not None else "",
            launches=cost[2],
        ))


def _leaf_cost(func: Any, args: Any, kwargs: Any, out: Any) -> tuple[float, int, int]:
    """(flops, bytes, launches) of an op that runs its own kernel; views are free."""
    ins, outs = list(_tensors((args, kwargs))), list(_tensors(out))
    if _is_view(func, ins, outs):
        return (0.0, 0, 0)
    flops = _flops(func, args, kwargs, out, ins, outs)
    return (flops, sum(_span_bytes(t) for t in ins + outs), 1)


class module_hooks:  # noqa: N801 -- used as a context manager, like torch's own
    """Forward pre/post hooks on every submodule calling `enter(path)` / `exit(path)`.

    Paths are `model.named_modules()` names; the root is not hooked. Hooks are removed on
    exit, also when the forward raised; the post hook runs even when a forward raises.
    """

    def __init__(self, model: torch.nn.Module, enter: Any, exit: Any) -> None:
        self.model, self.enter, self.exit = model, enter, exit
        self.handles: list[Any] = []

    def __enter__(self) -> module_hooks:
        for path, mod in self.model.named_modules():
            if not path:
                continue
            self.handles.append(mod.register_forward_pre_hook(
                lambda _m, _a, p=path: self.enter(p)))
            self.handles.append(mod.register_forward_hook(
                lambda _m, _a, _o, p=path: self.exit(p), always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()


def op_costs(model: torch.nn.Module, inputs: Inputs) -> list[OpCost]:
    """FLOPs and bytes of every aten op of one forward of `model(*inputs)`, in call order."""
    where = [""]

    def enter(path: str) -> None:
        where.append(path)

    def leave(path: str) -> None:
        if len(where) > 1:
            where.pop()

    mode = _CostMode(where)
    with torch.inference_mode(), module_hooks(model, enter, leave), mode:
        call(model, inputs)
    return mode.costs
