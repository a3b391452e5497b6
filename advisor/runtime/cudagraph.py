"""CUDA graphs per bucket, one per exact input shape, bounded.

A plan with `cuda_graph: true` replays a captured graph instead of issuing each kernel
from Python. Graphs are keyed by the input shapes: within a bucket every distinct length
gets its own graph (no padding, so outputs are exactly the unfused model's), at most
`max_graphs` per bucket (least recently used are dropped); a shape past that runs
without a graph. Outputs are cloned out of the graph's static buffers so that a later
replay cannot overwrite what the caller holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

MAX_GRAPHS = 8


def _key(args: tuple, kwargs: dict) -> tuple:
    flat, spec = tree_flatten((args, kwargs))
    return (str(spec), tuple((tuple(x.shape), x.dtype, str(x.device)) if isinstance(x, torch.Tensor)
                             else ("const", repr(x)) for x in flat))


class _Captured:
    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict):
        flat, self.spec = tree_flatten((args, kwargs))
        self.static = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
        a, k = tree_unflatten(self.static, self.spec)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up outside capture (compiles, allocator, cuBLAS handles)
                fn(*a, **k)
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = fn(*a, **k)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        flat, _ = tree_flatten((args, kwargs))
        for dst, src in zip(self.static, flat):
            if isinstance(dst, torch.Tensor):
                dst.copy_(src)
        self.graph.replay()
        return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, self.out)


class GraphCache:
    def __init__(self, fn: Callable[..., Any], max_graphs: int = MAX_GRAPHS):
        self.fn, self.max_graphs = fn, max_graphs
        self.graphs: OrderedDict[tuple, _Captured] = OrderedDict()
        self.failed: set[tuple] = set()
        self.failures: list[str] = []  # why a capture failed (first line), for summaries

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = _key(args, kwargs)
        if key in self.graphs:
            self.graphs.move_to_end(key)
            return self.graphs[key](args, kwargs)
        if key in self.failed:
            return self.fn(*args, **kwargs)
        try:
            captured = _Captured(self.fn, args, kwargs)
        except Exception as exc:  # capture can fail (host sync inside forward): no graph
            self.failed.add(key)
            self.failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            return self.fn(*args, **kwargs)
        self.graphs[key] = captured
        if len(self.graphs) > self.max_graphs:
            self.graphs.popitem(last=False)
        return captured(args, kwargs)
