"""Plans: which fusions are on, with which kernel config, CUDA graphs on/off.

Frozen data. `FAMILIES` is the one table from a fusion family (what `analyze` reports)
to the registry kernel that implements it; a plan may only name families listed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# family -> registry kernel id (advisor/kernels/registry.py) used when the family is on.
FAMILIES: dict[str, str] = {
    "rms_norm_swiglu": "rmsnorm_swiglu",
    "add_rms_norm_swiglu": "rmsnorm_swiglu",
    "rms_norm_linear": "rmsnorm_linear",
    "add_rms_norm_linear": "rmsnorm_linear",
    "layer_norm_linear": "layernorm_linear",
    "add_layer_norm_linear": "layernorm_linear",
    "rms_norm": "rms_norm",
    "add_rms_norm": "add_rms_norm",
    "layer_norm": "layer_norm",
    "add_layer_norm": "add_layer_norm",
    "gate_up_swiglu": "linear_swiglu",
    "gated_act_linear": "gated_linear",
    "gated_act": "gated_act",
    "bias_act": "bias_act",
    "linear_bias_act": "gemm_epilogue",
    "linear_residual": "gemm_epilogue",
    "rope": "rope_qk",
    "rope_kv_cache": "rope_qk_cache",
    "rope_table": "rope_table",
    "attention_rope": "attention",
    "attention": "attention",
    "qkv_merge": "merged_linear",
    "gate_up_merge": "merged_linear",
    "linear_merge": "merged_linear",
}
# Kernels without a Triton config space (nothing to tune).
UNTUNED_KERNELS = {"merged_linear"}
# The plan key (and tune parameter, ablation row) for CUDA graphs on/off.
CUDA_GRAPH = "cuda_graph"
# The plan key (and tune parameter, ablation row) for programmatic dependent launch of our
# kernels (CUDA sm_90+; advisor/kernels/_triton.py `programmatic_launch`).
PDL = "pdl"
# Plan-wide on/off switches (Plan fields of these names), as opposed to fusion families.
PLAN_FLAGS = (CUDA_GRAPH, PDL)


@dataclass(frozen=True)
class Plan:
    """fusions: enabled families; configs: family -> kernel config text ("" = default);
    cuda_graph: replay captured graphs; pdl: launch our kernels with programmatic
    dependent launch (each may start during the previous one; it pays under CUDA graphs)."""

    fusions: tuple[str, ...] = ()
    configs: dict[str, str] = field(default_factory=dict)
    cuda_graph: bool = False
    pdl: bool = False

    def config_for(self, family: str) -> str:
        return self.configs.get(family, "")

    def to_json(self) -> dict:
        out = {"fusions": list(self.fusions), "configs": dict(sorted(self.configs.items())),
               "cuda_graph": self.cuda_graph}
        if self.pdl:  # written only when on: recipes from before the option stay byte-equal
            out[PDL] = True
        return out


UNFUSED = Plan()
ALL_FUSIONS = Plan(fusions=tuple(FAMILIES))
