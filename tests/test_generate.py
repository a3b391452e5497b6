"""Greedy generation (`bench --phase decode --generate N`): how inputs advance, the loop,
and the bench's rows against eager on the tiny hand-written model and the tiny
transformers Llama (fp32: the fused tokens are eager's, and the cache is restored)."""

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import advisor.bench as bench
from advisor.bench import run_bench
from advisor.errors import AdvisorError, ModelFileError
from advisor.generate import Generation, advancer, compare, default_next_inputs, greedy, greedy_ids
from advisor.loader import build, inputs_for, load_model_file
from advisor.runtime.plan import UNFUSED
from advisor.runtime.recipe import Recipe, load_recipe
from advisor.state import tensors_in

CPU = torch.device("cpu")
PLAN = "recipes/all-fusions.plan.json"

TUPLE_MODEL = """
import torch
class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = torch.nn.Embedding(16, 8), torch.nn.Linear(8, 16)
    def forward(self, ids, pos):
        return self.out(self.emb(ids) + pos[:, None].float())
def build_model(device, dtype):
    torch.manual_seed(0)
    return M().to(device=device, dtype=dtype)
def make_inputs(seq_len, batch, device):
    return (torch.zeros(batch, seq_len, dtype=torch.long), torch.arange(seq_len))
def make_decode_inputs(ctx, batch, device):
    return (torch.ones(batch, 1, dtype=torch.long), torch.tensor([ctx]))
"""
ADVANCE = "def next_decode_inputs(inputs, next_ids):\n    return (next_ids, inputs[1] + 1)\n"
RAISING = "def next_decode_inputs(inputs, next_ids):\n    raise KeyError('pos')\n"


def _recording(mf):
    """mf whose make_decode_inputs keeps what it returned, to look at after the bench."""
    made = {}

    def make(ctx, batch, device, dtype=torch.float32):
        made[ctx] = mf.make_decode_inputs(ctx, batch, device, dtype)
        return made[ctx]

    return dataclasses.replace(mf, make_decode_inputs=make), made


@pytest.mark.parametrize("path, batch", [("examples/tiny_llama.py", 2), ("examples/llama_hf.py", 1)])
def test_bench_decode_generate_fused_tokens_are_eagers_over_32_steps_and_cache_restored(path, batch):
    mf, made = _recording(load_model_file(path))
    result = run_bench(mf, load_recipe(PLAN), (12,), batch, CPU, torch.float32, (), phase="decode",
                       generate=32, generate_reps=1)
    eager, fused = result.generation
    assert (eager["variant"], fused["variant"]) == ("eager", "advisor")
    assert fused["tokens_match"] and fused["first_divergence"] is None and fused["matches_eager"], fused
    assert fused["tokens"] == eager["tokens"] and len(eager["tokens"]) == batch
    assert len(eager["tokens"][0]) == 32 and len(set(eager["tokens"][0])) > 1  # not a degenerate loop
    assert fused["compared_steps"] == 32 and fused["max_error"] < 1e-4
    assert fused["ms_per_token"] > 0 and fused["tokens_per_s"] > 0 and fused["speedup_vs_eager"] > 0
    (f,) = result.floors  # profile/floor.py: weights + the cache, reported per row as x_floor
    assert f["shape"] == 12 and f["weight_bytes"] > 0 and f["state_bytes"] > 0 and f["floor_ms"] > 0
    assert all(r["x_floor"] > 0 for r in result.rows + result.generation)
    # One compile for every step: positions advance without recompiling.
    assert [r["compiles"] for r in result.applied if r["family"] == "(all)"] == [1]
    fresh = inputs_for(load_model_file(path), 12, batch, CPU, phase="decode", dtype=torch.float32)
    pairs = list(zip(tensors_in(made[12]), tensors_in(fresh), strict=True))
    assert len(pairs) > 4 and all(torch.equal(live, want) for live, want in pairs)  # bitwise


def test_decode_greedy_loop_is_the_hand_written_one():
    mf = load_model_file("examples/tiny_llama.py")
    model = build(mf, CPU, torch.float32)
    x = inputs_for(mf, 9, 2, CPU, phase="decode")
    cache = [(k.clone(), v.clone()) for k, v in x["cache"]]
    with torch.no_grad():
        got = greedy(model, x, 6, advancer(mf, x), keep_logits=True)
        ids, want = x["tokens"], []
        for i in range(6):
            ids = model(ids, cache, torch.tensor([9 + i]))[:, -1].argmax(-1, keepdim=True)
            want.append(ids)
    assert torch.equal(got.tokens, torch.cat(want, dim=1))
    assert got.logits is not None and got.logits.shape == (2, 6, model.d.vocab)


def test_greedy_ids_is_torch_argmax_off_cuda():
    x = torch.tensor([[0.0, 2.0, 2.0, float("nan")], [1.0, 3.0, 3.0, 0.0]])
    assert torch.equal(greedy_ids(x), x.argmax(-1, keepdim=True))


def test_decode_default_advance_replaces_ids_and_moves_positions():
    cache = object()
    x = {"input_ids": torch.tensor([[5], [6]], dtype=torch.int32), "cache_position": torch.tensor([12]),
         "position_ids": torch.tensor([[12], [12]]), "past_key_values": cache, "use_cache": True}
    nxt = default_next_inputs(x, torch.tensor([[1], [2]]))
    assert nxt["input_ids"].dtype == torch.int32 and nxt["input_ids"].tolist() == [[1], [2]]
    assert nxt["cache_position"].tolist() == [13] and nxt["position_ids"].tolist() == [[13], [13]]
    assert nxt["past_key_values"] is cache and nxt["use_cache"] is True
    assert x["cache_position"].tolist() == [12] and x["input_ids"].tolist() == [[5], [6]]  # not mutated
    hf = load_model_file("examples/llama_hf.py")
    assert hf.next_decode_inputs is None and advancer(hf, x) is default_next_inputs


@pytest.mark.parametrize("inputs, why", [
    ((torch.zeros(1, 1),), "positional"),
    ({"tokens": torch.zeros(1, 1)}, "no 'input_ids'"),
    ({"input_ids": torch.zeros(1, 1), "attention_mask": torch.ones(1, 13)}, "attention_mask"),
])
def test_decode_inputs_the_default_cannot_advance_are_a_clear_error(inputs, why):
    mf = load_model_file("examples/llama_hf.py")
    with pytest.raises(ModelFileError, match=why) as err:
        advancer(mf, inputs)
    assert "llama_hf.py" in str(err.value) and "define next_decode_inputs" in str(err.value)


@pytest.mark.parametrize("extra, expected", [
    ("", "cannot advance decode inputs by default (inputs are positional"),
    (RAISING, "next_decode_inputs failed: KeyError"),
])
def test_bench_generation_errors_name_the_model_file(tmp_path, extra, expected):
    (tmp_path / "m.py").write_text(TUPLE_MODEL + extra)
    mf = load_model_file(tmp_path / "m.py")
    with pytest.raises(ModelFileError, match=expected.replace("(", r"\(")) as err:
        run_bench(mf, Recipe.from_plan(UNFUSED), (4,), 1, CPU, torch.float32, (), phase="decode", generate=3)
    assert "m.py" in str(err.value)


def test_bench_cache_too_small_and_prefill_are_errors():
    mf = load_model_file("examples/llama_hf.py")  # StaticCache of 12 + 256 positions
    with pytest.raises(ModelFileError, match="holds 268 positions; generating 300 tokens needs 312"):
        run_bench(mf, Recipe.from_plan(UNFUSED), (12,), 1, CPU, torch.float32, (), phase="decode",
                  generate=300)
    with pytest.raises(AdvisorError, match="--phase decode"):
        run_bench(mf, Recipe.from_plan(UNFUSED), (12,), 1, CPU, torch.float32, (), generate=4)


def test_bench_runtime_sees_the_context_grow_by_one_per_step(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(TUPLE_MODEL + ADVANCE)
    seen = []
    real_apply = bench.apply

    def spy(model, recipe, length_of=None):
        return real_apply(model, recipe, length_of=lambda a, k: seen.append(length_of(a, k)) or seen[-1])

    monkeypatch.setattr(bench, "apply", spy)
    result = run_bench(load_model_file(tmp_path / "m.py"), Recipe.from_plan(UNFUSED), (12,), 2, CPU,
                       torch.float32, (), phase="decode", generate=5, generate_reps=2)
    assert seen[-5:] == [12, 13, 14, 15, 16] and seen[-10:-5] == [12, 13, 14, 15, 16]
    assert [r["tokens_match"] for r in result.generation if r["variant"] == "advisor"] == [True]


def test_decode_compare_judges_logits_up_to_the_first_divergence():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 6, 11, generator=g)  # (B, N, V)
    ref = Generation(torch.randint(0, 11, (2, 6), generator=g), logits)
    tokens = ref.tokens.clone()
    tokens[1, 3] += 1  # sequence 1 takes another token at step 3
    later = logits.clone()
    later[:, 4:] += 100.0  # after the divergence the inputs differ: not compared
    got = Generation(tokens, later)
    fp32, bf16 = compare(got, ref, torch.float32), compare(got, ref, torch.bfloat16)
    assert fp32["first_divergence"] == 3 and fp32["compared_steps"] == 4 and fp32["max_error"] == 0
    assert not fp32["tokens_match"] and fp32["logits_match"] and not fp32["matches_eager"]
    assert bf16["logits_match"] and bf16["matches_eager"]  # a near-tie may flip a bf16 token
    off = Generation(tokens, logits + 1.0)  # every compared logit off by one: beyond the tolerance
    assert not compare(off, ref, torch.bfloat16)["matches_eager"]


def _cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "advisor.cli", "bench", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})


def test_cli_generate(tmp_path):
    out = tmp_path / "bench.json"
    proc = _cli("examples/tiny_llama.py", "--generate", "4", "--device", "cpu", "--json", str(out))
    assert proc.returncode == 2 and "--generate 4 needs --phase decode" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()
    # Plumbing only: without the interpreter the kernels fall back to their references (fast).
    proc = _cli("examples/tiny_llama.py", "--phase", "decode", "--shapes", "16,40", "--generate", "32",
                "--recipe", PLAN, "--compile", "none", "--device", "cpu", "--json", str(out),
                TRITON_INTERPRET="0", COLUMNS="160")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "greedy generation: 32 new tokens" in proc.stdout
    data = json.loads(out.read_text())
    assert data["meta"]["generate"] == 32 and len(data["rows"]) == 4
    gen = data["generation"]
    assert [(r["shape"], r["variant"]) for r in gen] == [(16, "eager"), (16, "advisor"), (40, "eager"),
                                                         (40, "advisor")]
    assert all(r["tokens_match"] and r["matches_eager"] for r in gen if r["variant"] == "advisor")
    assert all(len(r["tokens"][0]) == 32 and r["ms_per_token"] > 0 for r in gen)
