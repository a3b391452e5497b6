"""Tiny `transformers` models of several families, built from configs (random weights)."""

from __future__ import annotations

import torch

FAMILIES = ("Llama", "Gemma", "Qwen2", "GPTNeoX", "Phi3", "Mistral")


def tiny_hf(name: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    transformers = __import__("transformers")
    config_cls = getattr(transformers, f"{name}Config")
    model_cls = getattr(transformers, f"{name}ForCausalLM")
    kw: dict = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                    vocab_size=128, max_position_embeddings=256, pad_token_id=0, eos_token_id=1,
                    bos_token_id=1)
    if name != "GPTNeoX":
        kw["num_key_value_heads"] = 2
    if name == "Gemma":
        kw["head_dim"] = 16
    config = config_cls(**kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = model_cls(config).eval()
    # Random (not all-ones / all-zeros) norm weights so a dropped weight term is caught.
    with torch.no_grad():
        for name_, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in name_ or "ln" in name_ else p.normal_(0, 0.02)
    return model.to(dtype)


def ids(seq_len: int, batch: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed + seq_len)
    return {"input_ids": torch.randint(2, 128, (batch, seq_len), generator=g), "use_cache": False}
