"""Snapshot and restore the tensors a forward may mutate (KV caches and other state).

A decode step writes its keys/values into the cache it is given. Verification and timing
run a step many times, so they restore the inputs' tensors to their snapshot before each
comparison: tuning and benchmarking leave the caller's state exactly as it was.
Tensors are found through lists/tuples/dicts and through plain objects' attributes (e.g.
a `transformers` StaticCache), without importing any library.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

MAX_DEPTH = 6


def objects_in(obj: Any, depth: int = 0, seen: set[int] | None = None) -> Iterator[Any]:
    """`obj` and everything reachable from it through lists/tuples/dicts and plain objects'
    attributes (not into tensors, modules or classes), each once, at most MAX_DEPTH deep."""
    seen = set() if seen is None else seen
    if depth > MAX_DEPTH or id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    if isinstance(obj, torch.Tensor):
        return
    if isinstance(obj, Mapping):
        children: Any = obj.values()
    elif isinstance(obj, (list, tuple)):
        children = obj
    elif hasattr(obj, "__dict__") and not isinstance(obj, (type, torch.nn.Module)):
        children = vars(obj).values()
    else:
        return
    for v in children:
        yield from objects_in(v, depth + 1, seen)


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    return (o for o in objects_in(obj) if isinstance(o, torch.Tensor))


class Snapshot:
    """Copies of every tensor reachable from `inputs`; `restore()` writes them back."""

    def __init__(self, inputs: Any):
        self.pairs = [(t, t.detach().clone()) for t in tensors_in(inputs)]

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.pairs:
                live.copy_(saved)

    def changed(self) -> bool:
        """True if any tensor differs from its snapshot (NaN-aware)."""
        return any(not torch.equal(live, saved) and not (
            live.is_floating_point() and torch.allclose(live, saved, rtol=0, atol=0, equal_nan=True))
            for live, saved in self.pairs)
