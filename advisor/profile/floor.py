"""The floor under one forward: what no kernel schedule can beat on this device.

    read floor    = (weight bytes read + live state bytes) ÷ measured copy bandwidth
    compute floor = FLOPs ÷ measured matmul FLOP/s (the model's dtype)
    floor         = max(read floor, compute floor)

Issue targets are stated against them (one-token and decode latency against the read floor,
long prefill against the compute floor), so `advisor bench` reports every variant's
latency as a multiple of the floor.

* weight bytes: every parameter once per forward, found by a dispatch pass over one real
  forward: a parameter read only through `aten.embedding` costs the rows gathered (an
  input-embedding table), any other read costs its whole storage (a tied lm_head reads the
  whole table).
* live state bytes (decode): floating tensors among the inputs that are not parameters (a
  KV cache); where a cache declares its capacity (`generate.cache_capacity`), a tensor
  with a dim of that size counts only the positions a step attends to, `context_len + 1`
  of them; a cache that declares none counts whole (what the step is handed, it reads).
* FLOPs: `profile.costs.op_costs` of one forward (matmuls, attention; pointwise ops at one
  FLOP per element, negligible beside them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from advisor.loader import Inputs, call
from advisor.profile.ceilings import Ceilings, dtype_name
from advisor.profile.costs import _storage, _tensors, op_costs
from advisor.state import tensors_in

aten = torch.ops.aten


@dataclass(frozen=True)
class Floor:
    weight_bytes: int  # parameters read per forward
    state_bytes: int  # live state (KV cache) read per forward
    flops: float  # per forward
    read_ms: float
    compute_ms: float

    @property
    def ms(self) -> float:
        return max(self.read_ms, self.compute_ms)

    def to_json(self) -> dict[str, Any]:
        return {"weight_bytes": self.weight_bytes, "state_bytes": self.state_bytes,
                "flops": self.flops, "read_ms": self.read_ms, "compute_ms": self.compute_ms,
                "floor_ms": self.ms}


class _ParamReads(TorchDispatchMode):
    """Bytes each parameter storage is read with: rows for embedding lookups, else all."""

    def __init__(self, params: dict[int, int]):
        super().__init__()
        self.params = params  # storage -> its bytes
        self.read: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.embedding.default:
            weight, indices = args[0], args[1]
            key = _storage(weight)
            if key in self.params:
                rows = indices.numel() * weight.shape[-1] * weight.element_size()
                self.read[key] = max(self.read.get(key, 0), min(rows, self.params[key]))
        else:
            for t in _tensors((args, kwargs)):
                key = _storage(t)
                if key in self.params:
                    self.read[key] = self.params[key]
        return func(*args, **kwargs)


def weight_bytes(model: torch.nn.Module, inputs: Inputs) -> int:
    """Parameter bytes one forward reads (embedding tables: the rows it gathers)."""
    params = {_storage(p): p.untyped_storage().nbytes() for p in model.parameters()}
    mode = _ParamReads(params)
    with torch.inference_mode(), mode:
        call(model, inputs)
    return sum(mode.read.values())


def state_bytes(model: torch.nn.Module, inputs: Inputs, context_len: int,
                capacity: int | None) -> int:
    """Bytes of the non-parameter floating tensors among `inputs` a step reads (see module doc)."""
    params = {_storage(p) for p in model.parameters()}
    total, seen = 0, set()
    for t in tensors_in(inputs):
        key = _storage(t)
        if not t.is_floating_point() or key in params or key in seen:
            continue
        seen.add(key)
        nbytes = t.numel() * t.element_size()
        if capacity and capacity in t.shape:
            nbytes = nbytes * min(context_len + 1, capacity) // capacity
        total += nbytes
    return total


def floor(model: torch.nn.Module, inputs: Inputs, ceilings: Ceilings, dtype: torch.dtype, *,
          decode: bool = False, context_len: int = 0, capacity: int | None = None) -> Floor:
    """The floor of one forward of `model` on `inputs` (run twice: mutated state, e.g. a
    KV cache written by the step, is the caller's to restore). Prefill reads no state."""
    w = weight_bytes(model, inputs)
    s = state_bytes(model, inputs, context_len, capacity) if decode else 0
    flops = sum(c.flops for c in op_costs(model, inputs))
    tflops = ceilings.matmul_tflops.get(dtype_name(dtype)) or ceilings.matmul_tflops["float32"]
    return Floor(weight_bytes=w, state_bytes=s, flops=flops,
                 read_ms=(w + s) / (ceilings.copy_gbps * 1e9) * 1e3,
                 compute_ms=flops / (tflops * 1e12) * 1e3)
