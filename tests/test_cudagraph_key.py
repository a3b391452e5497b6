"""The CUDA-graph cache key (runtime/cudagraph.py): what may replay a captured graph.
Runs without a GPU: the key and the warm-up are tested here; replays ran on the H200."""

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


class CountingCache:
    """Like a StaticCache: the write position lives in the object and each step moves it."""

    def __init__(self, slots: int):
        self.k = torch.zeros(1, slots)
        self.cumulative_length = torch.tensor(0)

    def step(self, x: torch.Tensor) -> torch.Tensor:
        self.k[0, self.cumulative_length] = x
        self.cumulative_length.add_(1)
        return self.k.sum()


def test_warm_up_leaves_object_state_and_inputs_as_they_were():
    """Warm-up runs before capture must not advance a cache held inside an object (on the
    H200 they moved StaticCache's write position, and the captured step wrote ahead of the
    position it attended to); inputs written in place are reported as state."""
    from advisor.runtime.cudagraph import warm_up

    cache, tokens, written = CountingCache(8), torch.tensor(3.0), torch.zeros(4)

    def step(x, buf, cache):
        buf.add_(1)  # an input written in place: state
        return cache.step(x)

    state = warm_up(step, (tokens, written, cache), {}, runs=3)
    assert state == [False, True, False]  # tokens: data; buf: state; the cache: an object
    assert int(cache.cumulative_length) == 0 and not cache.k.any()
    assert not written.any()  # the warm-up ran on a clone


def test_warm_up_refuses_a_forward_that_moves_python_state():
    """A cache counting in a Python int (StaticSlidingWindowLayer) would not advance under a
    graph replay: warm-up says so (GraphCache then runs the forward without a graph), and
    leaves the int and the tensors as they were."""
    import pytest

    from advisor.runtime.cudagraph import GraphUnsafe, warm_up

    cache = CountingCache(8)
    cache.length_int = 0

    def step(x, cache):
        cache.length_int += 1
        return cache.step(x)

    with pytest.raises(GraphUnsafe, match="CountingCache.length_int"):
        warm_up(step, (torch.tensor(2.0), cache), {})
    assert cache.length_int == 0 and int(cache.cumulative_length) == 0 and not cache.k.any()


def test_median_ms_resets_state_before_every_run():
    from advisor.timing import median_ms

    cache, resets = CountingCache(4), []

    def reset():
        resets.append(1)
        cache.cumulative_length.zero_()

    ms = median_ms(lambda: cache.step(torch.tensor(1.0)), torch.device("cpu"), rep_ms=1, min_reps=20,
                   reset=reset)  # 21+ steps in a 4-slot cache: only safe if reset each time
    assert ms >= 0 and len(resets) >= 21 and int(cache.cumulative_length) == 1
