"""profile/floor.py: the bytes a forward must read (embedding tables by the rows gathered,
tied weights whole, a static cache up to the context) and the floor they give."""

import torch

from advisor.profile.ceilings import Ceilings
from advisor.profile.floor import floor, state_bytes, weight_bytes

CEIL = Ceilings(device_name="test", device_type="cpu", copy_gbps=1.0,
                matmul_tflops={"float32": 1e-3, "float16": 1e-3, "bfloat16": 1e-3}, launch_us=1.0,
                graph_launch_us=None, env={}, measured_at="", method="test")


class _LM(torch.nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 8)
        self.proj = torch.nn.Linear(8, 8, bias=False)
        self.head = torch.nn.Linear(8, 100, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.proj(self.embed(ids)))


def test_embedding_rows_untied_and_whole_table_tied():
    ids = torch.tensor([[1, 2, 3]])
    row = 8 * 4
    untied = weight_bytes(_LM(False), (ids,))
    assert untied == 3 * row + 64 * 4 + 100 * row  # 3 rows gathered, proj, head
    assert weight_bytes(_LM(True), (ids,)) == 64 * 4 + 100 * row  # the table read whole once


def test_static_cache_counts_the_live_positions_only():
    model = _LM(False)
    cache = {"k": torch.zeros(1, 2, 64, 8), "v": torch.zeros(1, 2, 64, 8), "pos": torch.tensor([5])}
    assert state_bytes(model, cache, context_len=15, capacity=64) == 2 * (2 * 64 * 8 * 4) // 4
    assert state_bytes(model, cache, context_len=15, capacity=None) == 2 * 2 * 64 * 8 * 4


def test_floor_is_the_larger_of_read_and_compute():
    f = floor(_LM(False), (torch.tensor([[1, 2]]),), CEIL, torch.float32)
    assert f.state_bytes == 0 and f.read_ms == f.weight_bytes / 1e9 * 1e3
    assert f.flops >= 2 * 2 * (8 * 8 + 8 * 100) and f.ms == max(f.read_ms, f.compute_ms)
    assert f.to_json()["floor_ms"] == f.ms


def test_bench_goes_on_when_the_floor_cannot_be_measured(monkeypatch):
    import advisor.bench as bench

    def broken(*args, **kwargs):
        raise RuntimeError("no dispatch here")

    monkeypatch.setattr(bench, "floor", broken)
    x = {4: (torch.tensor([[1, 2]]),)}
    floors = bench._floors(_LM(False), x, {4: _NoState()}, torch.device("cpu"), torch.float32, "prefill")
    assert floors[4].startswith("RuntimeError: no dispatch here")
    assert bench._floor_rows(floors) == [{"shape": 4, "error": floors[4]}]
    rows = bench._with_floor([{"shape": 4, "ms": 2.0}], "ms", bench._floor_ms(floors))
    assert rows[0]["x_floor"] is None


class _NoState:
    def restore(self):
        pass
