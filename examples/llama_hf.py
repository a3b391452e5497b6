"""A `transformers` Llama built from a config (random weights, no downloads).

On CUDA it has Llama-3-8B dimensions with 8 layers (the project's reference model);
on the CPU it is tiny. Override with ADVISOR_EXAMPLE_SIZE=tiny|full.
"""

from __future__ import annotations

import os

import torch

VOCAB_TINY = 256


def _config(device: torch.device):
    from transformers import LlamaConfig

    size = os.environ.get("ADVISOR_EXAMPLE_SIZE", "full" if device.type == "cuda" else "tiny")
    if size == "full":
        return LlamaConfig(
            hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
            num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
            max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        )
    return LlamaConfig(
        hidden_size=96, intermediate_size=200, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, vocab_size=VOCAB_TINY,
        max_position_embeddings=4096, rms_norm_eps=1e-5,
    )


def build_model(device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = _config(torch.device(device))
    config._attn_implementation = "sdpa"
    with torch.device(device):
        model = LlamaForCausalLM(config)
    return model.to(dtype=dtype).eval()


def make_inputs(seq_len: int, batch: int, device: torch.device) -> dict:
    vocab = _config(torch.device(device)).vocab_size
    g = torch.Generator().manual_seed(seq_len * 1000 + batch)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(device)
    return {"input_ids": ids, "use_cache": False}


def make_decode_inputs(context_len: int, batch: int, device: torch.device,
                       dtype: torch.dtype = torch.float32) -> dict:
    """One decode step: a new token per sequence and a static KV cache already holding
    `context_len` positions (random keys/values: latency does not depend on them, and the
    fused and unfused models read the same cache), with room for max(context_len, 256) more
    steps. The default advance (input_ids, cache_position + 1) generates from it."""
    from transformers import StaticCache

    config = _config(torch.device(device))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    max_len = context_len + max(context_len, 256)
    cache = StaticCache(config=config, max_cache_len=max_len)
    g = torch.Generator().manual_seed(context_len * 7 + batch)
    shape = (batch, config.num_key_value_heads, context_len, head_dim)
    positions = torch.arange(context_len, device=device)
    for layer in range(config.num_hidden_layers):
        k = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        v = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
        cache.update(k, v, layer, {"cache_position": positions})
    ids = torch.randint(0, config.vocab_size, (batch, 1), generator=g).to(device)
    return {"input_ids": ids, "past_key_values": cache, "use_cache": True,
            "cache_position": torch.tensor([context_len], device=device)}
