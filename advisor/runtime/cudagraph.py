"""CUDA graphs per bucket, one per exact input shape, bounded.

A plan with `cuda_graph: true` replays a captured graph instead of issuing each kernel
from Python. Graphs are keyed by the input shapes: within a bucket every distinct length
gets its own graph (no padding, so outputs are exactly the unfused model's), at most
`max_graphs` per bucket (least recently used are dropped); a shape past that runs
without a graph. Outputs are cloned out of the graph's static buffers so that a later
replay cannot overwrite what the caller holds, except large matmul outputs (a prefill's
logits), which run after the replay into fresh memory instead (`outside_graph.py`).

Inputs the forward writes in place (a KV cache passed as tensors) are state, not data:
the warm-up runs on clones and tells them apart (their version counter moves), and the
graph is captured on the caller's own tensors for those, so each replay writes the live
cache with no copies. A graph is therefore keyed by the input shapes and the addresses of
its state tensors: the same shapes with another cache get their own graph (never a copy
into, or out of, a cache the caller may still use).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from advisor.errors import one_line
from advisor.runtime.outside_graph import Deferred
from advisor.state import Snapshot

MAX_GRAPHS = 8


_CONSTANTS = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _leaf_key(x: Any) -> tuple:
    """Tensors by shape/dtype/device (their values are copied in); plain constants by
    value; any other object (a `transformers` StaticCache, which is no pytree) by identity:
    the graph baked in the addresses of the tensors it holds, so another cache object must
    never replay it (seen on the H200: a graph captured on a 1024-slot cache replayed on a
    4096-slot one, an out-of-bounds write). The captured graph holds the object, so its
    id is not reused while the graph lives."""
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.dtype, str(x.device))
    if isinstance(x, _CONSTANTS):
        return ("const", repr(x))
    return ("object", type(x).__qualname__, id(x))


def _key(args: tuple, kwargs: dict) -> tuple:
    return _flat_key(*tree_flatten((args, kwargs)))


def _flat_key(flat: list[Any], spec: Any) -> tuple:
    """The key of already flattened inputs (a replay flattens once: host time per step)."""
    return (spec, tuple(_leaf_key(x) for x in flat))


class GraphUnsafe(RuntimeError):
    """The forward cannot be captured as a CUDA graph (it runs Python a replay would skip)."""


def warm_up(fn: Callable[..., Any], args: tuple, kwargs: dict, runs: int = 2) -> list[bool]:
    """Run `fn` `runs` times outside capture (compiles, allocator, cuBLAS handles) and leave
    every tensor reachable from the inputs as it was; returns, per flattened input, whether
    the forward writes it in place (state).

    Flattened tensors are passed as clones, whose version counters tell state from data.
    Tensors held inside other objects (a `transformers` StaticCache: its keys/values and its
    `cumulative_length` counter, which decides where the next write lands) are used live,
    so they are snapshotted and restored: otherwise each warm-up run advances the cache and
    the captured step writes ahead of the position it attends to (seen on the H200:
    outputs unrelated to eager's).

    A forward that changes Python scalars reachable from its inputs (transformers'
    StaticSlidingWindowLayer counts its length in an int and picks its update path from
    it) cannot be replayed: a replay runs no Python. That is a GraphUnsafe error here, and
    the caller runs the forward without a graph."""
    flat, spec = tree_flatten((args, kwargs))
    clones = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
    versions = [x._version if isinstance(x, torch.Tensor) else None for x in clones]
    a, k = tree_unflatten(clones, spec)
    snapshot = Snapshot((args, kwargs))
    try:
        for _ in range(runs):
            fn(*a, **k)
        moved = snapshot.changed_scalars()
    finally:
        snapshot.restore()
    if moved:
        raise GraphUnsafe(f"the forward changes Python state a replay would skip: {', '.join(moved[:3])}")
    return [isinstance(c, torch.Tensor) and c._version != v for c, v in zip(clones, versions)]


class _Captured:
    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        flat, self.spec = tree_flatten((args, kwargs))
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.state = warm_up(fn, args, kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        # Written in place by the forward -> state: capture on the caller's tensor (held
        # here, so its memory outlives the graph); else a private static copy.
        self.static = [x if is_state or not isinstance(x, torch.Tensor) else x.clone()
                       for x, is_state in zip(flat, self.state)]
        a, k = tree_unflatten(self.static, self.spec)
        self.deferred = Deferred()
        try:
            self.graph, self.out = self._capture(fn, a, k, self.deferred)
            cut_ok = self.deferred.sound(self.out, self.static)
        except Exception:  # noqa: BLE001 (a cut's layout pass failed: capture without cuts)
            cut_ok = False
        if not cut_ok:  # a placeholder may have been read, or the capture failed: cut nothing
            self.deferred = Deferred()
            self.graph, self.out = self._capture(fn, a, k, None)

    @staticmethod
    def _capture(fn: Callable[..., Any], a: Any, k: Any, deferred: Deferred | None) -> tuple:
        graph = torch.cuda.CUDAGraph()
        with deferred.active() if deferred is not None else contextlib.nullcontext(), \
                torch.cuda.graph(graph):
            return graph, fn(*a, **k)

    def __call__(self, flat: list[Any]) -> Any:
        """flat: the call's flattened inputs; its state tensors are the captured ones."""
        for dst, src, is_state in zip(self.static, flat, self.state):
            if isinstance(dst, torch.Tensor) and not is_state:
                dst.copy_(src)
        self.graph.replay()
        return self.deferred.resolve(self.out)  # cut-out matmuls run now; the rest cloned


def _state_pointers(flat: list[Any], state: list[bool]) -> tuple[int, ...]:
    return tuple(x.data_ptr() for x, is_state in zip(flat, state) if is_state)


class GraphCache:
    def __init__(self, fn: Callable[..., Any], max_graphs: int = MAX_GRAPHS):
        self.fn, self.max_graphs = fn, max_graphs
        # (shape key, state addresses) -> graph; shape key -> which inputs are state
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.state_of: dict[tuple, list[bool]] = {}
        self.failed: set[tuple] = set()
        self.failures: list[str] = []  # why a capture failed (first line), for summaries

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        if not any(isinstance(x, torch.Tensor) and x.is_cuda for x in flat):
            # a model on the CPU (on a machine with a GPU): a capture would record nothing
            # and every replay would hand back the capture's outputs
            return self.fn(*args, **kwargs)
        key = _flat_key(flat, spec)
        if key in self.failed:
            return self.fn(*args, **kwargs)
        if key in self.state_of:
            full = (key, _state_pointers(flat, self.state_of[key]))
            if full in self.graphs:
                self.graphs.move_to_end(full)
                return self.graphs[full](flat)
        try:
            captured = _Captured(self.fn, args, kwargs)
        except Exception as exc:  # capture can fail (host sync inside forward): no graph
            self.failed.add(key)
            self.failures.append(one_line(exc))
            return self.fn(*args, **kwargs)
        self.state_of[key] = captured.state
        self.graphs[(key, _state_pointers(flat, captured.state))] = captured
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return captured(flat)
