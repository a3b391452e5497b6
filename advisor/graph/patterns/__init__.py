"""Fusion patterns, one module per family; `find_all` runs them in dependency order.

| family                         | matched in        | kernel (advisor/kernels/) |
|--------------------------------|-------------------|---------------------------|
| rms_norm, add_rms_norm,        | patterns/norm.py  | norm.py                   |
| layer_norm, add_layer_norm     |                   |                           |
| gate_up_swiglu (projections +  | linear.py         | linear_swiglu.py (gemm.py)|
|   SwiGLU in one GEMM)          |                   |                           |
| gated_act (SwiGLU, GeGLU)      | activation.py     | gated_act.py              |
| gated_act_linear (act(g)·u in  | linear.py         | gemm.py (gated_linear)    |
|   the down projection's        |                   |                           |
|   prologue, + residual)        |                   |                           |
| linear_bias_act (bias + act in | linear.py         | gemm.py (gemm_epilogue)   |
|   the projection's epilogue)   |                   |                           |
| linear_residual (residual add  | linear.py         | gemm.py (gemm_epilogue)   |
|   in the projection's epilogue)|                   |                           |
| bias_act                       | activation.py     | bias_act.py               |
| rope (q and k in one launch)   | rope.py           | rope.py                   |
| rope_table (cos/sin tables of  | rope.py           | rope_table.py             |
|   positions ⊗ inv_freq)        |                   |                           |
| qkv_merge, gate_up_merge, ...  | linear.py         | merged_linear.py (cuBLAS) |
| rms_norm_linear,               | linear.py         | rmsnorm_linear.py (gemm)  |
|   add_rms_norm_linear (norm as |                   |                           |
|   the projections' prologue)   |                   |                           |
| layer_norm_linear,             | linear.py         | layernorm_linear.py (gemm)|
|   add_layer_norm_linear (+ the |                   |                           |
|   biases, one projection's act)|                   |                           |
| rms_norm_swiglu,               | linear.py         | rmsnorm_swiglu.py (gemm)  |
|   add_rms_norm_swiglu (norm    |                   |                           |
|   prologue + SwiGLU epilogue)  |                   |                           |
| attention_rope, attention      | attention.py      | attention.py              |
|   (SDPA or written out: matmul,|                   |                           |
|   scale, Gemma 2's softcap,    |                   |                           |
|   + mask | masked_fill, softmax|                   |                           |
|   matmul; RoPE folded in; a    |                   |                           |
|   static cache's causal mask   |                   |                           |
|   read as positions: q_pos)    |                   |                           |
| rope_kv_cache (RoPE + in-place | cache.py          | rope.py (rope_qk_cache)   |
|   k/v cache write)             |                   |                           |
| other explicit attention,      | attention.py      | analysis only             |
|   kv_cache_write               |                   |                           |

Activations (in gated_act, bias_act, linear_bias_act) are recognised by value: any chain
of elementwise ops of one tensor that computes SiLU, GELU (erf or tanh), ReLU or quick-GELU
on probe inputs, however it is written (activation.py `spelled_activation`).
"""

from __future__ import annotations

from torch import fx

from advisor.graph.match import Match, with_shared_views
from advisor.graph.patterns import activation, attention, cache, linear, norm, rope


def find_all(gm: fx.GraphModule, params: dict[str, str]) -> list[Match]:
    norms = norm.find(gm, params)
    gated = activation.find_gated(gm)
    ropes = rope.find(gm)
    # Deeper fusions first: where several are enabled, the runtime takes the first that
    # matches a site (a norm folded into its projections beats the norm alone, etc.).
    fusable_attention = attention.find_fusable(gm, ropes)
    rope_writes = cache.find(gm, ropes)
    epilogues = linear.find_epilogues(gm, params)
    norm_projections = linear.find_norm_projections(norms, gm, params, epilogues)
    swiglu_projections = linear.find_swiglu_projections(gated, params)
    residual_epilogues = linear.find_residual_epilogues(gm, params)
    matches = [
        *[m for m in fusable_attention if m.family == "attention_rope"],  # RoPE folded in
        *linear.find_norm_swiglus(norm_projections, swiglu_projections),  # subsumes both
        *norm_projections,
        *norms,
        *swiglu_projections,  # before gated_act: it subsumes it
        # the product into the down projection's prologue (and its residual add): before
        # gated_act and linear_residual, which it subsumes
        *linear.find_gated_projections(gated, params, residual_epilogues),
        *gated,
        *epilogues,  # before bias_act: it subsumes it
        *residual_epilogues,  # after add+norm: that add is the norm's
        *activation.find_bias_act(gm, params),
        *rope_writes,  # before rope: it subsumes the rotation
        *ropes,
        *rope.find_tables(gm),  # the cos/sin the rotations read
        *linear.find_merges(gm, params, gated),
        *[m for m in fusable_attention if m.family == "attention"],
        *attention.not_covered(attention.find(gm, ropes), fusable_attention),  # analysis only
        *attention.find_cache_writes(gm, ropes, rope_writes),  # analysis only
    ]
    # Analysis-only candidates are priced even when they overlap others; anything the
    # runtime may rewrite must be self-contained.
    matches = [m if m.kernel is None else with_shared_views(m) for m in matches]
    return [m for m in matches if m.kernel is None or m.self_contained()]
