"""Snapshot and restore the state a forward may mutate (KV caches and their counters).

A decode step writes its keys/values into the cache it is given. Verification and timing
run a step many times, so they restore the inputs' state to their snapshot before each
comparison: tuning and benchmarking leave the caller's state exactly as it was.
Tensors are found through lists/tuples/dicts and through plain objects' attributes (e.g.
a `transformers` StaticCache), without importing any library; so are plain Python scalars
held in dicts, lists and objects' attributes: a cache may count in Python, not only in
tensors (transformers' StaticSlidingWindowLayer advances an int `cumulative_length_int`
every step and picks its update path from it).
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


_SCALARS = (bool, int, float, complex, str, bytes, type(None))


def scalar_slots(obj: Any) -> list[tuple[Any, Any, Any]]:
    """(holder, key, value) for each immutable scalar `obj` holds in a place that can be
    written back: a dict's values, a list's items, a plain object's attributes."""
    if isinstance(obj, dict):
        return [(obj, k, v) for k, v in obj.items() if isinstance(v, _SCALARS)]
    if isinstance(obj, list):
        return [(obj, i, v) for i, v in enumerate(obj) if isinstance(v, _SCALARS)]
    if (hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type, torch.nn.Module))
            and isinstance(vars(obj), dict)):
        return [(obj, name, v) for name, v in vars(obj).items() if isinstance(v, _SCALARS)]
    return []


def _put(holder: Any, key: Any, value: Any) -> None:
    if isinstance(holder, (dict, list)):
        holder[key] = value
    else:
        setattr(holder, key, value)


def _get(holder: Any, key: Any) -> Any:
    if isinstance(holder, dict):
        return holder.get(key)
    if isinstance(holder, list):
        return holder[key] if key < len(holder) else None
    return vars(holder).get(key)


class Snapshot:
    """Copies of every tensor reachable from `inputs`, and the scalars beside them;
    `restore()` writes them back."""

    def __init__(self, inputs: Any):
        objects = list(objects_in(inputs))
        self.pairs = [(t, t.detach().clone()) for t in objects if isinstance(t, torch.Tensor)]
        self.scalars = [slot for o in objects for slot in scalar_slots(o)]

    def restore(self) -> None:
        with torch.no_grad():
            for live, saved in self.pairs:
                live.copy_(saved)
        for holder, key, value in self.scalars:
            _put(holder, key, value)

    def changed_scalars(self) -> list[str]:
        """`Type.key` of every scalar that differs from its snapshot (NaN equals NaN)."""
        return [f"{type(holder).__name__}.{key}" for holder, key, value in self.scalars
                if _get(holder, key) != value and value == value]

    def changed(self) -> bool:
        """True if any tensor differs from its snapshot (NaN-aware), or any scalar."""
        return any(not torch.equal(live, saved) and not (
            live.is_floating_point() and torch.allclose(live, saved, rtol=0, atol=0, equal_nan=True))
            for live, saved in self.pairs) or bool(self.changed_scalars())
