"""The probes' timer (advisor/profile/replay.py) without a GPU: CUDA graphs and events are
stood in for, so the order of replays, the warm-up and the medians are what is tested."""

import pytest
import torch

from advisor.profile import replay


class _Clock:
    """Device time: each replay of graph `name` takes `cost[name]` ms."""

    def __init__(self, cost):
        self.now, self.cost, self.log = 0.0, cost, []


class _Graph:
    def __init__(self, clock, name):
        self.clock, self.name = clock, name

    def replay(self):
        self.clock.log.append(self.name)
        self.clock.now += self.clock.cost[self.name]


def _fake_cuda(monkeypatch, clock, fail_on=None):
    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = clock.now

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return end.t - self.t

    names = iter("ab")

    def captured(run, device):
        return _Graph(clock, next(names))
    monkeypatch.setattr(replay, "_captured", captured)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    if fail_on is not None:
        def broken(self):
            raise RuntimeError("an illegal memory access was encountered")
        monkeypatch.setattr(_Graph, "replay", broken)


def test_graphs_are_replayed_in_turn_after_a_warm_up_of_device_time(monkeypatch):
    clock = _Clock({"a": 0.05, "b": 0.03})  # a one-token site's round: 0.08 ms
    _fake_cuda(monkeypatch, clock)
    a, b = replay.graphs_ms([lambda: None, lambda: None], torch.device("cuda"), reps=5)
    assert (a, b) == (pytest.approx(0.05), pytest.approx(0.03))
    assert clock.log == ["a", "b"] * (len(clock.log) // 2)  # never a a or b b
    warm_rounds = len(clock.log) // 2 - 5
    assert warm_rounds * 0.08 >= replay.WARMUP_MS  # the warm-up is device time, not a count
    assert warm_rounds * 0.08 < 2 * replay.WARMUP_MS + 0.08  # batches double: at most ~2x over


def test_a_failing_replay_is_a_capture_failure(monkeypatch):
    _fake_cuda(monkeypatch, _Clock({"a": 1.0}), fail_on="a")
    with pytest.raises(replay.CaptureFailed, match="replay: an illegal memory access"):
        replay.graphs_ms([lambda: None], torch.device("cuda"))
