"""More `transformers` families than tests/hf_models.py builds, each as a tiny random
model: `apply` with every family matches eager, refuses no site it found, and removes
launches. Each brings a spelling a model we have not seen may use: GPT-2's spelled-out
GELU and biased LayerNorm, OPT's (B·T, D) MLP rows, Phi's partial rotary and gelu_new in
the GEMM, Qwen3's and OLMo2's head norms (OLMo2: fp32 RoPE tables), Phi-3's merged weights
and the copies it makes between ops we fuse, GPT-J's RoPE (tables made per call, (B, T, H, D)).
(Mixtral, Falcon, Qwen3-MoE, StableLM, Starcoder2, GPT-J, Gemma3, Granite, Cohere and CLIP's text
model were checked the same way by hand in session 13; tests/test_apply.py and
tests/test_patterns.py cover Cohere and GPT-J's MLP.)"""

from __future__ import annotations

import pytest
import torch

from advisor.kernels.testing import max_violation, tolerance
from advisor.runtime.apply import apply
from advisor.runtime.plan import ALL_FUSIONS, Plan

transformers = pytest.importorskip("transformers")

_DECODER = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=128, max_position_embeddings=256)
_GPT = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=128, n_positions=256)

# family: (config class, model class, config kwargs, families that must apply)
FAMILIES = {
    "Qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DECODER, head_dim=16), {"attention_rope", "rms_norm"}),
    "Olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _DECODER, {"attention_rope", "rms_norm"}),
    # Qwen2: biased Q/K/V after the RMSNorm, the biases in the norm's GEMM
    "Qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DECODER, {"rms_norm_linear", "add_rms_norm_linear"}),
    # the partial rotary's cat folded in; one LayerNorm read by q, k, v and fc1 (a parallel
    # block): one GEMM over the four, the biases in it
    "Phi": ("PhiConfig", "PhiForCausalLM", dict(_DECODER, num_key_value_heads=4, partial_rotary_factor=0.5),
            {"layer_norm_linear", "add_layer_norm_linear", "attention_rope"}),
    # Phi-3: eval dropout's clones between the GEMMs and their residual adds, and its
    # partial-rotary cat with an empty pass-through part before the attention (graph/copies.py)
    "Phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_DECODER, pad_token_id=0),
             {"attention_rope", "linear_residual", "gated_act_linear"}),
    # GPT-J: interleaved partial RoPE on (B, T, H, D), its sin/cos repeated inside the
    # function called for q and for k (merged before matching), dynamic full slices
    # (a parallel block: one LayerNorm read by q, k, v and fc_in, one GEMM over the four)
    "GPTJ": ("GPTJConfig", "GPTJForCausalLM", dict(_GPT, rotary_dim=8), {"rope", "layer_norm_linear"}),
    # DiffLlama: two attentions per layer over v's head halves, each repeated (1, 2, 1, 1)
    # (transformers 5.x; 4.x read one v of twice k's head dim: a head dim of its own, now
    # also a site): k and v read as repeated where one of them cannot be unrepeated
    "DiffLlama": ("DiffLlamaConfig", "DiffLlamaForCausalLM", _DECODER,
                  {"rope", "linear_residual", "attention"}),
    # DeepSeek-V3's multi-head latent attention, non-absorbed: q, k (B, H, T, 16 + 8) with
    # the rotary part last (k's a copy_ into new_empty), v (B, H, T, 12), another head dim.
    # On the CPU SDPA takes its math form for Dv != D (the softmax written out).
    "DeepseekV3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                   dict(_DECODER, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4,
                        num_experts_per_tok=4, n_group=1, topk_group=1, kv_lora_rank=32,
                        q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
                        head_dim=8, first_k_dense_replace=1), {"attention", "rms_norm_linear"}),
    # GPT-2's Conv1D: addmm(b, x, W) over W stored (K, N), read through t(W) (linear_forms.py)
    # (its LayerNorm in c_attn's / c_fc's GEMM: read through the transposed view)
    "GPT2": ("GPT2Config", "GPT2LMHeadModel", _GPT, {"add_layer_norm_linear", "linear_residual", "attention"}),
    "OPT": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=64, ffn_dim=96, num_hidden_layers=2,
                                                 num_attention_heads=4, vocab_size=128,
                                                 max_position_embeddings=256, word_embed_proj_dim=64),
            {"layer_norm_linear", "add_layer_norm_linear"}),  # fc1's ReLU in the norm's GEMM
}


def _tiny(family: str) -> torch.nn.Module:
    config_name, model_name, kwargs, _ = FAMILIES[family]
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # random norm weights and biases: a dropped term shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name or "ln" in name else p.normal_(0, 0.02)
    return model


def _ids(t: int) -> dict:
    g = torch.Generator().manual_seed(t)
    return {"input_ids": torch.randint(2, 128, (2, t), generator=g), "use_cache": False}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_applies_every_fusion_it_finds(family):
    model = _tiny(family)
    refs = {t: model(**_ids(t)).logits for t in (5, 11)}
    fast = apply(model, ALL_FUSIONS)
    for t, ref in refs.items():
        assert max_violation(fast(**_ids(t)).logits, ref, tolerance(torch.float32, model=True)) <= 0
    rows = fast.summary()
    total = next(r for r in rows if r["family"] == "(all)")
    assert total["compiles"] == 1 and total["launches_after"] < total["launches_before"]
    assert not [r for r in rows if r.get("unfused")], [r for r in rows if r.get("unfused")]
    applied = {r["family"] for r in rows if r.get("applied")}
    assert FAMILIES[family][3] <= applied, applied


@pytest.mark.parametrize("family, fused", [("Phi", "linear_bias_act"), ("OPT", "linear_bias_act"),
                                           ("GPT2", "linear_bias_act"), ("GPT2", "add_layer_norm"),
                                           ("GPTJ", "linear_bias_act")])
def test_without_the_norm_in_the_gemm_the_activation_epilogue_applies(family, fused):
    """The plan the tuner weighs against layer_norm_linear: the norm alone and fc1's
    activation (Phi's gelu_new, OPT's ReLU) in the GEMM's epilogue."""
    model = _tiny(family)
    refs = {t: model(**_ids(t)).logits for t in (1, 5)}
    fast = apply(model, Plan(tuple(f for f in ALL_FUSIONS.fusions if "norm_linear" not in f)))
    for t, ref in refs.items():
        assert max_violation(fast(**_ids(t)).logits, ref, tolerance(torch.float32, model=True)) <= 0
    rows = {r["family"]: r for r in fast.summary()}
    assert rows[fused]["applied"] > 0 and not rows[fused]["unfused"], rows[fused]


def test_layer_norm_folds_into_its_projections_and_fc1s_activation():
    """OPT: each LayerNorm → its projections (q, k, v with biases; fc1 with its ReLU; the
    lm_head) is one GEMM; at one token the norm runs in the GEMV's prologue (one launch)."""
    model = _tiny("OPT")
    refs = {t: model(**_ids(t)).logits for t in (1, 5)}
    launches = {}
    for fusions in (("layer_norm", "add_layer_norm", "linear_bias_act"),
                    ("layer_norm_linear", "add_layer_norm_linear")):
        fast = apply(model, Plan(fusions))
        for t, ref in refs.items():
            assert max_violation(fast(**_ids(t)).logits, ref, tolerance(torch.float32, model=True)) <= 0
        rows = {r["family"]: r for r in fast.summary()}
        assert all(rows[f]["applied"] > 0 and not rows[f]["unfused"] for f in fusions[:2]), rows
        launches[fusions[0]] = rows["(all)"]["launches_after"]
    # per layer: attention's norm and its 3 GEMMs -> 1, fc1's norm + GEMM + ReLU -> 1 (2 each
    # with the norm kernel and the ReLU epilogue); the final norm + lm_head -> 1
    assert launches["layer_norm_linear"] < launches["layer_norm"], launches


@pytest.mark.parametrize("family, extra", [
    ("Llama", dict(num_key_value_heads=4)),  # MHA: repeat_kv passes v through unchanged
    ("GPTJ", {}),
])
def test_eager_attention_reading_a_merged_projections_column_block(family, extra):
    # eager attention's matmul, traced with a contiguous v, views it as (B·H, T, D); a
    # qkv_merge column block is rows 3·N apart, which no view can merge at batch 2, one
    # token: the rewrite crashed there (GPT-J on the H200, session 26)
    config_name, model_name, kwargs, _ = FAMILIES.get(family, ("LlamaConfig", "LlamaForCausalLM", _DECODER, set()))
    config = getattr(transformers, config_name)(**{**kwargs, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    refs = {t: model(**_ids(t)).logits for t in (1, 5)}
    fast = apply(model, ALL_FUSIONS)
    for t, ref in refs.items():
        assert max_violation(fast(**_ids(t)).logits, ref, tolerance(torch.float32, model=True)) <= 0
    applied = {r["family"] for r in fast.summary() if r.get("applied")}
    assert applied & {"qkv_merge", "rms_norm_linear", "add_rms_norm_linear", "layer_norm_linear",
                      "add_layer_norm_linear"}, applied  # column blocks


def test_mqa_repeat_kv_from_one_kv_head_is_read_before_the_repeat():
    # From one kv head (MQA: Gemma-2B) repeat_kv's view of the expand needs no copy, so the
    # trace has no clone in it; the attention must still read k and v before the repeat and
    # fold RoPE in, as it does for GQA: the same launches as with two kv heads.
    launches = {}
    for kv in (2, 1):
        config = transformers.LlamaConfig(**{**_DECODER, "num_key_value_heads": kv})
        config._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config).eval()
        refs = {t: model(**_ids(t)).logits for t in (1, 5)}
        fast = apply(model, ALL_FUSIONS)
        for t, ref in refs.items():
            assert max_violation(fast(**_ids(t)).logits, ref, tolerance(torch.float32, model=True)) <= 0
        rows = fast.summary()
        assert "attention_rope" in {r["family"] for r in rows if r.get("applied")}, (kv, rows)
        launches[kv] = next(r for r in rows if r["family"] == "(all)")["launches_after"]
    assert launches[1] == launches[2], launches


def test_rotate_half_written_the_other_way_is_rope_with_sin_negated():
    """NanoChat's rotate_half is cat(x2, -x1): x·cos + that·sin is RoPE with sin negated.
    (With every family on, add_rms_norm takes the rotation's last add into the QK-norm that
    follows it, a choice the tuner makes.)"""
    model = _tiny_config_model("NanoChatConfig", "NanoChatForCausalLM", _DECODER)
    refs = {t: model(**_ids(t)).logits for t in (1, 5)}
    fast = apply(model, Plan(("rope", "rope_table")))
    for t, ref in refs.items():
        assert max_violation(fast(**_ids(t)).logits, ref, tolerance(torch.float32, model=True)) <= 0
    row = next(r for r in fast.summary() if r["family"] == "rope")
    assert row["applied"] >= 2 and not row["unfused"], row  # both layers, in each trace


def _tiny_config_model(config_name: str, model_name: str, kwargs: dict) -> torch.nn.Module:
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return getattr(transformers, model_name)(config).eval()


def _eager(config_name: str, model_name: str, **kwargs) -> torch.nn.Module:
    config = getattr(transformers, config_name)(**kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0, 0.02)
    return model


_EAGER = {  # family: (config, model, config kwargs, the attention family that must apply)
    "Llama": ("LlamaConfig", "LlamaForCausalLM", _DECODER, "attention_rope"),
    "LlamaMHA": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER, num_key_value_heads=4), "attention_rope"),
    # soft-capped logits (cap 1: nearly every score capped) and sliding-window layers
    "Gemma2": ("Gemma2Config", "Gemma2ForCausalLM",
               dict(_DECODER, head_dim=16, attn_logit_softcapping=1.0, final_logit_softcapping=30.0,
                    sliding_window=3, query_pre_attn_scalar=9), "attention_rope"),
    # q, k upcast to fp32, where(causal window, s, finfo.min) made by torch.tensor in forward
    "GPTNeo": ("GPTNeoConfig", "GPTNeoForCausalLM",
               dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=128, max_position_embeddings=256,
                    attention_types=[[["global", "local"], 1]], window_size=4), "attention"),
    # BLOOM: baddbmm(ALiBi (B·H, 1, Tk), q, kᵀ) on (B·H, T, D) rows, then the causal mask
    "Bloom": ("BloomConfig", "BloomForCausalLM",
              dict(hidden_size=64, n_layer=2, n_head=4, vocab_size=128), "attention"),
    # attention sinks: cat([scores, sinks]), minus the row max, softmax, [..., :-1]
    "GptOss": ("GptOssConfig", "GptOssForCausalLM",
               dict(_DECODER, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                    layer_types=["sliding_attention", "full_attention"]), "attention_rope"),
    # an ALiBi bias added, then masked_fill(mask, finfo.min)
    "MPT": ("MptConfig", "MptForCausalLM", dict(d_model=64, n_heads=4, n_layers=2, vocab_size=128,
                                                max_seq_len=256), "attention"),
}


@pytest.mark.parametrize("family", sorted(_EAGER))
def test_eager_attention_is_fused_as_sdpa_is(family):
    """Attention written out (transformers' eager_attention_forward: matmul, scale, mask,
    softmax in fp32, matmul; GQA's repeat_kv; the older families' own spellings) is the same
    site as SDPA: one kernel, RoPE folded in where the RoPE is ours. Gemma 2 soft-caps its
    logits (div, tanh, mul) and alternates sliding-window layers, whose masks are just other
    additive masks; with a cap of 1 nearly every score is capped, so a kernel that left it
    out would not match."""
    config_name, model_name, kwargs, attention = _EAGER[family]
    model = _eager(config_name, model_name, **kwargs)
    refs = {t: model(**_ids(t)).logits for t in (1, 6)}
    fast = apply(model, ALL_FUSIONS)
    for t, ref in refs.items():
        assert max_violation(fast(**_ids(t)).logits, ref, tolerance(torch.float32, model=True)) <= 0
    rows = fast.summary()
    assert not [r for r in rows if r.get("unfused")], [r for r in rows if r.get("unfused")]
    # both layers, in the graph of each length (1 token is a graph of its own)
    assert next(r["applied"] for r in rows if r["family"] == attention) == 4, rows
    if family == "Gemma2":
        from advisor.graph.capture import capture
        from advisor.graph.patterns import find_all

        part = capture(model, _ids(6)).parts[0]
        sites = [m for m in find_all(part.gm, part.params) if m.family == "attention_rope"]
        assert [(m.operands["scale"], m.operands["softcap"]) for m in sites] == [(1 / 3, 1.0)] * 2
