"""The CUDA-graph cache key (runtime/cudagraph.py): what may replay a captured graph.
Runs without a GPU: only the key is tested here; replays ran on the H200."""

from __future__ import annotations

import torch

from advisor.runtime.cudagraph import _key


class Cache:  # stands for transformers' StaticCache: an object that is no pytree
    def __init__(self, slots: int):
        self.k = torch.zeros(1, 2, slots, 4)


def test_tensors_key_by_shape_not_value():
    a = {"input_ids": torch.tensor([[1]]), "cache_position": torch.tensor([7])}
    b = {"input_ids": torch.tensor([[9]]), "cache_position": torch.tensor([8])}
    assert _key((), a) == _key((), b)
    assert _key((), a) != _key((), {**a, "input_ids": torch.tensor([[1, 2]])})


def test_constants_key_by_value():
    x = torch.zeros(2)
    assert _key((x, 3, True), {}) == _key((x, 3, True), {})
    assert _key((x, 3, True), {}) != _key((x, 4, True), {})


def test_other_objects_key_by_identity():
    """Two caches of different sizes (or the same size) never share a graph; the same
    cache object, step after step, does."""
    ids = torch.tensor([[1]])
    small, big, other = Cache(1024), Cache(4096), Cache(1024)
    k = _key((), {"input_ids": ids, "past_key_values": small})
    assert k == _key((), {"input_ids": ids.clone(), "past_key_values": small})
    assert k != _key((), {"input_ids": ids, "past_key_values": big})
    assert k != _key((), {"input_ids": ids, "past_key_values": other})
