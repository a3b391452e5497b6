"""The rewrite matches the graph a few times per graph, not once per site: rounds do not
grow with the number of layers, and every added layer is rewritten like the others."""

import pytest
import torch

from advisor.graph.capture import capture
from advisor.runtime import rewrite as rw
from advisor.runtime.plan import ALL_FUSIONS


def _decoder_step(layers: int):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    cache = transformers.StaticCache(config=cfg, max_cache_len=32)
    x = {"input_ids": torch.tensor([[3]]), "past_key_values": cache, "use_cache": True,
         "cache_position": torch.tensor([10])}
    part = max(capture(model, x).parts, key=lambda p: len(p.gm.graph.nodes))
    return part.gm, part.params


def test_rounds_do_not_grow_with_layers(monkeypatch):
    # Confirmation (numerics) is tested elsewhere; here only the matching loop runs.
    monkeypatch.setattr(rw, "confirm", lambda m, config, seed=0: 0.0)
    matched = []
    real = rw.find_all
    monkeypatch.setattr(rw, "find_all", lambda gm, params: matched.append(1) or real(gm, params))
    rounds, after, applied = {}, {}, {}
    for layers in (2, 4, 6):
        matched.clear()
        gm, params = _decoder_step(layers)
        report = rw.rewrite(gm, params, ALL_FUSIONS)
        rounds[layers], after[layers] = len(matched), report.launches_after
        applied[layers] = sum(s.applied for s in report.sites)
        assert all(s.applied for s in report.sites), [s for s in report.sites if not s.applied]
    assert rounds[2] == rounds[6] <= 5, rounds
    # linear in layers: each added layer rewritten to the same kernels
    assert after[6] - after[4] == after[4] - after[2] > 0, after
    assert applied[6] - applied[4] == applied[4] - applied[2] > 0, applied


def test_confirmations_run_ahead_in_threads_as_the_loop_would(monkeypatch):
    """Each round's new site signatures are confirmed at once in worker threads (their
    kernels' compiles overlap), with the caller's context (PDL) and no confirmation the
    loop would not have made: same sites, same count as one at a time."""
    import threading

    from advisor.kernels._triton import _PDL, programmatic_launch

    calls = []

    def fake_confirm(m, config, seed=0):
        calls.append((threading.current_thread() is threading.main_thread(), _PDL.get()))
        return 0.0

    monkeypatch.setattr(rw, "confirm", fake_confirm)
    runs = {}
    for workers in (1, 4):
        monkeypatch.setattr(rw, "confirm_workers", lambda w=workers: w)
        calls.clear()
        gm, params = _decoder_step(3)
        with programmatic_launch(True):
            report = rw.rewrite(gm, params, ALL_FUSIONS)
        runs[workers] = ([(s.family, s.module, s.applied) for s in report.sites], list(calls))
    (sites1, calls1), (sites4, calls4) = runs[1], runs[4]
    assert sites4 == sites1 and len(calls4) == len(calls1) > 2
    assert all(main for main, _ in calls1) and not all(main for main, _ in calls4)
    assert all(pdl for _, pdl in calls1 + calls4)


def test_confirm_ahead_skips_known_signatures_and_leaves_failures_to_the_loop(monkeypatch):
    """Known signatures are not confirmed again, repeated ones once; a failure beside
    the others (out of memory, say) is not cached: the loop confirms it again, alone."""
    seen = []
    monkeypatch.setattr(rw, "_confirm_or_reason",
                        lambda m, config: seen.append(config) or ("bad" if config == "b" else rw.Confirmed(0.0)))
    monkeypatch.setattr(rw, "site_signature", lambda m, config: (config,))
    cache = {("a",): rw.Confirmed(1.0)}
    rw.confirm_ahead([(None, "a"), (None, "b"), (None, "c"), (None, "c")], cache, workers=3)
    assert sorted(seen) == ["b", "c"]  # "a" known, "c" once
    assert cache[("a",)].max_error == 1.0 and cache[("c",)].max_error == 0.0
    assert ("b",) not in cache
    seen.clear()
    rw.confirm_ahead([(None, "d")], cache, workers=3)  # one new signature: the loop's turn
    assert seen == [] and ("d",) not in cache
